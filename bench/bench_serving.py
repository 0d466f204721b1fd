"""Serving overhead: the Ray Serve endpoint against the runner called in process.

Short documents (one segment, one question) are answered by `clients` concurrent clients, each
sending `--requests-per-client` requests one after another (at least `--min-requests` per level),
with the project's runner in this process (prepare + ChainRunner on a VLLMEngine) and over HTTP
through `memstream serve` (started here as a subprocess, or `--url` of a running one) with the
same model, method and documents. Both engines stay up; the modes take turns at each level, so
load from other work on the machine falls on both alike. Reported per concurrency: requests/s,
p50 and p95 latency, and the ratios serve/in-process. Results go to bench/results/serving.{json,md}.

    PYTHONPATH=. .venv/bin/python bench/bench_serving.py          # 1, 4, 16 clients
    PYTHONPATH=. .venv/bin/python bench/bench_serving.py --concurrency 1 4 --requests-per-client 3

This is a benchmark, not a test: it takes a few minutes, most of it two engine start-ups.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import platform
import sys
import tempfile
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from contextlib import AsyncExitStack, asynccontextmanager
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from connectors.engines.hardware import detect
from connectors.processes import ServerProcess, free_port, start_memstream_serve

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "bench" / "results"

API_KEY = "bench-key-" + "5d1e0c8b7a6f4e3d"
Ask = Callable[[int], Awaitable[bool]]  # answers document i; True when it succeeded

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")


@dataclass(frozen=True)
class BenchSettings:
    model: str = "smollm2-135m-instruct"
    max_model_len: int = 2048
    kv_cache_gib: int = 1
    chunk_size: int = 300
    max_memory_tokens: int = 24
    max_answer_tokens: int = 24
    requests_per_client: int = 2
    min_requests: int = 8  # per concurrency level, so a single client is measured more than twice
    concurrency: tuple[int, ...] = (1, 4, 16)


@dataclass(frozen=True)
class Measurement:
    mode: str
    concurrency: int
    requests: int
    wall_s: float
    requests_per_s: float
    p50_s: float
    p95_s: float
    failed: int


def document(index: int) -> tuple[str, str]:
    """A short document (one segment) and its question."""
    text = (
        f"Record {index}. The shipment of record {index} left the depot on time. "
        f"The code word of record {index} is WORD{index:03d}. Nothing else happened."
    )
    return text, f"What is the code word of record {index}?"


def percentile(values: Sequence[float], fraction: float) -> float:
    ordered = sorted(values)
    return ordered[max(0, math.ceil(fraction * len(ordered)) - 1)]


async def closed_loop(
    mode: str, concurrency: int, settings: BenchSettings, ask: Ask
) -> Measurement:
    per_client = max(settings.requests_per_client, math.ceil(settings.min_requests / concurrency))
    first_index = 1000 * concurrency
    latencies: list[float] = []
    failures = 0

    async def client(number: int) -> None:
        nonlocal failures
        for turn in range(per_client):
            started = time.perf_counter()
            ok = await ask(first_index + number * per_client + turn)
            latencies.append(time.perf_counter() - started)
            failures += not ok

    started = time.perf_counter()
    await asyncio.gather(*(client(number) for number in range(concurrency)))
    wall = time.perf_counter() - started
    return Measurement(
        mode,
        concurrency,
        len(latencies),
        round(wall, 3),
        round(len(latencies) / wall, 3),
        round(percentile(latencies, 0.5), 3),
        round(percentile(latencies, 0.95), 3),
        failures,
    )


@asynccontextmanager
async def in_process_asker(settings: BenchSettings) -> AsyncIterator[Ask]:
    """The project's runner on a VLLMEngine in this process, as `memstream ask` uses it."""
    from connectors.engines.factory import EngineSpec, load_tokenizer, open_engine
    from operators.core.chain import ChainStatus
    from operators.core.document import Document
    from operators.runner import ChainRunner
    from pipeline.ask import prepare

    spec = EngineSpec(**engine_spec(settings))
    method = method_config(settings)
    tokenizer = load_tokenizer(spec)
    engine = open_engine(spec)
    runner = ChainRunner(engine, method.sampling())

    async def ask(index: int) -> bool:
        text, question = document(index)
        prepared = prepare(
            Document(uri=f"doc-{index}", name=f"doc-{index}", text=text),
            [question],
            tokenizer,
            method,
        )
        (result,) = await runner.run(prepared.chains)
        return result.status == ChainStatus.DONE

    try:
        yield ask
    finally:
        await engine.shutdown()


