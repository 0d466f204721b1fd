"""Several questions on one document: cost per question as K grows, with vLLM's prefix cache.

K questions about one document of real text are K chains over the same segments, run at once on
one engine (prefix caching on, as in VLLMEngineConfig). Each K runs with the reference template,
whose update prompts differ from the question on, and with `segment-first`, whose update prompts
of one segment share chat template, instruction and section. The prefix cache is emptied before
every run and the two templates take turns going first, so neither inherits the other's KV.

    .venv/bin/python bench/multi_question.py                     # K = 1, 4, 16, 8000 tokens
    .venv/bin/python bench/multi_question.py --ks 1,8 --tokens 4000
"""

from __future__ import annotations

import asyncio
from typing import Any

import common

from operators.core.document import Document
from operators.runner import ChainRunner
from pipeline.ask import prepare

TEMPLATES = ("memagent-reference", "segment-first")
TOPICS = (
    "caching", "proxies", "status codes", "persistent connections", "content negotiation",
    "authentication", "the Host header", "chunked transfer coding", "byte ranges",
    "message length", "URI syntax", "date formats", "character sets", "entity tags",
    "the TRACE method", "security considerations",
)  # fmt: skip


def questions(k: int) -> list[str]:
    return [f"What does the document say about {TOPICS[i % len(TOPICS)]}?" for i in range(k)]


async def measure(args: Any, ks: list[int]) -> list[dict[str, Any]]:
    config = common.engine_config(args)
    tokenizer = common.load_tokenizer(config)
    ((doc_id, text),) = common.documents_of_lengths(tokenizer, [args.tokens])
    rows = []
    async with common.warm_engine(config) as engine:
        for index, k in enumerate(ks):
            for template in TEMPLATES[:: 1 if index % 2 == 0 else -1]:
                method = common.bench_method(args, template)
                document = prepare(
                    Document(uri=doc_id, name=doc_id, text=text), questions(k), tokenizer, method
                )
                await engine.reset_prefix_cache()
                runner = ChainRunner(engine, method.sampling())
                run = await common.timed_run(runner, document.chains)
                rows.append({"k": k, "template": template, **run,
                             "s_per_question": run["seconds"] / k})  # fmt: skip
                print(f"K={k} {template}: {run['seconds']:.1f} s", flush=True)
    return rows


def main() -> None:
    parser = common.bench_parser(__doc__)
    parser.add_argument("--tokens", type=int, help="document length; default 8000")
    parser.add_argument("--ks", help="numbers of questions; default 1,4,16")
    args = parser.parse_args()
    args.tokens = args.tokens or (2000 if args.quick else 8000)
    args.ks = args.ks or ("1,4" if args.quick else "1,4,16")
    ks = [int(k) for k in args.ks.split(",")]
    rows = asyncio.run(measure(args, ks))
    by = {(r["k"], r["template"]): r for r in rows}
    cells = []
    for k in ks:
        reference, shared = by[k, TEMPLATES[0]], by[k, TEMPLATES[1]]
        cells.append((
            k,
            f"{reference['seconds']:.1f}", f"{reference['s_per_question']:.1f}",
            f"{shared['seconds']:.1f}", f"{shared['s_per_question']:.1f}",
            f"{reference['s_per_question'] / by[ks[0], TEMPLATES[0]]['s_per_question']:.2f}x",
            f"{shared['s_per_question'] / by[ks[0], TEMPLATES[1]]['s_per_question']:.2f}x",
            f"{shared['seconds'] / reference['seconds']:.2f}x",
        ))  # fmt: skip
    header = [
        "K questions",
        "reference s",
        "reference s/question",
        "segment-first s",
        "segment-first s/question",
        f"reference s/question vs K={ks[0]}",
        f"segment-first s/question vs K={ks[0]}",
        "segment-first / reference",
    ]
    failed = sum(r["failed"] for r in rows)
    markdown = "\n".join([
        f"Several questions on one document, {args.model}, {args.tokens}-token document of real "
        f"text, chunk {args.chunk_size}, memory {args.max_memory_tokens} tokens, "
        f"{common.resolve_dtype(args.dtype)}, eager, prefix "
        "caching on, cache emptied before each run",
        "",
        *common.table(header, cells),
        "",
        f"Failed chains: {failed}.",
    ])  # fmt: skip
    common.write_results("multi_question", {"args": vars(args), "rows": rows}, markdown)


if __name__ == "__main__":
    main()
