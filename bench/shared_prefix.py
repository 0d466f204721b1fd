"""Do questions about one section share its prefill when their prompts reach vLLM together?

With a section-first template, the update prompts of one segment for every question of a
document start with the same section text. This sends N prompts that share a 4,000-token prefix
two ways, the prefix cache emptied before each: all at once, and staggered (the first alone,
the others once it has produced its first token). It reports each request's cached prompt
tokens (vLLM's `num_cached_tokens`), its time to first token, and the wall time.

    .venv/bin/python bench/shared_prefix.py [--model NAME] [--questions 2] [--repeats 2]
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import time
from typing import Any

from common import real_text, table, write_results

from connectors.engines.factory import EngineSpec, open_engine
from connectors.engines.vllm_local import VLLMEngine, chat_prompt_ids
from pipeline.cli.env import collect

PREFIX_TOKENS = 4000


async def measure(
    engine: VLLMEngine, prefix: list[int], questions: int, staggered: bool
) -> dict[str, Any]:
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt
    from vllm.sampling_params import RequestOutputKind

    llm: Any = engine._llm
    tokenizer = engine.tokenizer
    ids = itertools.count()

    async def ask(question: int, first_token: asyncio.Event | None = None) -> tuple[int, float]:
        content = tokenizer.decode(prefix) + f"\n\nQuestion {question}: who is mentioned?"
        prompt = TokensPrompt(prompt_token_ids=chat_prompt_ids(tokenizer, content))
        params = SamplingParams(max_tokens=16, temperature=0, output_kind=RequestOutputKind.DELTA)
        started, first, cached = time.perf_counter(), 0.0, 0
        async for output in llm.generate(prompt, params, f"q{question}-{next(ids)}"):
            if not first:
                first = time.perf_counter() - started
                if first_token is not None:
                    first_token.set()
            cached = output.num_cached_tokens or cached
        return cached, first

    await engine.reset_prefix_cache()
    started = time.perf_counter()
    if staggered:
        led = asyncio.Event()
        leader = asyncio.create_task(ask(0, led))
        await led.wait()
        results = [await leader, *await asyncio.gather(*(ask(q) for q in range(1, questions)))]
    else:
        results = await asyncio.gather(*(ask(q) for q in range(questions)))
    return {
        "sent": "staggered" if staggered else "together",
        "wall s": round(time.perf_counter() - started, 1),
        "cached tokens per request": " / ".join(str(cached) for cached, _ in results),
        "first token s per request": " / ".join(f"{first:.1f}" for _, first in results),
    }


async def main(args: argparse.Namespace) -> None:
    spec = EngineSpec(model=args.model, max_model_len=8192, enforce_eager=True)
    engine = open_engine(spec)
    assert isinstance(engine, VLLMEngine)
    ids = engine.tokenizer(real_text(600_000), add_special_tokens=False)["input_ids"]
    rows = []
    try:
        for repeat in range(args.repeats):
            for staggered in (False, True):
                offset = (2 * repeat + staggered + 1) * PREFIX_TOKENS
                prefix = ids[offset : offset + PREFIX_TOKENS]
                rows.append(await measure(engine, prefix, args.questions, staggered))
                print(rows[-1], flush=True)
    finally:
        await engine.shutdown()
    machine = collect()
    heading = (
        f"Shared prefix, {args.model}, {args.questions} prompts sharing a {PREFIX_TOKENS}-token "
        f"prefix, 16-token answers, greedy, eager, prefix cache emptied before each row\n\n"
        f"CPU: {machine['cpu']['model']}; dtype {machine['dtype']}"
    )
    header = list(rows[0])
    markdown = "\n".join([heading, "", *table(header, [list(row.values()) for row in rows])])
    write_results("shared_prefix", {"model": args.model, "rows": rows}, markdown)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--questions", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=2)
    asyncio.run(main(parser.parse_args()))