@asynccontextmanager
async def serve_asker(url: str, key: str) -> AsyncIterator[Ask]:
    """POST /v1/answer on a running `memstream serve`."""
    import httpx

    async with httpx.AsyncClient(
        base_url=url,
        headers={"Authorization": f"Bearer {key}"},
        timeout=900,
        limits=httpx.Limits(max_connections=64),
    ) as http:

        async def ask(index: int) -> bool:
            text, question = document(index)
            response = await http.post("/v1/answer", json={"text": text, "questions": [question]})
            return response.status_code == 200 and response.json()["status"] == "succeeded"

        yield ask


async def measure(
    settings: BenchSettings, url: str, key: str, in_process: bool
) -> list[Measurement]:
    """Both modes at each concurrency level in turn, so both see the same machine load (the
    CPUs may be shared); only one of them runs at a time."""
    measurements: list[Measurement] = []
    async with AsyncExitStack() as stack:
        askers: dict[str, Ask] = {}
        if in_process:
            askers["in-process"] = await stack.enter_async_context(in_process_asker(settings))
        askers["serve"] = await stack.enter_async_context(serve_asker(url, key))
        for ask in askers.values():
            await ask(-1)  # warm-up
        for concurrency in settings.concurrency:
            for mode, ask in askers.items():
                measurement = await closed_loop(mode, concurrency, settings, ask)
                print_partial([measurement])
                measurements.append(measurement)
    return measurements


def engine_spec(settings: BenchSettings) -> dict[str, Any]:
    return {
        "model": settings.model,
        "max_model_len": settings.max_model_len,
        "cpu_kvcache_space_gib": settings.kv_cache_gib,
        "enforce_eager": True,
    }


def method_config(settings: BenchSettings) -> Any:
    from operators.config import MethodConfig

    return MethodConfig(
        chunk_size=settings.chunk_size,
        max_memory_tokens=settings.max_memory_tokens,
        max_answer_tokens=settings.max_answer_tokens,
    )


def start_serve(settings: BenchSettings, folder: Path) -> tuple[ServerProcess, str, float]:
    """`python -m serving.cli serve` on a free loopback port: the process, its URL, start-up s."""
    port = free_port()
    config = {
        "server": {"host": "127.0.0.1", "port": port},
        "engine": engine_spec(settings),
        "method": {
            "chunk_size": settings.chunk_size,
            "max_memory_tokens": settings.max_memory_tokens,
            "max_answer_tokens": settings.max_answer_tokens,
        },
        "store": {"url": f"sqlite:///{folder / 'serving.db'}"},
        "auth": {"require_keys": True},
    }
    return start_memstream_serve(config, folder, API_KEY)


def overheads(measurements: Sequence[Measurement]) -> list[dict[str, Any]]:
    by_key = {(m.mode, m.concurrency): m for m in measurements}
    rows = []
    for (mode, concurrency), local in sorted(by_key.items()):
        served = by_key.get(("serve", concurrency))
        if mode != "in-process" or served is None:
            continue
        rows.append(
            {
                "concurrency": concurrency,
                "p50_ratio": round(served.p50_s / local.p50_s, 2),
                "p95_ratio": round(served.p95_s / local.p95_s, 2),
                "throughput_ratio": round(served.requests_per_s / local.requests_per_s, 2),
            }
        )
    return rows


