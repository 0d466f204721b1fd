"""Planted-fact accuracy of memory strategies on the demo corpus, all chains on one engine.

    .venv/bin/python bench/demo_strategies.py MODEL SCALE TEMPLATE[,TEMPLATE...] [CHUNK_SIZE]
e.g. `qwen2.5-coder-0.5b-instruct 0.25 memagent-reference,append-evidence` (the README's table).
Results: bench/results/demo_strategies-MODEL-scaleSCALE-chunkCHUNK_SIZE.{json,md}, with the CPU
and the dtype.
"""

from __future__ import annotations

import asyncio
import sys
import time
from typing import Any

import common

from connectors.engines.factory import EngineSpec, load_tokenizer, open_engine
from operators.config import MethodConfig
from operators.core.document import Document
from operators.core.extraction import string_match_any
from operators.runner import ChainRunner
from pipeline import democorpus
from pipeline.ask import answer, prepare
from pipeline.cli.env import collect


async def main(model: str, scale: float, templates: list[str], chunk_size: int) -> None:
    spec = EngineSpec(model=model, enforce_eager=True, cpu_kvcache_space_gib=3, max_model_len=8192)
    spec = spec.resolved()
    engine, tokenizer = open_engine(spec), load_tokenizer(spec)
    documents = democorpus.generate(scale=scale)
    prepared, origins = [], []
    for template in templates:
        method = MethodConfig(
            chunk_size=chunk_size, max_memory_tokens=256, max_answer_tokens=64, template=template
        )
        for document in documents:
            questions = [fact.question for fact in document.facts]
            doc_input = Document(
                uri=f"{template}|{document.name}", name=document.name, text=document.text
            )
            prepared.append(prepare(doc_input, questions, tokenizer, method))
            origins.append((template, document))
    started = time.perf_counter()
    try:
        results = await answer(ChainRunner(engine, MethodConfig().sampling()), prepared)
    finally:
        await engine.shutdown()
    elapsed = time.perf_counter() - started
    found: dict[str, list[bool]] = {}
    formatted: dict[str, int] = {}
    grounded: dict[str, list[tuple[bool, bool]]] = {}  # (grounded, correct) per answer given
    for ready, (template, document) in zip(prepared, origins, strict=True):
        for fact, result in zip(document.facts, results[ready.uri], strict=True):
            correct = result.answer is not None and bool(
                string_match_any(result.answer, [fact.answer])
            )
            found.setdefault(template, []).append(correct)
            formatted[template] = formatted.get(template, 0) + (result.answer is not None)
            grounding = ready.grounding(result)
            if result.answer is not None:
                grounded.setdefault(template, []).append((grounding.grounded, correct))
            mark = "grounded" if grounding.grounded else "not grounded"
            print(template, document.name, ready.n_tokens, fact.answer, "->",
                  repr(result.answer), f"[{mark}]")  # fmt: skip
    steps = sum(len(ready.segments) + 1 for ready in prepared for _ in ready.chains)
    rows: list[dict[str, Any]] = []
    for template, hits in found.items():
        marks = grounded.get(template, [])
        rows.append({
            "template": template,
            "found": sum(hits),
            "facts": len(hits),
            "answer_format": formatted[template],
            "grounded": sum(is_grounded for is_grounded, _ in marks),
            "right_among_grounded": sum(c for is_grounded, c in marks if is_grounded),
            "right_among_ungrounded": sum(c for is_grounded, c in marks if not is_grounded),
        })  # fmt: skip
    cpu = collect()["cpu"]
    markdown = "\n".join([
        f"Demo corpus facts, {model}, scale {scale} "
        f"({', '.join(f'{d.n_tokens:,}' for d in prepared[: len(documents)])} tokens), chunk "
        f"{chunk_size}, memory 256, answer 64, greedy, dtype {spec.dtype}; {cpu['model']}, "
        f"{cpu['cores']} cores; {steps} model calls in {elapsed:.0f} s "
        f"({elapsed / steps:.1f} s per call), every template's chains at once",
        "",
        *common.table(
            ["template", "found", "in the answer format", "grounded", "right among grounded",
             "right among not grounded"],
            [(r["template"], f"{r['found']}/{r['facts']}", r["answer_format"], r["grounded"],
              r["right_among_grounded"], r["right_among_ungrounded"]) for r in rows],
        ),
    ])  # fmt: skip
    payload = {"model": model, "scale": scale, "chunk_size": chunk_size, "dtype": spec.dtype,
               "cpu": cpu, "model_calls": steps, "seconds": elapsed, "rows": rows}  # fmt: skip
    common.write_results(
        f"demo_strategies-{model}-scale{scale:g}-chunk{chunk_size}", payload, markdown
    )


if __name__ == "__main__":
    chunk_size = int(sys.argv[4]) if len(sys.argv) > 4 else 5000
    asyncio.run(main(sys.argv[1], float(sys.argv[2]), sys.argv[3].split(","), chunk_size))
