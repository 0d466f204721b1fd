"""The corpus job: sources in, answers out, as one Ray Data stream, resumable after any crash.

    read (tasks) -> parse (tasks) -> segment + plan (tasks) -> memory (actor pool)

The driver checks every source, the output and the state store first, so a job that cannot work
fails at once with one message. The sources are one Ray Data read (connectors.reading): the
driver plans their shards, and read tasks list the items and fetch their content, so neither a
list of the corpus nor a document's text passes through the driver. The items stream through
the stages; the memory stage checkpoints every step in the state store. At the end the driver
exports the run from the state store to Parquet.

A job is a `JobSpec`, from YAML (`load_job_spec`) or built in Python; `run_job` runs it and
returns a `RunSummary`. Runs are incremental: every run gets its own run id, `<job key>-<n>`, the
job key derived from the spec; a run after a crash or a failure resumes that unfinished run (its
next attempt), any other begins a new one. Chains are keyed by content, question, model and
method, so in either case answered chains are not run again (their answers are carried forward
into the run's tables) and unfinished ones resume from their last checkpoint; only new and
changed documents reach the engine. One run at a time holds the archive (its sources and
output): a second one waits for it.
"""

from pipeline.job.run import run_job
from pipeline.job.spec import ConcurrencySpec, JobError, JobSpec, OutputSpec, load_job_spec
from pipeline.job.summary import ProgressCallback, RunSummary

__all__ = [
    "ConcurrencySpec",
    "JobError",
    "JobSpec",
    "OutputSpec",
    "ProgressCallback",
    "RunSummary",
    "load_job_spec",
    "run_job",
]
