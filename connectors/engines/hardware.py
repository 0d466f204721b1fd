"""What this machine computes fast: its CPU features and GPUs, and the dtype `auto` picks for them.

vLLM's CPU platform reports bfloat16 as supported on every x86 CPU, but only CPUs with
`avx512_bf16` or AMX have native bf16 kernels; elsewhere bf16 is emulated, and slower than float32
(bench/results/prefill_decode-smollm2-135m-instruct.md). So `auto` chooses by the hardware:
bfloat16 where it is native, float32 on other CPUs, float16 on GPUs older than compute
capability 8.0.
"""

from __future__ import annotations

import functools
import logging
import os
import platform
from collections.abc import Mapping
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Literal, get_args

from operators.config import ConfigError

logger = logging.getLogger(__name__)

Dtype = Literal["auto", "float32", "bfloat16", "float16"]
DTYPES: tuple[str, ...] = get_args(Dtype)
DTYPE_ENV = "MEMSTREAM_DTYPE"  # overrides `auto` everywhere: commands, jobs, tests, CI
# The share of a GPU's memory each engine reserves when a spec does not say: vLLM's 0.9 leaves
# no room for a second engine on the GPU, as the test suite opens beside its shared one.
GPU_MEMORY_ENV = "MEMSTREAM_GPU_MEMORY_UTILIZATION"
DEFAULT_GPU_MEMORY_UTILIZATION = 0.9
NATIVE_BF16_FLAGS = frozenset({"avx512_bf16", "amx_bf16"})
# The CPU features that decide how fast a CPU engine runs, as /proc/cpuinfo names them.
FEATURES_OF_INTEREST = ("avx2", "avx512f", "avx512_bf16", "amx_bf16", "amx_tile", "asimd", "sve")
EMULATED_BF16_COST = (
    "bfloat16 on a CPU without native bf16 (no avx512_bf16 or AMX) is emulated: on an AVX2-only "
    "EPYC, Qwen2.5-Coder-0.5B prefilled 24 tokens/s in bfloat16 against 134 in float32; "
    "use --dtype auto or float32"
)


@dataclass(frozen=True)
class Gpu:
    name: str
    capability: tuple[int, int]  # CUDA compute capability


@dataclass(frozen=True)
class Hardware:
    cpu_model: str
    cores: int  # usable by this process
    cpu_flags: frozenset[str]
    gpus: tuple[Gpu, ...] = ()

    @property
    def native_bf16(self) -> bool:
        return bool(self.cpu_flags & NATIVE_BF16_FLAGS)

    @property
    def features(self) -> dict[str, bool]:
        return {flag: flag in self.cpu_flags for flag in FEATURES_OF_INTEREST}

    def describe(self) -> str:
        """One line for a figure's caption: which machine made it."""
        bf16 = "native bf16" if self.native_bf16 else "no native bf16"
        gpus = ", ".join(gpu.name for gpu in self.gpus) or "no GPU"
        return f"{self.cpu_model}, {self.cores} cores, {bf16}, {gpus}"


# What a job with GPU actors assumes of GPUs it cannot see from its driver: `auto` is bfloat16
# there; older GPUs (compute capability below 8.0) need --dtype float16.
ASSUMED_CLUSTER_GPU = Gpu("a GPU of the cluster (assumed compute capability 8.0+)", (8, 0))


def with_gpu_workers(hardware: Hardware) -> Hardware:
    """`hardware` as a job with GPU actors sees it: its own GPUs, or the assumed cluster GPU."""
    return hardware if hardware.gpus else replace(hardware, gpus=(ASSUMED_CLUSTER_GPU,))


@functools.cache
def detect() -> Hardware:
    """This machine, read once per process. GPUs are looked for only where torch has CUDA."""
    model, flags = _cpuinfo(Path("/proc/cpuinfo"))
    return Hardware(
        cpu_model=model or platform.processor() or platform.machine(),
        cores=len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count(),
        cpu_flags=flags,
        gpus=_cuda_gpus(),
    )  # type: ignore[arg-type]


def _cpuinfo(path: Path) -> tuple[str, frozenset[str]]:
    try:
        text = path.read_text(errors="replace")
    except OSError:
        return "", frozenset()
    model, flags = "", frozenset[str]()
    for line in text.splitlines():
        key, _, value = line.partition(":")
        key = key.strip()
        if key == "model name" and not model:
            model = value.strip()
        elif key in ("flags", "Features") and not flags:  # x86, aarch64
            flags = frozenset(value.split())
    return model, flags


def _cuda_gpus() -> tuple[Gpu, ...]:
    try:
        import torch
    except ImportError:
        return ()
    if not torch.cuda.is_available():
        return ()
    return tuple(
        Gpu(torch.cuda.get_device_name(i), tuple(torch.cuda.get_device_capability(i)))  # type: ignore[arg-type]
        for i in range(torch.cuda.device_count())
    )


def auto_dtype(hardware: Hardware) -> str:
    """bfloat16 on GPUs of compute capability 8.0+ and on CPUs with native bf16; float16 on
    older GPUs; float32 on every other CPU."""
    if hardware.gpus:
        return "bfloat16" if min(gpu.capability for gpu in hardware.gpus) >= (8, 0) else "float16"
    return "bfloat16" if hardware.native_bf16 else "float32"


def auto_reason(hardware: Hardware) -> str:
    """Why `auto_dtype` chose what it did, in a few words."""
    if hardware.gpus:
        lowest = min(gpu.capability for gpu in hardware.gpus)
        return f"GPU of compute capability {lowest[0]}.{lowest[1]}"
    native = sorted(hardware.cpu_flags & NATIVE_BF16_FLAGS)
    return f"CPU with native bf16 ({', '.join(native)})" if native else "CPU without native bf16"


def resolve_dtype(
    requested: str = "auto",
    hardware: Hardware | None = None,
    environ: Mapping[str, str] = os.environ,
) -> str:
    """The concrete dtype an engine runs in. `auto` takes `$MEMSTREAM_DTYPE` when it is set,
    else the hardware's choice; a named dtype is kept, with a warning when it is bfloat16 on a
    CPU that would emulate it."""
    if requested == "auto":
        requested = environ.get(DTYPE_ENV, "").strip() or "auto"
        if requested not in DTYPES:
            raise ConfigError(f"{DTYPE_ENV}={requested!r}: must be one of {', '.join(DTYPES)}")
    if requested not in DTYPES:
        raise ValueError(f"dtype must be one of {', '.join(DTYPES)}, got {requested!r}")
    hardware = hardware or detect()
    if requested == "auto":
        return auto_dtype(hardware)
    if requested == "bfloat16" and not hardware.gpus and not hardware.native_bf16:
        _warn_once(EMULATED_BF16_COST)
    return requested


def default_gpu_memory_utilization(environ: Mapping[str, str] = os.environ) -> float:
    """`$MEMSTREAM_GPU_MEMORY_UTILIZATION` when set, else 0.9; a share in (0, 1]."""
    raw = environ.get(GPU_MEMORY_ENV, "").strip()
    if not raw:
        return DEFAULT_GPU_MEMORY_UTILIZATION
    try:
        share = float(raw)
    except ValueError:
        share = 0.0
    if not 0 < share <= 1:
        raise ConfigError(f"{GPU_MEMORY_ENV}={raw!r}: must be a share of the GPU in (0, 1]")
    return share


@functools.cache
def _warn_once(message: str) -> None:
    logger.warning(message)
