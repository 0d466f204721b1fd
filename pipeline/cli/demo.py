"""`memstream demo`: generate the demo corpus, run the corpus job over it, score the answers.

The demo is the main job on the embedded defaults: local Ray, a local folder, SQLite state and
a small real model on the CPU. Rerunning it resumes the same run, so answered chains are skipped.
"""

from __future__ import annotations

import argparse
import json
from dataclasses import replace
from pathlib import Path
from typing import Any

import pyarrow.parquet as pq
from rich.table import Table

from connectors.engines import models
from connectors.engines.factory import EngineSpec
from operators.config import MethodConfig
from operators.core.evidence import Evidence
from operators.core.extraction import string_match_any
from pipeline import democorpus
from pipeline.cli import terminal
from pipeline.cli.ask import describe_evidence
from pipeline.cli.flags import (
    add_engine_arguments,
    add_method_arguments,
    add_verbose_argument,
    engine_spec,
    method_config,
    positive_float,
)
from pipeline.cli.run import run_with_progress
from pipeline.job import JobSpec, OutputSpec
from pipeline.report import write_report


def register(subparsers: Any) -> None:
    parser = subparsers.add_parser("demo", help="generate the demo corpus and answer its questions")
    parser.add_argument(
        "--output",
        type=Path,
        default=Path("demo-output"),
        help="folder of the demo corpus, the run's tables and the logs (default: %(default)s)",
    )
    parser.add_argument(
        "--scale",
        type=positive_float,
        default=1.0,
        help="document size factor; 1: 20K-90K tokens (default: %(default)s)",
    )
    # A demo should start fast and finish in minutes on a laptop CPU: eager mode (no compile),
    # and the short memory and answer budgets the demo's accuracy table was measured with.
    add_engine_arguments(parser, defaults={"enforce_eager": True})
    add_method_arguments(parser, defaults={"max_memory_tokens": 256, "max_answer_tokens": 64})
    add_verbose_argument(parser)
    parser.set_defaults(handler=run_demo_command)


def run_demo_command(args: argparse.Namespace) -> int:
    terminal.capture(args.output.resolve(), "demo", verbose=args.verbose)
    return run_demo(args.output, engine_spec(args), method_config(args), args.scale)


def run_demo(output: Path, spec: EngineSpec, method: MethodConfig, scale: float) -> int:
    term = terminal.current()
    console = term.console()
    output = output.resolve()
    corpus = output / "corpus"
    documents = democorpus.generate(scale=scale)
    expected_file = democorpus.write(corpus, documents)
    console.print(f"demo corpus: {len(documents)} documents with planted facts in {corpus}")
    models.ensure_pulled(spec.model, console.print)
    chains = sum(len(document.facts) for document in documents)  # a question per planted fact
    spec = replace(spec, prompt_lookup_tokens=spec.lookup_for(chains))
    job = JobSpec(
        sources=(str(corpus),),
        output=OutputSpec(uri=str(output / "runs")),
        engine=spec,
        method=method,
    )
    summary = run_with_progress(job, term)

    expected = {
        (row["document"], row["question"]): row["expected"]
        for row in map(json.loads, expected_file.read_text().splitlines())
    }
    answers = pq.read_table(summary.outputs["answers"]).to_pylist()
    table = Table(title=f"Planted facts, {spec.model}")
    for column in ("document", "tokens", "question", "expected", "answer", "", "grounded"):
        table.add_column(column)
    correct, evidence_lines = 0, []
    for row in sorted(answers, key=lambda r: (r["source_uri"], r["question_id"])):
        document = Path(row["source_uri"]).name
        gold = expected.get((document, row["question"]), "?")
        found = row["answer"] is not None and bool(string_match_any(row["answer"], [gold]))
        correct += found
        shown = row["answer"] if row["answer"] is not None else f"({row['status']}: no answer)"
        grounded = {True: "yes", False: "NO", None: "?"}[row["grounded"]]
        table.add_row(document, f"{row['n_tokens']:,}", row["question"], gold, shown,
                      "✓" if found else "✗", grounded)  # fmt: skip
        evidence_lines.append(f"{document}: {row['question']}")
        evidence_lines.append(f"  {grounded}: {row['grounding_reason']}")
        evidence_lines += [f"  {describe_evidence(Evidence(**e))}" for e in row["evidence"]]
    term.result_console().print(table)
    print("Evidence of each answer (where the answer and the memory are found in the source):",
          *evidence_lines, sep="\n", file=term.out)  # fmt: skip
    folder = Path(summary.outputs["answers"]).parent
    query = f"SELECT source_uri, question, answer FROM '{folder}/answers.parquet'"
    for line in (
        f"{correct}/{len(expected)} planted facts found",
        f"outputs: {folder} (answers, trajectory, errors as Parquet; manifest.json)",
        "look at them with DuckDB, e.g.:",
        f'  .venv/bin/python -c "import duckdb; duckdb.sql(\\"{query}\\").show()"',
    ):
        print(line, file=term.out)
    print(f"report: {write_report(folder)}", file=term.out)
    return 0 if summary.ok else 1
