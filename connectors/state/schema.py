"""The state store's tables, one schema for the corpus job and the Serve job queue.

- A corpus run: `runs` (one row per run, its attempt number, the job it runs and the archive it
  reads, and the previous finished run over that archive), and its membership tables
  `documents`, `run_chains` and `errors`, each row stamped with the attempt that saw it. A
  `run_chains` row of an earlier run names the run that replaced its answer (`superseded_by`).
- `run_locks`: one row per archive being run over, held by one process on a lease, so two runs
  over the same archive never overlap.
- A chain, wherever it runs: `chains` (its checkpoint: the next step and the memory after the
  last one), `steps` (one row per model call: the trajectory), `rejected_quotes` (the reply lines
  a verifying memory policy dropped) and `groundings` (where its answer is found in the source).
  A corpus chain's key hashes its content, question, model and method; a Serve job's chain `i`
  is keyed `<job_id>#q<i>`.
- The Serve job queue: `serving_jobs` (inputs, status, lease, outcome) and `serving_events`
  (what a job's event stream replays).

Changes to these tables come with an Alembic revision in `migrations/versions/`.
"""

from __future__ import annotations

from sqlalchemy import (
    Boolean,
    Column,
    Float,
    Integer,
    LargeBinary,
    MetaData,
    String,
    Table,
    Text,
)

from operators.core.chain import ChainStatus

# A chain: pending -> running -> done | failed, stored as its `ChainStatus` value. Runs and
# Serve jobs say running, done and failed in the same words.
RUNNING, DONE, FAILED = ChainStatus.RUNNING.value, ChainStatus.DONE.value, ChainStatus.FAILED.value
# A run: running -> done | done_with_errors | failed; a failed or killed (still "running") run
# is resumed by the next run of the same job, or abandoned when the next run is another job's.
DONE_WITH_ERRORS, ABANDONED = "done_with_errors", "abandoned"
FINISHED_RUN = (DONE, DONE_WITH_ERRORS)
UNFINISHED_RUN = (RUNNING, FAILED)
# A Serve job: queued -> running -> succeeded | failed | cancelled.
QUEUED, SUCCEEDED, CANCELLED = "queued", "succeeded", "cancelled"
UNFINISHED_JOB = (QUEUED, RUNNING)
FINISHED_JOB = (SUCCEEDED, FAILED, CANCELLED)

metadata = MetaData()

runs = Table(
    "runs",
    metadata,
    Column("run_id", String(64), primary_key=True),
    Column("attempt", Integer, nullable=False),
    Column("status", String(16), nullable=False),
    Column("summary", Text),  # JSON: what the run reads and how (no secrets)
    Column("created_at", Float, nullable=False),
    Column("started_at", Float, nullable=False),
    Column("finished_at", Float),
    # What the run computes (sources, questions, model, method, output): the run id's prefix.
    Column("job_key", String(64)),
    Column("archive_key", String(64), index=True),  # what it reads and where it writes
    Column("previous_run_id", String(64)),  # the last finished run over the archive before it
)

chains = Table(
    "chains",
    metadata,
    Column("chain_key", String(64), primary_key=True),
    Column("run_id", String(64), nullable=False),  # the run that last planned it
    Column("answered_in_run", String(64)),  # the run that was planning it when it was answered
    Column("doc_id", String(64), nullable=False),
    Column("source_uri", Text, nullable=False),
    Column("question_id", String(128), nullable=False),
    Column("question", Text, nullable=False),
    Column("status", String(16), nullable=False),
    Column("step", Integer, nullable=False),  # the next step to run = steps done
    Column("memory", Text),  # the memory after the last update step; NULL before the first
    Column("answer", Text),
    Column("raw_response", Text),
    Column("n_segments", Integer, nullable=False),
    Column("n_tokens", Integer, nullable=False),
    Column("prompt_tokens", Integer, nullable=False, default=0),
    Column("completion_tokens", Integer, nullable=False, default=0),
    Column("compute_s", Float, nullable=False, default=0.0),  # sum of step latencies
    Column("error", Text),
    Column("created_at", Float, nullable=False),
    Column("started_at", Float),
    Column("updated_at", Float, nullable=False),
    Column("finished_at", Float),
)

steps = Table(
    "steps",
    metadata,
    Column("chain_key", String(64), primary_key=True),
    Column("step", Integer, primary_key=True),
    Column("kind", String(16), nullable=False),
    Column("segment_index", Integer),
    Column("token_start", Integer),
    Column("token_end", Integer),
    Column("char_start", Integer),
    Column("char_end", Integer),
    Column("memory_after", Text, nullable=False),  # the raw response on the final step
    Column("prompt_tokens", Integer, nullable=False),
    Column("completion_tokens", Integer, nullable=False),
    Column("finish_reason", String(32)),
    Column("latency_s", Float, nullable=False),
    Column("created_at", Float, nullable=False),
    # The final step's re-read passages: JSON list of [char_start, char_end]; NULL when none.
    Column("reread_spans", Text),
)

