"""Scaling with length: single documents of real text, one chain each, one after another.

One engine is built once; each length is read by one chain (one question) alone on it. Reported
per length: seconds, seconds per million document tokens, model calls, the peak RSS of this
process and vLLM's child processes while that length ran (the KV cache is reserved up front, so
a bounded memory should keep it flat), and time per token relative to the smallest length.
Chunks are the method's 5,000 tokens (1,000 with --quick, whose documents are short).

    .venv/bin/python bench/scaling.py                          # 10K, 100K, 1M tokens
    .venv/bin/python bench/scaling.py --lengths 10000,100000,1000000,3500000  # overnight
"""

from __future__ import annotations

import asyncio
from typing import Any

import common

from connectors.engines.vllm_local import VLLMEngineConfig
from operators.config import MethodConfig
from operators.core.document import Document
from operators.runner import ChainRunner
from pipeline.ask import prepare

QUESTION = "What is this document about?"
GIB = 1024**3


async def measure(
    config: VLLMEngineConfig, lengths: list[int], method: MethodConfig
) -> list[dict[str, Any]]:
    tokenizer = common.load_tokenizer(config)
    rows = []
    async with common.warm_engine(config) as engine:
        runner = ChainRunner(engine, method.sampling())
        with common.PeakRss() as rss:
            for doc_id, text in common.documents_of_lengths(tokenizer, lengths):
                document = prepare(
                    Document(uri=doc_id, name=doc_id, text=text), [QUESTION], tokenizer, method
                )
                rss.reset()
                run = await common.timed_run(runner, document.chains)
                rows.append({
                    "tokens": document.n_tokens,
                    **run,
                    "s_per_million_tokens": run["seconds"] / document.n_tokens * 1e6,
                    "processed_tokens_per_s": run["processed_tokens"] / run["seconds"],
                    "peak_rss_gib": rss.peak_bytes / GIB,
                })  # fmt: skip
                print(f"{document.n_tokens} tokens: {run['seconds']:.1f} s", flush=True)
    return rows


def main() -> None:
    parser = common.bench_parser(__doc__)
    parser.add_argument(
        "--lengths", help="document tokens; default 10000,100000,1000000 (add 3500000 overnight)"
    )
    parser.set_defaults(chunk_size=None)
    args = parser.parse_args()
    args.lengths = args.lengths or ("1000,2000,4000" if args.quick else "10000,100000,1000000")
    args.chunk_size = args.chunk_size or (1000 if args.quick else 5000)
    lengths = [int(n) for n in args.lengths.split(",")]
    method = common.bench_method(args)
    config = common.engine_config(args, kv_cache_gib=1)
    rows = asyncio.run(measure(config, lengths, method))
    base = rows[0]["s_per_million_tokens"]
    for row in rows:
        row["time_per_token_ratio"] = row["s_per_million_tokens"] / base
    header = [
        "document tokens",
        "model calls",
        "seconds",
        "s per 1M tokens",
        "processed tokens/s",
        "peak RSS GiB (process tree)",
        "time/token vs smallest",
    ]
    cells = [
        (r["tokens"], r["model_calls"], f"{r['seconds']:.1f}", f"{r['s_per_million_tokens']:.0f}",
         f"{r['processed_tokens_per_s']:.0f}", f"{r['peak_rss_gib']:.2f}",
         f"{r['time_per_token_ratio']:.2f}x")
        for r in rows
    ]  # fmt: skip
    failed = [f"**The chain of {r['tokens']} tokens failed.**" for r in rows if r["failed"]]
    markdown = "\n".join([
        f"Scaling with length, {args.model}, one chain per document read alone, chunk "
        f"{args.chunk_size}, memory {args.max_memory_tokens} tokens, {config.dtype}, eager, "
        "one engine",
        "",
        *common.table(header, cells),
        "",
        "Processed tokens are prompt plus completion tokens of every call. RSS sums this "
        "process and vLLM's child processes (shared pages count once per process).",
        *failed,
    ])  # fmt: skip
    common.write_results("scaling", {"args": vars(args), "rows": rows}, markdown)


if __name__ == "__main__":
    main()
