"""Step budget: how the most prompt tokens one engine step takes (vLLM's max_num_batched_tokens)
changes the time a mixed-length corpus takes.

A chain's steps are sequential, so a corpus run cannot end before its longest chain, and each of
that chain's decoded tokens waits for a whole engine step, which other chains' prefills fill up
to the budget. For each budget, on one corpus drawn as `corpus_efficiency.py` draws it (24
documents, log-normal lengths, 1-3 questions each, segment-first, 2,000-token chunks, memory
128): the runner longest-first (its makespan and its longest chain's steps), then every request
of that run replayed at once (the throughput ceiling at that budget). One engine at a time.

    .venv/bin/python bench/step_budget.py                          # 2048,512,256 to 50K: 45 min
    .venv/bin/python bench/step_budget.py --budgets 2048,512 --max-tokens 20000
"""

from __future__ import annotations

import argparse
import asyncio
from dataclasses import replace
from typing import Any

import common
import corpus_efficiency as corpus

from connectors.engines.vllm_local import VLLMEngineConfig
from operators.config import MethodConfig
from operators.core.chain import MemoryChain
from pipeline.cli.env import collect

DEFAULT_MAX_TOKENS = 50_000  # results of other sizes go to step_budget-<max tokens>.md/json


async def measure(
    budget: int, config: VLLMEngineConfig, chains: list[MemoryChain], method: MethodConfig
) -> dict[str, Any]:
    """The runner longest-first at this budget, then its requests replayed at once."""
    async with common.warm_engine(replace(config, max_num_batched_tokens=budget)) as engine:
        run, requests = await corpus.run_runner(engine, chains, method, longest_first=True)
        ceiling = await corpus.replay_at_once(engine, requests)
    return {
        "budget": budget,
        **run,
        "ceiling_s": ceiling["seconds"],
        "runner_of_ceiling": ceiling["seconds"] / run["seconds"],
    }


def corpus_parser(doc: str) -> argparse.ArgumentParser:
    """The options of a benchmark on this corpus: the engine's, and the longest document."""
    parser = common.bench_parser(doc)
    parser.set_defaults(chunk_size=2000, max_memory_tokens=128, dtype="auto")
    parser.add_argument(
        "--max-tokens", type=int, default=DEFAULT_MAX_TOKENS, help="the longest document"
    )
    return parser


def mixed_corpus(
    args: argparse.Namespace, label: str
) -> tuple[MethodConfig, VLLMEngineConfig, Any, list[corpus.CorpusDocument]]:
    """The method, engine settings and tokenizer of the benchmark, and its corpus, drawn as
    `corpus_efficiency.py` draws it up to `--max-tokens` and written under the cache."""
    sizes = corpus.Sizes(
        documents=24, min_tokens=2000, max_tokens=args.max_tokens,
        chunk_size=args.chunk_size, max_memory_tokens=args.max_memory_tokens,
    )  # fmt: skip
    method = common.bench_method(args, corpus.TEMPLATE)
    config = common.engine_config(args, corpus.KV_CACHE_GIB)
    tokenizer = common.load_tokenizer(config)
    work = corpus.default_work_folder(f"{label}-{args.max_tokens}-{config.dtype}")
    return method, config, tokenizer, corpus.write_corpus(work / "corpus", sizes, tokenizer)


def main() -> None:
    parser = corpus_parser(__doc__)
    parser.add_argument("--budgets", default="2048,512,256", help="step budgets, in run order")
    args = parser.parse_args()
    machine = collect()
    method, config, tokenizer, documents = mixed_corpus(args, "step-budget")
    rows = []
    for budget in (int(b) for b in args.budgets.split(",")):
        chains = corpus.build_chains(documents, tokenizer, method)
        rows.append(asyncio.run(measure(budget, config, chains, method)))
        print(rows[-1], flush=True)
    lengths = sorted(document.n_tokens for document in documents)
    cpu = machine["cpu"]
    markdown = "\n".join([
        f"Step budget, {args.model}, {len(documents)} documents of real text ({lengths[0]:,}-"
        f"{lengths[-1]:,} tokens, total {sum(lengths):,}), "
        f"{sum(len(d.questions) for d in documents)} chains, {corpus.TEMPLATE}, chunk "
        f"{args.chunk_size}, memory {args.max_memory_tokens}, greedy, eager; {cpu['model']}, "
        f"{cpu['cores']} cores, dtype {machine['dtype']}",
        "",
        *common.table(
            ["step budget (tokens)", "runner makespan s", "its longest chain s (steps)",
             "ceiling s", "runner / ceiling", "mean requests in flight", "failed chains"],
            [(r["budget"], f"{r['seconds']:.1f}",
              f"{r['longest_chain_s']:.1f} ({r['longest_chain_steps']})", f"{r['ceiling_s']:.1f}",
              f"{r['runner_of_ceiling']:.2f}", f"{r['mean_requests_in_flight']:.1f}",
              r["failed_chains"]) for r in rows],
        ),
    ])  # fmt: skip
    payload = {"args": vars(args), "rows": rows, "cpu": cpu, "dtype": machine["dtype"]}
    size = "" if args.max_tokens == DEFAULT_MAX_TOKENS else f"-{args.max_tokens}"
    common.write_results(f"step_budget{size}", payload, markdown)


if __name__ == "__main__":
    main()