documents = Table(
    "documents",
    metadata,
    Column("run_id", String(64), primary_key=True),
    Column("source_uri", String(2048), primary_key=True),
    Column("attempt", Integer, nullable=False),
    Column("doc_id", String(64), nullable=False),
    Column("name", Text, nullable=False),
    Column("content_sha256", String(64), nullable=False),
    Column("parser", String(64)),
    Column("pages", Integer),
    Column("warnings", Text),  # JSON list
    Column("metadata", Text),  # JSON object from the source
    Column("n_tokens", Integer),
    Column("n_segments", Integer),
    Column("updated_at", Float, nullable=False),
)

run_chains = Table(
    "run_chains",
    metadata,
    Column("run_id", String(64), primary_key=True),
    Column("source_uri", String(2048), primary_key=True),
    Column("question_id", String(128), primary_key=True),
    Column("attempt", Integer, nullable=False),
    Column("chain_key", String(64), nullable=False, index=True),
    Column("question", Text, nullable=False),
    Column("updated_at", Float, nullable=False),
    # The later run over the archive whose answer replaced this one: the document changed or
    # was removed, or it was answered anew (another model, method or wording of the question).
    Column("superseded_by", String(64)),
)

run_locks = Table(
    "run_locks",
    metadata,
    Column("lock_key", String(64), primary_key=True),  # the archive key
    Column("owner", String(64), nullable=False),  # a token of the holding process
    Column("host", String(255), nullable=False),
    Column("pid", Integer, nullable=False),
    Column("acquired_at", Float, nullable=False),
    Column("expires_at", Float, nullable=False),  # renewed while the holder lives
)

# Where each answered chain's answer and memory are found in the source (operators.core.evidence).
groundings = Table(
    "groundings",
    metadata,
    Column("chain_key", String(64), primary_key=True),
    Column("grounded", Boolean, nullable=False),
    Column("reason", Text, nullable=False),
    Column("evidence", Text, nullable=False),  # JSON list of evidence items
    Column("created_at", Float, nullable=False),
)

# The reply lines of an update step that its memory policy did not find in the section
# ("verified-quotes"); a row only for steps that dropped something.
rejected_quotes = Table(
    "rejected_quotes",
    metadata,
    Column("chain_key", String(64), primary_key=True),
    Column("step", Integer, primary_key=True),
    Column("quotes", Text, nullable=False),  # JSON list of the dropped lines
)

errors = Table(
    "errors",
    metadata,
    Column("run_id", String(64), primary_key=True),
    Column("source_uri", String(2048), primary_key=True),
    Column("stage", String(32), primary_key=True),
    Column("attempt", Integer, nullable=False),
    Column("doc_id", String(64)),
    Column("name", Text),
    Column("error_type", String(128), nullable=False),
    Column("message", Text, nullable=False),
    Column("created_at", Float, nullable=False),
)

jobs = Table(
    "serving_jobs",
    metadata,
    Column("job_id", String(32), primary_key=True),
    Column("status", String(16), nullable=False, index=True),
    Column("name", Text, nullable=False),  # the document's file name, which tells its format
    Column("source", Text, nullable=False),  # what the client gave, safe to show
    Column("uri", Text),  # the URI to fetch, as given; never shown
    Column("input_data", LargeBinary),  # uploaded or inline bytes, until parsed
    Column("mime_type", String(255)),
    Column("questions", Text, nullable=False),  # JSON list
    Column("method", Text, nullable=False),  # JSON: the MethodConfig the job runs with
    Column("text", Text),  # the parsed document
    Column("document", Text),  # JSON: parser, pages, warnings, n_tokens, n_segments
    Column("error", Text),
    Column("owner", String(64)),
    Column("lease_expires_at", Float),
    Column("created_at", Float, nullable=False),
    Column("started_at", Float),
    Column("updated_at", Float, nullable=False),
    Column("finished_at", Float),
)

events = Table(
    "serving_events",
    metadata,
    Column("event_id", Integer, primary_key=True, autoincrement=True),
    Column("job_id", String(32), nullable=False, index=True),
    Column("kind", String(16), nullable=False),  # "memory" or "end"
    Column("data", Text, nullable=False),  # JSON
    Column("created_at", Float, nullable=False),
)
