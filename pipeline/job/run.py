"""Running a job: `run_job` holds the archive, streams the graph, then exports the run's tables
and manifest from the state store; what stops a run becomes one `JobError` line."""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Mapping
from dataclasses import asdict, replace
from typing import Any

from connectors import SourceError
from connectors.results import ResultWriter, RunIdentity
from connectors.state import locks
from connectors.state.database import StateStoreError
from connectors.state.schema import DONE, DONE_WITH_ERRORS, FAILED
from operators.core.document import Document
from pipeline.job.graph import ensure_ray, stream
from pipeline.job.plan import JobPlan, check_not_empty, estimated_tokens, plan_job
from pipeline.job.spec import JobError, JobSpec
from pipeline.job.summary import ProgressCallback, RunSummary, Tally, log_progress, watching
from pipeline.stages.run import RunContext

logger = logging.getLogger(__name__)


class ExportError(RuntimeError):
    """The run's tables could not be written to the output."""


def run_job(
    spec: JobSpec,
    on_progress: ProgressCallback = log_progress,
    progress_interval_s: float = 10.0,
) -> RunSummary:
    """Runs the job to the end and exports its tables; see `pipeline.job`'s docstring. While it
    runs, `on_progress` gets the model calls and chains done so far (by default, a log line).
    While another run holds the archive, it waits, and says so in a log line."""
    started = time.perf_counter()
    plan = plan_job(spec)
    check_not_empty(plan.sources)
    plan.spec = replace(
        plan.spec, engine=plan.spec.engine.resolved(planned_tokens=estimated_tokens(plan))
    )
    waiting = time.perf_counter()
    with locks.holding(plan.store, plan.archive_key):
        started += time.perf_counter() - waiting  # waiting is not the run's time
        return _run(plan, on_progress, progress_interval_s, started)


def _run(
    plan: JobPlan, on_progress: ProgressCallback, progress_interval_s: float, started: float
) -> RunSummary:
    started_at = time.time()
    begun = plan.store.begin_run(
        plan.run_id, _run_description(plan), job_key=plan.job_key, archive_key=plan.archive_key
    )
    plan.run_id = run_id = begun.run_id
    attempt = begun.attempt
    if begun.attempt > 1:
        logger.info("resuming run %s (attempt %d)", run_id, attempt)
    run = RunContext(
        run_id=run_id,
        attempt=attempt,
        store_url=plan.store.url,
        engine=plan.spec.engine,
        method=plan.spec.method,
        questions=plan.questions,
        limits=plan.spec.limits,
        collections=plan.collections,
    )
    started_ray = ensure_ray(plan.spec.ray_address)
    tally = Tally()
    try:
        with watching(plan.store, run_id, attempt, on_progress, progress_interval_s):
            stream(plan, run, tally)
            _record_empty_collections(plan, run)
        elapsed_s = time.perf_counter() - started
        return _finish(plan, run, tally, elapsed_s, started_at)
    except BaseException as error:
        with contextlib.suppress(Exception):  # keep the error that stopped the run
            plan.store.finish_run(run_id, FAILED)
        cause = _stopping_cause(error)
        if cause is None:
            raise
        stopped = _first_line(cause)
    finally:
        if started_ray:
            import ray

            ray.shutdown()
    # Raised here, not in the except block: the JobError keeps no reference to the Ray error,
    # whose traceback holds the stream's executor and its actors alive.
    raise JobError(stopped)


def _record_empty_collections(plan: JobPlan, run: RunContext) -> None:
    """An errors row for each collection no document reached: none matched its globs."""
    uris = [collection.uri for collection in plan.collections]
    listed = plan.store.listed_of(run.run_id, run.attempt, uris)
    for collection in plan.collections:
        if collection.uri not in listed:
            run.record_error(
                Document(uri=collection.uri, name=collection.name),
                "collection",
                "NoMember",
                f"no document matches {', '.join(collection.documents)}",
            )


# What stops a run with one line rather than a traceback: a shard that failed as a whole in its
# read task (a bucket or database gone mid-listing, S3 unreachable past its retries), the state
# store unusable (file removed, locked past its busy timeout, server gone), the results that
# could not be written.
StoppingError = SourceError | StateStoreError | ExportError


def _stopping_cause(error: BaseException) -> BaseException | None:
    """The innermost StoppingError behind `error`, else None. Ray wraps a task's error in a
    RayTaskError that keeps it as `cause` (and is an instance of its class, with the remote
    traceback as its text)."""
    found, seen = None, set()
    current: BaseException | None = error
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        if isinstance(current, StoppingError):
            found = current
        cause = getattr(current, "cause", None)
        current = cause if isinstance(cause, BaseException) else current.__cause__
    return found


