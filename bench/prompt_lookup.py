"""Prompt lookup: what n-gram speculative decoding (`--prompt-lookup N`, vLLM's "ngram") does
to a lone chain and to a full engine.

A memory update copies much of its section and of the memory before it, so tokens proposed from
the prompt's own text are often right, and each accepted one saves an engine step. On the corpus
`bench/step_budget.py` draws (24 documents of 2K-50K tokens, 1-3 questions each, segment-first,
2,000-token chunks, memory 128, greedy, eager), one engine at a time, without then with lookup:

1. alone: the longest document's first chain, by itself (as `memstream ask` runs one question);
   its time, and how many of its memory updates came out the same as without lookup;
2. loaded: every chain at once, longest-first (the runner's makespan), then every request of
   that run replayed at once (the engine's throughput ceiling), as `step_budget.py` does.

    .venv/bin/python bench/prompt_lookup.py                    # 25 min, 2-core Xeon (AMX)
    .venv/bin/python bench/prompt_lookup.py --dtype float32 --max-tokens 20000
    .venv/bin/python bench/prompt_lookup.py --dtype float32 --alone-only   # run 1 only
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import replace
from typing import Any

import common
import corpus_efficiency as corpus
import step_budget

from connectors.engines.vllm_local import VLLMEngineConfig
from operators.config import MethodConfig
from operators.core.chain import MemoryChain
from operators.runner import ChainRunner
from pipeline.cli.env import collect

STEP_BUDGET = 2048  # vLLM's default, the engine's


async def alone(
    config: VLLMEngineConfig, chain: MemoryChain, method: MethodConfig
) -> dict[str, Any]:
    async with common.warm_engine(config) as engine:
        started = time.perf_counter()
        [result] = await ChainRunner(engine, method.sampling()).run([chain])
        seconds = time.perf_counter() - started
    return {
        "seconds": seconds,
        "steps": len(result.trajectory),
        "completion_tokens": result.completion_tokens,
        "outputs": [record.output for record in result.trajectory],
    }


def main() -> None:
    parser = step_budget.corpus_parser(__doc__)
    parser.add_argument("--tokens", type=int, default=4, help="prompt lookup's N")
    parser.add_argument(
        "--alone-only", action="store_true", help="only the lone chain (1), not the corpus (2)"
    )
    args = parser.parse_args()
    machine = collect()
    method, config, tokenizer, documents = step_budget.mixed_corpus(args, "prompt-lookup")
    longest = max(documents, key=lambda document: document.n_tokens)
    rows = []
    for lookup in (0, args.tokens):
        looked_up = replace(config, prompt_lookup_tokens=lookup)
        [chain, *_] = corpus.build_chains([longest], tokenizer, method)
        lone = asyncio.run(alone(looked_up, chain, method))
        loaded = None
        if not args.alone_only:
            chains = corpus.build_chains(documents, tokenizer, method)
            loaded = asyncio.run(step_budget.measure(STEP_BUDGET, looked_up, chains, method))
        rows.append({"prompt_lookup_tokens": lookup, "alone": lone, "loaded": loaded})
        print(lookup, lone["seconds"], loaded and loaded["seconds"], flush=True)
    plain, looked = (row["alone"]["outputs"] for row in rows)
    same = sum(a == b for a, b in zip(plain, looked, strict=True))
    cpu = machine["cpu"]
    base = rows[0]
    markdown = "\n".join([
        f"Prompt lookup, {args.model}, dtype {config.dtype}; {cpu['model']}, {cpu['cores']} "
        f"cores; corpus of {len(documents)} documents "
        f"({min(d.n_tokens for d in documents):,}-{longest.n_tokens:,} tokens), "
        f"{sum(len(d.questions) for d in documents)} chains, {corpus.TEMPLATE}, chunk "
        f"{args.chunk_size}, memory {args.max_memory_tokens}, greedy, eager, step budget "
        f"{STEP_BUDGET}; one sitting, one engine at a time",
        "",
        *common.table(
            ["prompt lookup", f"one chain alone s ({base['alone']['steps']} steps)",
             "corpus, runner longest-first s", "corpus, all requests at once s"],
            [(row["prompt_lookup_tokens"] or "off", f"{row['alone']['seconds']:.1f}",
              *corpus_cells(row["loaded"])) for row in rows],
        ),
        "",
        f"Memory updates of the lone chain identical with and without lookup: {same} of "
        f"{len(plain)}.",
    ])  # fmt: skip
    for row in rows:
        del row["alone"]["outputs"]
    payload = {"args": vars(args), "rows": rows, "same_updates": same, "updates": len(plain),
               "cpu": cpu, "dtype": config.dtype}  # fmt: skip
    # A lone-chain-only run keeps its own file, so it never replaces a full run's corpus figures.
    alone_only = "-alone" if args.alone_only else ""
    common.write_results(f"prompt_lookup-{config.dtype}{alone_only}", payload, markdown)


def corpus_cells(loaded: dict[str, Any] | None) -> tuple[str, str]:
    if loaded is None:
        return "not run", "not run"
    return f"{loaded['seconds']:.1f}", f"{loaded['ceiling_s']:.1f}"


if __name__ == "__main__":
    main()
