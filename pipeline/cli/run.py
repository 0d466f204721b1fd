"""`memstream run`: the corpus job from a YAML file, from flags, or both (flags win)."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from rich.table import Table

from connectors.engines import models
from operators.config import DocumentLimits
from operators.core.chain import ChainStatus
from pipeline.cli import terminal
from pipeline.cli.flags import (
    ENGINE_FLAGS,
    EXIT_PARTIAL_FAILURE,
    METHOD_FLAGS,
    add_engine_arguments,
    add_method_arguments,
    add_setting_flags,
    add_verbose_argument,
    setting_flags,
    setting_overrides,
)
from pipeline.cli.progress import progress_bar
from pipeline.job import (
    ConcurrencySpec,
    JobError,
    JobSpec,
    OutputSpec,
    RunSummary,
    load_job_spec,
    run_job,
)

# The job's settings a flag can give, from the records that declare them; the job file gives the
# rest (`schema`, `engine.engine_kwargs`).
INPUT_FLAGS = [
    *setting_flags(JobSpec, only=("sources", "questions", "questions_file")),
    *setting_flags(OutputSpec, "output"),
    *setting_flags(JobSpec, only=("state_store", "run_id", "ray_address")),
]
CONCURRENCY_FLAGS = setting_flags(ConcurrencySpec, "concurrency")
LIMITS_FLAGS = setting_flags(DocumentLimits, "limits")
FLAGS = [*INPUT_FLAGS, *ENGINE_FLAGS, *METHOD_FLAGS, *LIMITS_FLAGS, *CONCURRENCY_FLAGS]


def register(subparsers: Any) -> None:
    """Adds `run` to the `memstream` subcommands."""

    run = subparsers.add_parser(
        "run",
        help="answer questions about a whole corpus on Ray Data; resumable",
        description=(
            "Run a corpus job: read every document of the sources, answer every question about "
            "each, and write answers, trajectories and errors as Parquet under OUTPUT/RUN_ID/. "
            "Each run is a new run id that computes only new and changed documents and carries "
            "the other answers forward; a run after a crash resumes the unfinished run. "
            "Flags override the job file's keys of the same name."
        ),
        argument_default=argparse.SUPPRESS,
    )
    run.add_argument("job", nargs="?", metavar="JOB.yaml", help="a job file (see examples/)")
    add_verbose_argument(run)
    add_setting_flags(run.add_argument_group("inputs and outputs"), INPUT_FLAGS)
    add_engine_arguments(run)
    add_method_arguments(run)
    add_setting_flags(run.add_argument_group("limits of one document"), LIMITS_FLAGS)
    add_setting_flags(run.add_argument_group("concurrency"), CONCURRENCY_FLAGS)
    run.set_defaults(handler=run_command)


def run_command(args: argparse.Namespace) -> int:
    spec = spec_from_arguments(args)
    term = terminal.capture(
        Path(spec.output.uri) if spec.output.is_local else None,
        "run",
        verbose=getattr(args, "verbose", False),
    )
    models.ensure_pulled(spec.engine.model, term.console().print)
    summary = run_with_progress(spec, term)
    return 0 if summary.ok else EXIT_PARTIAL_FAILURE


def run_with_progress(spec: JobSpec, term: terminal.Terminal) -> RunSummary:
    """Runs the job with a progress bar, then prints its summary, one line per error row and
    failed chain, and where the logs are."""
    with progress_bar(term.console(), starting="starting Ray and the engine") as show_progress:
        summary = run_job(spec, on_progress=show_progress, progress_interval_s=2.0)
    term.result_console().print(summary_table(summary))
    for line in problem_lines(summary):
        print(line, file=term.err)
    term.print_log_path()
    return summary


def problem_lines(summary: RunSummary, limit: int = 20) -> list[str]:
    """Each input that went to errors and each failed chain, one line each."""
    import pyarrow.parquet as pq

    lines = []
    if summary.errors and "errors" in summary.outputs:
        for row in pq.read_table(summary.outputs["errors"]).to_pylist():
            lines.append(f"not answered: {row['name']}: {row['message']} ({row['stage']})")
    if summary.chains_failed and "answers" in summary.outputs:
        answers = pq.read_table(
            summary.outputs["answers"], columns=["name", "question", "status", "error"]
        ).to_pylist()
        for row in answers:
            if row["status"] == ChainStatus.FAILED:
                lines.append(f"failed: {row['name']}: {row['question']!r}: {row['error']}")
    if len(lines) > limit:
        lines = [*lines[:limit], f"... and {len(lines) - limit} more (see the tables)"]
    return lines


def spec_from_arguments(args: argparse.Namespace) -> JobSpec:
    overrides = setting_overrides(args, FLAGS)
    job = getattr(args, "job", None)
    if job is not None:
        return load_job_spec(job, overrides)
    if "sources" not in overrides or "output" not in overrides:
        raise JobError("give a job file, or --input URI and --output URI (see memstream run -h)")
    return JobSpec.from_dict(overrides, "command line")


def summary_table(summary: RunSummary) -> Table:
    table = Table(
        title=f"memstream run {summary.run_id} (attempt {summary.attempt})", show_header=False
    )
    table.add_column("what", style="bold")
    table.add_column("value", justify="right", overflow="fold")
    rows = [
        ("documents", f"{summary.documents:,}"),
        ("  answered", f"{summary.documents_answered:,}"),
        ("  failed (see errors)", f"{summary.documents_failed:,}"),
        ("  new, changed, unchanged, removed", changes_line(summary)),
        ("  compared with", summary.changes.previous_run_id or "no earlier run over these inputs"),
        ("chains (document x question)", f"{summary.chains:,}"),
        ("  done", f"{summary.chains_done:,}"),
        ("  failed", f"{summary.chains_failed:,}"),
        ("  resumed from a checkpoint", f"{summary.chains_resumed:,}"),
        ("  answered before (carried forward)", f"{summary.chains_skipped:,}"),
        (
            "tokens (prompt + completion)",
            f"{summary.prompt_tokens:,} + {summary.completion_tokens:,}",
        ),
        (
            "throughput while answering",
            f"{summary.busy_tokens_per_s:,.0f} tokens/s, {summary.busy_chains_per_s:.3f} chains/s",
        ),
        (
            "throughput end to end",
            f"{summary.tokens_per_s:,.0f} tokens/s, {summary.chains_per_s:.3f} chains/s",
        ),
        ("elapsed", f"{summary.elapsed_s:,.1f} s ({summary.busy_s:,.1f} s answering)"),
        ("engine", summary.engine),
        *((name, uri) for name, uri in summary.outputs.items()),
        ("state store", summary.state_store),
    ]
    for label, value in rows:
        table.add_row(label, value)
    return table


def changes_line(summary: RunSummary) -> str:
    changes = summary.changes
    return f"{changes.new:,}, {changes.changed:,}, {changes.unchanged:,}, {changes.removed:,}"