def _first_line(error: BaseException) -> str:
    lines = [line for line in str(error).splitlines() if line.strip()]
    return lines[0] if lines else type(error).__name__


def _finish(
    plan: JobPlan,
    run: RunContext,
    tally: Tally,
    elapsed_s: float,
    started_at: float,
) -> RunSummary:
    spec = plan.spec
    writer = ResultWriter(plan.filesystem, plan.output_base, run.run_id)
    changes = plan.store.supersede_previous(run.run_id, run.attempt)
    identity = RunIdentity(
        run.run_id,
        run.attempt,
        spec.engine.model,
        spec.engine.kind,
        spec.engine.dtype,
        spec.method,
    )
    try:
        tables = writer.export_tables(plan.store, identity)
    except OSError as error:
        raise ExportError(
            f"cannot write the results to {writer.uri('')}: {_first_line(error)}; the answers are "
            "kept in the state store: run the job again to export them"
        ) from None
    statuses = plan.store.chain_status_counts(run.run_id, run.attempt)
    answered, failed_documents = plan.store.document_counts(run.run_id, run.attempt)
    summary = RunSummary(
        run_id=run.run_id,
        attempt=run.attempt,
        # every input read ends planned (answers rows) or in errors, never both
        documents=answered + failed_documents,
        documents_answered=answered,
        documents_failed=failed_documents,
        chains=sum(statuses.values()),
        chains_done=statuses.get("done", 0),
        chains_failed=statuses.get("failed", 0),
        chains_resumed=tally.resumed,
        # answered before: carried forward, or by an earlier attempt, or shared with a copy
        chains_skipped=statuses.get(DONE, 0) - tally.answered,
        errors=tables["errors"].rows,
        prompt_tokens=tally.prompt_tokens,
        completion_tokens=tally.completion_tokens,
        elapsed_s=elapsed_s,
        busy_s=plan.store.busy_window(run.run_id, run.attempt, started_at),
        outputs={name: table.uri for name, table in tables.items()},
        state_store=plan.store.safe_url,
        engine=spec.engine.describe(),
        changes=changes,
    )
    try:
        manifest_uri = writer.write_manifest(_manifest(plan, summary, tables))
    except OSError as error:
        raise ExportError(
            f"cannot write the manifest to {writer.uri('manifest.json')}: {_first_line(error)}; "
            "run the job again to export the results"
        ) from None
    summary = replace(summary, outputs={**summary.outputs, "manifest": manifest_uri})
    plan.store.finish_run(run.run_id, DONE if summary.ok else DONE_WITH_ERRORS)
    return summary


def _run_description(plan: JobPlan) -> dict[str, Any]:
    """What the run reads and how, without secrets (source reprs hide passwords)."""
    spec = plan.spec
    return {
        "sources": [repr(source) for source in plan.sources],
        "questions": [asdict(question) for question in plan.questions],
        **(
            {"collections": [asdict(collection) for collection in plan.collections]}
            if plan.collections
            else {}
        ),
        "engine": {
            "kind": spec.engine.kind,
            "model": spec.engine.model,
            "dtype": spec.engine.dtype,
            "prompt_lookup_tokens": spec.engine.prompt_lookup_tokens,
        },
        "method": spec.method.identity(),
        "output": spec.output.uri,
    }


def _manifest(plan: JobPlan, summary: RunSummary, tables: Mapping[str, Any]) -> dict[str, Any]:
    return {
        **_run_description(plan),
        "run_id": summary.run_id,
        "attempt": summary.attempt,
        "previous_run_id": summary.changes.previous_run_id,
        "finished_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "state_store": summary.state_store,
        "counts": {
            "documents": summary.documents,
            "documents_answered": summary.documents_answered,
            "documents_failed": summary.documents_failed,
            "documents_new": summary.changes.new,
            "documents_changed": summary.changes.changed,
            "documents_unchanged": summary.changes.unchanged,
            "documents_removed": summary.changes.removed,
            "chains": summary.chains,
            "chains_done": summary.chains_done,
            "chains_failed": summary.chains_failed,
            "chains_resumed": summary.chains_resumed,
            "chains_skipped": summary.chains_skipped,
            "errors": summary.errors,
            **{f"{name}_rows": table.rows for name, table in tables.items()},
        },
        "tokens": {"prompt": summary.prompt_tokens, "completion": summary.completion_tokens},
        "elapsed_s": round(summary.elapsed_s, 3),
        "busy_s": round(summary.busy_s, 3),
        "throughput": {
            "tokens_per_s": round(summary.tokens_per_s, 2),
            "chains_per_s": round(summary.chains_per_s, 4),
            "busy_tokens_per_s": round(summary.busy_tokens_per_s, 2),
            "busy_chains_per_s": round(summary.busy_chains_per_s, 4),
        },
        "tables": {name: table.uri for name, table in tables.items()},
    }
