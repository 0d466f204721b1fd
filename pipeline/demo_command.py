"""`memstream demo`: generate the demo corpus, run the corpus job over it, score the answers.

The demo is the main job on the embedded defaults: local Ray, a local folder, SQLite state and
a small real model on the CPU. Rerunning it resumes the same run, so answered chains are skipped.
"""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow.parquet as pq
from rich.console import Console
from rich.table import Table

from . import democorpus
from .config import MethodConfig
from .core.extraction import string_match_any
from .engines.factory import EngineSpec
from .job import JobSpec, OutputSpec, run_job
from .progress import progress_bar
from .run_command import summary_table


def run_demo(output: Path, spec: EngineSpec, method: MethodConfig, scale: float) -> int:
    console = Console(stderr=True, soft_wrap=True, highlight=False)
    output = output.resolve()
    corpus = output / "corpus"
    documents = democorpus.generate(scale=scale)
    expected_file = democorpus.write(corpus, documents)
    console.print(f"demo corpus: {len(documents)} documents with planted facts in {corpus}")
    job = JobSpec(
        sources=(str(corpus),),
        output=OutputSpec(uri=str(output / "runs")),
        engine=spec,
        method=method,
    )
    with progress_bar(console) as show_progress:
        summary = run_job(job, on_progress=show_progress, progress_interval_s=2.0)
    Console().print(summary_table(summary))

    expected = {
        (row["document"], row["question"]): row["expected"]
        for row in map(json.loads, expected_file.read_text().splitlines())
    }
    answers = pq.read_table(summary.outputs["answers"]).to_pylist()
    table = Table(title=f"Planted facts, {spec.model}")
    for column in ("document", "tokens", "question", "expected", "answer", ""):
        table.add_column(column)
    correct = 0
    for row in sorted(answers, key=lambda r: (r["source_uri"], r["question_id"])):
        document = Path(row["source_uri"]).name
        gold = expected.get((document, row["question"]), "?")
        found = row["answer"] is not None and bool(string_match_any(row["answer"], [gold]))
        correct += found
        shown = row["answer"] if row["answer"] is not None else f"({row['status']}: no answer)"
        table.add_row(document, f"{row['n_tokens']:,}", row["question"], gold, shown,
                      "✓" if found else "✗")  # fmt: skip
    Console().print(table)
    print(f"{correct}/{len(expected)} planted facts found")
    folder = Path(summary.outputs["answers"]).parent
    print(f"outputs: {folder} (answers, trajectory, errors as Parquet; manifest.json)")
    query = f"SELECT source_uri, question, answer FROM '{folder}/answers.parquet'"
    print("look at them with DuckDB, e.g.:")
    print(f'  .venv/bin/python -c "import duckdb; duckdb.sql(\\"{query}\\").show()"')
    return 0 if summary.ok else 1
