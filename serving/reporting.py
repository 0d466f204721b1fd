"""A serving job as the audit report of `memstream report` shows a run (`pipeline.report`)."""

from __future__ import annotations

from typing import Any

from connectors.results import utc_timestamp
from connectors.state.records import JobState
from operators.core.chain import ChainStatus
from pipeline.report import RunData, render_report


def job_report(job: JobState, trajectory: list[dict[str, Any]], model: str) -> str:
    document = job.document or {}
    answers = [
        {
            **state.answer_record(),
            "run_id": job.job_id,
            "name": job.name,
            "source_uri": job.source,
            "question_id": f"q{state.chain_index}",
            # as the run tables say it: an unfinished chain is running
            "status": (state.status if state.done else ChainStatus.RUNNING).value,
            "n_tokens": document.get("n_tokens"),
            "model": model,
            "template": job.method.get("template"),
            "chunk_size": job.method.get("chunk_size"),
            "parser": document.get("parser"),
            "parse_warnings": document.get("warnings") or [],
            "timings": {
                "started_at": utc_timestamp(job.started_at),
                "finished_at": utc_timestamp(job.finished_at),
                "compute_s": state.compute_s,
            },
        }
        for state in job.chains
    ]
    errors = []
    if job.error:
        errors.append({"name": job.name, "source_uri": job.source, "stage": "job",
                       "error_type": job.status, "message": job.error})  # fmt: skip
    manifest = {"run_id": job.job_id, "finished_at": utc_timestamp(job.finished_at)}
    return render_report(RunData(f"job {job.job_id}", answers, trajectory, errors, manifest))
