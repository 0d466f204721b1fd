"""Raw engine speed: prefill tokens/s at two prompt lengths and decode tokens/s for 8 sequences.

.venv/bin/python bench/prefill_decode.py [--model NAME] [--compile]
"""

from __future__ import annotations

import argparse
import asyncio
import time

from common import real_text

from pipeline.engines.base import GenerationRequest
from pipeline.engines.factory import EngineSpec, open_engine


async def measure(spec: EngineSpec) -> list[str]:
    started = time.perf_counter()
    engine = open_engine(spec)
    lines = [
        f"{spec.model}, eager={spec.enforce_eager}: start-up {time.perf_counter() - started:.0f} s"
    ]
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
            lines.append(f"prefill, ~{prompt_tokens}-token prompts: {total / elapsed:.0f} tokens/s")
        requests = [
            GenerationRequest(f"d{i}", f"Write a long story about cat {i}.", 128) for i in range(8)
        ]
        started = time.perf_counter()
        done = await asyncio.gather(*(engine.generate(r) for r in requests))
        elapsed = time.perf_counter() - started
        lines.append(
            f"decode, 8 sequences: {sum(c.completion_tokens for c in done) / elapsed:.0f} tokens/s"
        )
    finally:
        await engine.shutdown()
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--compile", action="store_true", help="torch.compile instead of eager")
    args = parser.parse_args()
    spec = EngineSpec(model=args.model, enforce_eager=not args.compile, cpu_kvcache_space_gib=3,
                      max_model_len=8192)  # fmt: skip
    print("\n".join(asyncio.run(measure(spec))))


if __name__ == "__main__":
    main()
