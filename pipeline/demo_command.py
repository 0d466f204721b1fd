"""`memstream demo`: generate the demo corpus, answer its planted questions, score the answers."""

from __future__ import annotations

import asyncio
import json
from collections import defaultdict
from pathlib import Path

from rich.console import Console
from rich.table import Table

from . import democorpus
from .ask import DocumentInput, prepare
from .ask_command import run_with_progress
from .config import MethodConfig
from .core.extraction import string_match_any
from .engines.factory import EngineSpec, load_tokenizer


def run_demo(output: Path, spec: EngineSpec, method: MethodConfig, scale: float) -> int:
    console = Console(stderr=True, soft_wrap=True, highlight=False)
    documents = democorpus.generate(scale=scale)
    questions_file = democorpus.write(output / "corpus", documents)
    console.print(f"demo corpus: {len(documents)} documents in {questions_file.parent}")
    tokenizer = load_tokenizer(spec)
    prepared = [
        prepare(
            DocumentInput(document.name, document.text),
            [fact.question for fact in document.facts],
            tokenizer,
            method,
        )
        for document in documents
    ]
    results, timings = asyncio.run(run_with_progress(prepared, spec, method, console))

    table = Table(title=f"memstream demo: {spec.model}")
    for column in ("document", "tokens", "question", "expected", "answer", ""):
        table.add_column(column)
    records = []
    correct_by_document: dict[str, int] = defaultdict(int)
    for document, ready in zip(documents, prepared, strict=True):
        for fact, result in zip(document.facts, results[document.name], strict=True):
            correct = result.answer is not None and bool(
                string_match_any(result.answer, [fact.answer])
            )
            correct_by_document[document.name] += correct
            table.add_row(
                document.name,
                f"{ready.n_tokens:,}",
                fact.question,
                fact.answer,
                result.answer or f"({result.status}: no answer)",
                "✓" if correct else "✗",
            )
            records.append(
                {
                    "document": document.name,
                    "n_tokens": ready.n_tokens,
                    "n_segments": len(ready.segments),
                    "question": fact.question,
                    "expected": fact.answer,
                    "answer": result.answer,
                    "correct": correct,
                    "raw_response": result.raw_response,
                    "final_memory": result.final_memory,
                    "prompt_tokens": result.prompt_tokens,
                    "completion_tokens": result.completion_tokens,
                    "chain_s": round(result.elapsed_s, 2),
                    "status": result.status,
                    "error": result.error,
                }
            )
    Console().print(table)
    n_correct = sum(correct_by_document.values())
    n_steps = sum(r["n_segments"] + 1 for r in records)
    compute_s = timings["total_s"] - timings["engine_startup_s"]
    summary = {
        "model": spec.model,
        "method": method.as_dict(),
        "correct": n_correct,
        "questions": len(records),
        "steps": n_steps,
        "engine_startup_s": round(timings["engine_startup_s"], 1),
        "compute_s": round(compute_s, 1),
        "seconds_per_step": round(compute_s / n_steps, 2),
        "answers": records,
    }
    result_file = output / "answers.json"
    result_file.write_text(json.dumps(summary, indent=2) + "\n")
    startup = timings["engine_startup_s"]
    print(
        f"{n_correct}/{len(records)} planted facts found; {n_steps} model calls in "
        f"{compute_s:.0f} s ({compute_s / n_steps:.1f} s per call) after {startup:.0f} s start-up"
    )
    print(f"answers, memories and timings: {result_file}")
    return 0