def markdown(report: dict[str, Any]) -> str:
    measurements = {(m["mode"], m["concurrency"]): m for m in report["measurements"]}
    ratios = {row["concurrency"]: row for row in report["overhead"]}
    lines = [
        "# Serving overhead: Ray Serve endpoint vs. runner in process",
        "",
        f"{report['settings']['model']}, chunk {report['settings']['chunk_size']} tokens, "
        f"memory/answer {report['settings']['max_memory_tokens']}/"
        f"{report['settings']['max_answer_tokens']} tokens, one-segment documents, one question; "
        f"at least {report['settings']['requests_per_client']} requests per client and "
        f"{report['settings']['min_requests']} per level. "
        f"{report['machine'].get('cpu', str(report['machine']['cpus']) + ' CPUs')}, "
        f"{report['machine'].get('date', 'date not recorded')}; "
        f"load average {report['machine']['load_average']} "
        f"before the run, {report['machine']['load_average_end']} at its end (this benchmark's "
        f"two engines included). Serve start-up {report.get('serve_startup_s', 'n/a')} s.",
        "",
        "| clients | in-process req/s | serve req/s | in-process p50 s | serve p50 s "
        "| in-process p95 s | serve p95 s | p50 ratio | throughput ratio |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for concurrency in report["settings"]["concurrency"]:
        local = measurements.get(("in-process", concurrency), {})
        served = measurements.get(("serve", concurrency), {})
        ratio = ratios.get(concurrency, {})
        lines.append(
            f"| {concurrency} | {local.get('requests_per_s', '-')} | "
            f"{served.get('requests_per_s', '-')} | {local.get('p50_s', '-')} | "
            f"{served.get('p50_s', '-')} | {local.get('p95_s', '-')} | "
            f"{served.get('p95_s', '-')} | {ratio.get('p50_ratio', '-')} | "
            f"{ratio.get('throughput_ratio', '-')} |"
        )
    failed = sum(m["failed"] for m in report["measurements"])
    lines += ["", f"Failed requests: {failed}.", ""]
    # The load at the end counts this benchmark's own engines; only the load before it says
    # whether other work shared the machine.
    before = report["machine"]["load_average"][0]
    if before > report["machine"]["cpus"] / 2:
        lines += [
            f"**The machine was busy with other work (1-minute load {before} on "
            f"{report['machine']['cpus']} CPUs): these numbers measure contention more than "
            "serving overhead; rerun on a quiet machine.**",
            "",
        ]
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 4, 16])
    parser.add_argument("--requests-per-client", type=int, default=2)
    parser.add_argument("--min-requests", type=int, default=8, help="per concurrency level")
    parser.add_argument("--model", default=BenchSettings.model)
    parser.add_argument("--url", help="a running `memstream serve` (its key in MEMSTREAM_API_KEY)")
    parser.add_argument("--skip-in-process", action="store_true")
    parser.add_argument("--quick", action="store_true", help="1 and 4 clients, 4 requests a level")
    args = parser.parse_args(argv)
    if args.quick:
        args.concurrency, args.requests_per_client, args.min_requests = [1, 4], 1, 4
    settings = BenchSettings(
        model=args.model,
        requests_per_client=args.requests_per_client,
        min_requests=args.min_requests,
        concurrency=tuple(args.concurrency),
    )
    report: dict[str, Any] = {
        "settings": asdict(settings),
        "machine": {
            "cpus": os.cpu_count(),
            "cpu": detect().describe(),
            "date": time.strftime("%Y-%m-%d %H:%M"),
            "load_average": [round(x, 2) for x in os.getloadavg()],
            "python": platform.python_version(),
        },
    }
    in_process = not args.skip_in_process
    if args.url:
        key = os.environ.get("MEMSTREAM_API_KEY", "")
        measurements = asyncio.run(measure(settings, args.url, key, in_process))
    else:
        with tempfile.TemporaryDirectory(prefix="bench-serving-") as folder:
            server, url, startup_s = start_serve(settings, Path(folder))
            report["serve_startup_s"] = round(startup_s, 1)
            try:
                measurements = asyncio.run(measure(settings, url, API_KEY, in_process))
            finally:
                server.stop(grace=180)
    report["machine"]["load_average_end"] = [round(x, 2) for x in os.getloadavg()]
    report["measurements"] = [asdict(m) for m in measurements]
    report["overhead"] = overheads(measurements)
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "serving.json").write_text(json.dumps(report, indent=2) + "\n")
    table = markdown(report)
    (RESULTS / "serving.md").write_text(table)
    print(table)
    return 0


def print_partial(measurements: Sequence[Measurement]) -> None:
    for m in measurements:
        print(
            f"{m.mode:>10} x{m.concurrency:<3} {m.requests_per_s:7.2f} req/s "
            f"p50 {m.p50_s:6.2f} s  p95 {m.p95_s:6.2f} s",
            flush=True,
        )


if __name__ == "__main__":
    sys.exit(main())
