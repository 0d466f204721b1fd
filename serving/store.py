"""Serving jobs in an SQL database (SQLite by default, PostgreSQL by URL), through SQLAlchemy Core.

The database is a state store of the corpus job's kind (`connectors.state.store`): the same URLs,
the same SQLite set-up, and the chains checkpointed in the same `chains` and `steps` tables by
the same code. A job's chain `i` is the `chains` row keyed `<job_id>#q<i>` (its run_id and
doc_id are the job id), with a `steps` row per model call. What only the server has lives in two
tables, prefixed `serving_` so they can share a database with other memstream state:
- `serving_jobs`: a job's inputs, status, lease and outcome. The input bytes and URI (which may
  carry a presigned token) are kept only until the document is read; from then on its text is,
  so a resumed job reads the same text.
- `serving_events`: what the event stream replays: a `memory` event per memory update and one
  `end` event when the job finishes, fails or is cancelled.

A replica runs a job only while it holds the job's lease (`owner`, `lease_expires_at`). Every
write of a running job is conditional on that lease, and a checkpoint and its event are one
transaction, so a replica that lost its lease (it was cancelled, or presumed dead and replaced)
can no longer write, and a resumed job has exactly one event per step.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

from sqlalchemy import (
    Column,
    ColumnElement,
    Float,
    Integer,
    LargeBinary,
    MetaData,
    String,
    Table,
    Text,
    and_,
    func,
    insert,
    or_,
    select,
    update,
)
from sqlalchemy.engine import URL, Connection, Engine, RowMapping
from sqlalchemy.exc import SQLAlchemyError

from connectors.results import trajectory_row
from connectors.sql import redacted
from connectors.state import store as state_store
from connectors.state.store import (
    CHECKPOINT_TABLES,
    PlannedChain,
    StateStoreError,
    StepCheckpoint,
    chains,
    first_line,
    groundings,
    open_store_engine,
    parse_store_url,
    pending_chain_row,
    rejected_quotes,
    steps,
    with_rejected_quotes,
    write_failure,
    write_grounding,
    write_step,
)
from pipeline.core.evidence import Grounding

QUEUED, RUNNING, SUCCEEDED, FAILED, CANCELLED = (
    "queued",
    "running",
    "succeeded",
    "failed",
    "cancelled",
)
T = TypeVar("T")
UNFINISHED = (QUEUED, RUNNING)
FINISHED = (SUCCEEDED, FAILED, CANCELLED)
SQLITE_BUSY_TIMEOUT_MS = 30_000
# A chain's status as the API shows it: "ok" once answered, "error" once failed, else "pending".
ANSWER_STATUS = {state_store.DONE: "ok", state_store.FAILED: "error"}
CHAIN_COLUMNS = (
    "chain_key",
    "question",
    "n_segments",
    "step",
    "memory",
    "answer",
    "raw_response",
    "error",
    "prompt_tokens",
    "completion_tokens",
    "compute_s",
)

metadata = MetaData()

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


class StoreError(RuntimeError):
    """The store cannot be opened or used; the message says which database and why."""


class JobConflict(Exception):
    """The job is not in a state that allows the operation."""

    def __init__(self, status: str) -> None:
        super().__init__(f"the job is already {status}")
        self.status = status


@dataclass(frozen=True)
class NewJob:
    name: str
    source: str
    questions: tuple[str, ...]
    method: dict[str, Any]
    uri: str | None = None
    data: bytes | None = None
    mime_type: str | None = None


@dataclass(frozen=True)
class ChainState:
    chain_index: int
    chain_key: str
    question: str
    n_segments: int
    step: int
    memory: str | None
    status: str  # "pending", "ok" or "error"
    answer: str | None
    raw_response: str | None
    error: str | None
    prompt_tokens: int
    completion_tokens: int
    compute_s: float
    grounded: bool | None = None  # None until the answer's evidence is looked up
    grounding_reason: str | None = None
    evidence: tuple[dict[str, Any], ...] = ()

    @property
    def segments_done(self) -> int:
        return min(self.step, self.n_segments)

    @property
    def done(self) -> bool:
        return self.status != "pending"

    def answer_record(self) -> dict[str, Any]:
        return {
            "question": self.question,
            "status": self.status,
            "answer": self.answer,
            "raw_response": self.raw_response,
            "final_memory": self.memory or "",
            "n_segments": self.n_segments,
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": self.completion_tokens,
            "compute_s": round(self.compute_s, 3),
            "error": self.error,
            "grounded": self.grounded,
            "grounding_reason": self.grounding_reason,
            "evidence": list(self.evidence),
        }


@dataclass(frozen=True)
class JobState:
    job_id: str
    status: str
    name: str
    source: str
    questions: tuple[str, ...]
    method: dict[str, Any]
    document: dict[str, Any] | None
    error: str | None
    created_at: float
    started_at: float | None
    updated_at: float
    finished_at: float | None
    chains: tuple[ChainState, ...] = ()

    @property
    def finished(self) -> bool:
        return self.status in FINISHED


@dataclass(frozen=True)
class JobInput:
    """What a replica needs to run a claimed job."""

    job_id: str
    name: str
    uri: str | None
    data: bytes | None
    mime_type: str | None
    questions: tuple[str, ...]
    method: dict[str, Any]
    text: str | None
    chains: tuple[ChainState, ...]


@dataclass(frozen=True)
class Event:
    event_id: int
    kind: str
    data: dict[str, Any] = field(default_factory=dict)


class JobStore:
    def __init__(self, url: str) -> None:
        try:
            parsed = parse_store_url(url, "job store")
        except StateStoreError as error:
            raise StoreError(str(error)) from None
        self.safe_url = redacted(parsed)
        try:
            self._writer, self._reader = _open_engines(parsed)
            metadata.create_all(self._writer)
            state_store.metadata.create_all(self._writer, tables=list(CHECKPOINT_TABLES))
        except (SQLAlchemyError, OSError) as error:
            raise StoreError(
                f"cannot open the job store {self.safe_url}: {first_line(error)}"
            ) from None

    def close(self) -> None:
        self._writer.dispose()
        if self._reader is not self._writer:
            self._reader.dispose()

    # --- clients ---------------------------------------------------------------------------

    def create_job(self, job: NewJob) -> str:
        job_id = uuid.uuid4().hex
        now = time.time()
        with self._write() as connection:
            connection.execute(
                insert(jobs).values(
                    job_id=job_id,
                    status=QUEUED,
                    name=job.name,
                    source=job.source,
                    uri=job.uri,
                    input_data=job.data,
                    mime_type=job.mime_type,
                    questions=json.dumps(list(job.questions)),
                    method=json.dumps(job.method, sort_keys=True),
                    created_at=now,
                    updated_at=now,
                )
            )
        return job_id

    def get_job(self, job_id: str) -> JobState | None:
        return self._load(job_id, _job_state)

    def cancel(self, job_id: str) -> bool:
        """Cancels an unfinished job: False when there is no such job, JobConflict when it has
        already finished."""
        with self._write() as connection:
            status = connection.execute(
                select(jobs.c.status).where(jobs.c.job_id == job_id)
            ).scalar()
            if status is None:
                return False
            if status in FINISHED:
                raise JobConflict(status)
            _end_job(connection, jobs.c.job_id == job_id, CANCELLED, "cancelled by the client")
            _add_end_event(connection, job_id, CANCELLED, None)
        return True

    def events_after(self, job_id: str, after: int, limit: int = 500) -> list[Event]:
        with self._read() as connection:
            rows = connection.execute(
                select(events.c.event_id, events.c.kind, events.c.data)
                .where(and_(events.c.job_id == job_id, events.c.event_id > after))
                .order_by(events.c.event_id)
                .limit(limit)
            ).all()
        return [Event(event_id, kind, json.loads(data)) for event_id, kind, data in rows]

    def count_by_status(self) -> dict[str, int]:
        with self._read() as connection:
            rows = connection.execute(
                select(jobs.c.status, func.count()).group_by(jobs.c.status)
            ).all()
        return {status: count for status, count in rows}

    # --- replicas running jobs --------------------------------------------------------------

    def claim(self, owner: str, lease_s: float, limit: int) -> list[str]:
        """Takes up to `limit` jobs that are queued or whose runner's lease ran out, oldest
        first, and leases them to `owner`."""
        if limit < 1:
            return []
        now = time.time()
        claimable = and_(
            jobs.c.status.in_(UNFINISHED),
            or_(jobs.c.owner.is_(None), jobs.c.lease_expires_at < now),
        )
        with self._read() as connection:
            candidates = (
                connection.execute(
                    select(jobs.c.job_id).where(claimable).order_by(jobs.c.created_at).limit(limit)
                )
                .scalars()
                .all()
            )
        claimed = []
        for job_id in candidates:
            with self._write() as connection:
                taken = connection.execute(
                    update(jobs)
                    .where(and_(jobs.c.job_id == job_id, claimable))
                    .values(
                        status=RUNNING,
                        owner=owner,
                        lease_expires_at=now + lease_s,
                        started_at=func.coalesce(jobs.c.started_at, now),
                        updated_at=now,
                    )
                ).rowcount
            if taken == 1:
                claimed.append(job_id)
        return claimed

    def renew(self, owner: str, job_ids: Sequence[str], lease_s: float) -> set[str]:
        """Extends the leases `owner` still holds; returns the jobs it still holds."""
        if not job_ids:
            return set()
        now = time.time()
        held = self._held_by(owner, job_ids)
        with self._write() as connection:
            connection.execute(update(jobs).where(held).values(lease_expires_at=now + lease_s))
            return set(connection.execute(select(jobs.c.job_id).where(held)).scalars())

    def release(self, owner: str, job_ids: Sequence[str]) -> None:
        """Gives jobs back unfinished (the replica is shutting down) for any replica to resume."""
        if not job_ids:
            return
        with self._write() as connection:
            connection.execute(
                update(jobs)
                .where(self._held_by(owner, job_ids))
                .values(owner=None, lease_expires_at=None, updated_at=time.time())
            )

    def load_input(self, job_id: str) -> JobInput | None:
        return self._load(job_id, _job_input)

    def save_document(
        self, job_id: str, owner: str, text: str, document: dict[str, Any], questions: Sequence[str]
    ) -> bool:
        """Keeps the parsed text (dropping the input bytes) and plans one chain per question."""
        now = time.time()
        with self._write() as connection:
            saved = connection.execute(
                update(jobs)
                .where(self._held_by(owner, [job_id]))
                .values(
                    text=text,
                    document=json.dumps(document),
                    input_data=None,
                    uri=None,
                    updated_at=now,
                )
            ).rowcount
            if saved != 1:
                return False
            source = connection.execute(
                select(jobs.c.source).where(jobs.c.job_id == job_id)
            ).scalar_one()
            connection.execute(
                insert(chains),
                [
                    pending_chain_row(
                        PlannedChain(chain_key(job_id, index), f"q{index}", question),
                        run_id=job_id,
                        doc_id=job_id,
                        source_uri=source,
                        n_segments=document["n_segments"],
                        n_tokens=document["n_tokens"],
                        now=now,
                    )
                    for index, question in enumerate(questions)
                ],
            )
        return True

    def checkpoint(self, job_id: str, owner: str, chain_index: int, step: StepCheckpoint) -> bool:
        """Advances chain `chain_index` past `step` (the project's checkpoint: a `steps` row
        and the chain's `(step, memory)`) and records its event; False when the lease is gone."""
        with self._write() as connection:
            if not self._still_held(connection, owner, job_id):
                return False
            write_step(connection, step)
            if not step.done:
                n_segments = connection.execute(
                    select(chains.c.n_segments).where(chains.c.chain_key == step.chain_key)
                ).scalar()
                _add_event(
                    connection,
                    job_id,
                    "memory",
                    {
                        "question_index": chain_index,
                        "step": step.record.step,
                        "segments_done": step.record.step + 1,
                        "segments_total": n_segments,
                        "memory": step.memory,
                    },
                )
            connection.execute(
                update(jobs).where(jobs.c.job_id == job_id).values(updated_at=time.time())
            )
        return True

    def fail_chain(self, job_id: str, owner: str, chain_index: int, error: str) -> bool:
        with self._write() as connection:
            if not self._still_held(connection, owner, job_id):
                return False
            write_failure(connection, chain_key(job_id, chain_index), error)
        return True

    def trajectory(self, job: JobState) -> list[dict[str, Any]]:
        """Every model call of the job's chains, in order, as rows of a run's trajectory table."""
        keys = {state.chain_key: state.chain_index for state in job.chains}
        query = (
            select(steps, rejected_quotes.c.quotes.label("rejected_quotes"))
            .select_from(with_rejected_quotes(steps))
            .where(steps.c.chain_key.in_(list(keys)))
            .order_by(steps.c.chain_key, steps.c.step)
        )
        with self._read() as connection:
            rows = connection.execute(query).mappings().all()
        return [
            trajectory_row(row)
            | {
                "run_id": job.job_id,
                "source_uri": job.source,
                "question_id": f"q{keys[row['chain_key']]}",
            }
            for row in rows
        ]

    def record_grounding(
        self, job_id: str, owner: str, chain_index: int, grounding: Grounding
    ) -> bool:
        """Records where chain `chain_index`'s answer is found in the job's document."""
        evidence = [item.as_dict() for item in grounding.evidence]
        with self._write() as connection:
            if not self._still_held(connection, owner, job_id):
                return False
            key = chain_key(job_id, chain_index)
            write_grounding(connection, key, grounding.grounded, grounding.reason, evidence)
        return True

    def finish(self, job_id: str, owner: str, status: str, error: str | None = None) -> bool:
        """Ends a job the owner holds as succeeded or failed, with its `end` event."""
        with self._write() as connection:
            if not _end_job(connection, self._held_by(owner, [job_id]), status, error):
                return False
            _add_end_event(connection, job_id, status, error)
        return True

    # --- plumbing ---------------------------------------------------------------------------

    def _load(
        self, job_id: str, build: Callable[[RowMapping, tuple[ChainState, ...]], T]
    ) -> T | None:
        """`build` applied to the job's row and chains; None when there is no such job."""
        with self._read() as connection:
            row = connection.execute(select(jobs).where(jobs.c.job_id == job_id)).mappings().first()
            if row is None:
                return None
            states = _chain_states(connection, job_id, len(json.loads(row["questions"])))
        return build(row, states)

    @staticmethod
    def _held_by(owner: str, job_ids: Sequence[str]) -> Any:
        return and_(
            jobs.c.job_id.in_(list(job_ids)), jobs.c.owner == owner, jobs.c.status == RUNNING
        )

    def _still_held(self, connection: Connection, owner: str, job_id: str) -> bool:
        holder = connection.execute(
            select(jobs.c.job_id).where(self._held_by(owner, [job_id]))
        ).first()
        return holder is not None

    @contextmanager
    def _write(self) -> Iterator[Connection]:
        try:
            with self._writer.begin() as connection:
                yield connection
        except SQLAlchemyError as error:
            raise StoreError(f"job store {self.safe_url}: {first_line(error)}") from None

    @contextmanager
    def _read(self) -> Iterator[Connection]:
        try:
            with self._reader.connect() as connection:
                yield connection
        except SQLAlchemyError as error:
            raise StoreError(f"job store {self.safe_url}: {first_line(error)}") from None


def _job_fields(row: RowMapping, states: tuple[ChainState, ...]) -> dict[str, Any]:
    """What a JobState and a JobInput both say of a stored job."""
    return {
        "job_id": row["job_id"],
        "name": row["name"],
        "questions": tuple(json.loads(row["questions"])),
        "method": json.loads(row["method"]),
        "chains": states,
    }


def _job_state(row: RowMapping, states: tuple[ChainState, ...]) -> JobState:
    return JobState(
        **_job_fields(row, states),
        status=row["status"],
        source=row["source"],
        document=json.loads(row["document"]) if row["document"] else None,
        error=row["error"],
        created_at=row["created_at"],
        started_at=row["started_at"],
        updated_at=row["updated_at"],
        finished_at=row["finished_at"],
    )


def _job_input(row: RowMapping, states: tuple[ChainState, ...]) -> JobInput:
    return JobInput(
        **_job_fields(row, states),
        uri=row["uri"],
        data=row["input_data"],
        mime_type=row["mime_type"],
        text=row["text"],
    )


def chain_key(job_id: str, chain_index: int) -> str:
    """The key of a job's chain in the `chains` table, and the chain's id."""
    return f"{job_id}#q{chain_index}"


def _chain_states(connection: Connection, job_id: str, n_questions: int) -> tuple[ChainState, ...]:
    """The job's chains in question order; none before its document is read."""
    keys = [chain_key(job_id, index) for index in range(n_questions)]
    rows = connection.execute(
        select(
            *(chains.c[name] for name in (*CHAIN_COLUMNS, "status")),
            groundings.c.grounded,
            groundings.c.reason,
            groundings.c.evidence,
        )
        .select_from(chains.outerjoin(groundings, groundings.c.chain_key == chains.c.chain_key))
        .where(chains.c.chain_key.in_(keys))
    ).mappings()
    by_key = {row["chain_key"]: row for row in rows}
    return tuple(
        ChainState(
            chain_index=index,
            status=ANSWER_STATUS.get(by_key[key]["status"], "pending"),
            **{name: by_key[key][name] for name in CHAIN_COLUMNS},
            grounded=None if by_key[key]["grounded"] is None else bool(by_key[key]["grounded"]),
            grounding_reason=by_key[key]["reason"],
            evidence=tuple(json.loads(by_key[key]["evidence"] or "[]")),
        )
        for index, key in enumerate(keys)
        if key in by_key
    )


def _end_job(
    connection: Connection, which: ColumnElement[bool], status: str, error: str | None
) -> bool:
    """Ends the job `which` selects (if it does) as `status`: no lease, no input kept."""
    now = time.time()
    ended = connection.execute(
        update(jobs)
        .where(which)
        .values(
            status=status,
            error=error,
            owner=None,
            lease_expires_at=None,
            input_data=None,
            uri=None,
            updated_at=now,
            finished_at=now,
        )
    ).rowcount
    return ended == 1


def _add_end_event(connection: Connection, job_id: str, status: str, error: str | None) -> None:
    questions = connection.execute(
        select(jobs.c.questions).where(jobs.c.job_id == job_id)
    ).scalar_one()
    answers = [
        {"question": s.question, "status": s.status, "answer": s.answer}
        for s in _chain_states(connection, job_id, len(json.loads(questions)))
    ]
    _add_event(connection, job_id, "end", {"status": status, "error": error, "answers": answers})


def _add_event(connection: Connection, job_id: str, kind: str, data: dict[str, Any]) -> None:
    connection.execute(
        insert(events).values(
            job_id=job_id,
            kind=kind,
            data=json.dumps({"job_id": job_id, **data}),
            created_at=time.time(),
        )
    )


def _open_engines(url: URL) -> tuple[Engine, Engine]:
    """(writer, reader). PostgreSQL: one engine for both. SQLite: several replica processes
    write one file, so the writer takes the write lock when a transaction begins (waiting up to
    the busy timeout) and the reader, in WAL mode, reads beside it without taking any lock."""
    if url.get_backend_name() != "sqlite":
        engine = open_store_engine(url, pool_size=4, max_overflow=8)
        return engine, engine
    if url.database and url.database != ":memory:":
        Path(url.database).expanduser().parent.mkdir(parents=True, exist_ok=True)
    writer = open_store_engine(url, busy_timeout_ms=SQLITE_BUSY_TIMEOUT_MS)
    reader = open_store_engine(url, write_lock=False, busy_timeout_ms=SQLITE_BUSY_TIMEOUT_MS)
    return writer, reader
