"""Airflow DAG: a memstream corpus job every night over an S3 prefix.

One task per run: it builds the job spec from the job file named by the Airflow Variable
`memstream_job` (default: the file beside this DAG, `job.yaml`), sets its sources to the
prefix given in the DAG's params, calls the documented entry point `pipeline.job.run_job`, and
returns the run summary, which Airflow pushes to XCom. Each night is a run of its own that
computes only the prefix's new and changed documents (its summary counts new, changed,
unchanged and removed ones). Retries are safe: a retry resumes the failed run (answered chains
are skipped, the others resume from their checkpoints). A job file that is not a valid job
fails the task at once, without retries: a retry would read the same file.
`max_active_runs=1`: two nightly runs never overlap, the second waits; a run over the same
prefix and output started elsewhere waits on the state store's lock too.
"""

from __future__ import annotations

import dataclasses
import os
from datetime import datetime, timedelta
from pathlib import Path

from airflow.sdk import Param, Variable, dag, task
from airflow.sdk.exceptions import AirflowFailException

DEFAULT_JOB = str(Path(__file__).with_name("job.yaml"))


@dag(
    dag_id="memstream_nightly",
    schedule="0 2 * * *",
    start_date=datetime(2026, 1, 1),
    catchup=False,
    max_active_runs=1,
    default_args={"retries": 2, "retry_delay": timedelta(minutes=10)},
    params={
        "prefix": Param("s3://corpus-bucket/contracts/", type="string"),
        "output": Param("s3://results-bucket/memstream/contracts/", type="string"),
    },
    tags=["memstream"],
)
def memstream_nightly():
    @task(execution_timeout=timedelta(hours=12))
    def run(params: dict | None = None) -> dict:
        from pipeline.job import JobError, load_job_spec, run_job

        params = params or {}
        job_file = Variable.get(
            "memstream_job", default=os.environ.get("MEMSTREAM_JOB", DEFAULT_JOB)
        )
        overrides = {"sources": [params["prefix"]], "output": {"uri": params["output"]}}
        try:
            spec = load_job_spec(job_file, overrides)
        except JobError as error:
            raise AirflowFailException(str(error)) from None
        summary = run_job(spec)
        result = dataclasses.asdict(summary)
        result["ok"] = summary.ok
        if not summary.ok:
            # The tables are written; the failed chains and error rows are in them.
            print(f"memstream: run {summary.run_id} finished with failures: {result}")
        return result

    run()


memstream_nightly()
