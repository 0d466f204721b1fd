"""Serving jobs in an SQL database (SQLite by default, PostgreSQL by URL), through SQLAlchemy Core.

Three tables, prefixed `serving_` so they can share a database with other memstream state:
- `serving_jobs`: a job's inputs, status, lease and outcome. The input bytes and URI (which may
  carry a presigned token) are kept only until the document is read; from then on its text is,
  so a resumed job reads the same text.
- `serving_chains`: one row per question, the chain's checkpoint `(step, memory)` and counters.
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
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from sqlalchemy import (
    Column,
    Float,
    Integer,
    LargeBinary,
    MetaData,
    String,
    Table,
    Text,
    and_,
    create_engine,
    event,
    func,
    insert,
    or_,
    select,
    update,
)
from sqlalchemy.engine import Connection, Engine, make_url
from sqlalchemy.exc import ArgumentError, SQLAlchemyError

QUEUED, RUNNING, SUCCEEDED, FAILED, CANCELLED = (
    "queued",
    "running",
    "succeeded",
    "failed",
    "cancelled",
)
UNFINISHED = (QUEUED, RUNNING)
FINISHED = (SUCCEEDED, FAILED, CANCELLED)
SQLITE_BUSY_TIMEOUT_MS = 30_000

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

chains = Table(
    "serving_chains",
    metadata,
    Column("job_id", String(32), primary_key=True),
    Column("chain_index", Integer, primary_key=True),
    Column("question", Text, nullable=False),
    Column("n_segments", Integer, nullable=False),
    Column("step", Integer, nullable=False),  # the next step to run = steps done
    Column("memory", Text),  # after the last update step; NULL before the first
    Column("status", String(16), nullable=False),  # "pending", "ok" or "error"
    Column("answer", Text),
    Column("raw_response", Text),
    Column("error", Text),
    Column("prompt_tokens", Integer, nullable=False),
    Column("completion_tokens", Integer, nullable=False),
    Column("compute_s", Float, nullable=False),  # sum of the step latencies
    Column("updated_at", Float, nullable=False),
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
    question: str
    n_segments: int
    step: int
    memory: str | None
    status: str
    answer: str | None
    raw_response: str | None
    error: str | None
    prompt_tokens: int
    completion_tokens: int
    compute_s: float

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
class StepWrite:
    """One finished model call of a chain, to be checkpointed."""

    chain_index: int
    step: int  # the step that ran
    final: bool
    memory: str  # the chain's memory after the step
    raw_response: str | None
    answer: str | None
    prompt_tokens: int
    completion_tokens: int
    latency_s: float


@dataclass(frozen=True)
class Event:
    event_id: int
    kind: str
    data: dict[str, Any] = field(default_factory=dict)


class JobStore:
    def __init__(self, url: str) -> None:
        self.url = url
        try:
            self._writer, self._reader = _open_engines(url)
            metadata.create_all(self._writer)
        except (ArgumentError, SQLAlchemyError, OSError) as error:
            raise StoreError(
                f"cannot open the job store {_safe_url(url)}: {_first_line(error)}"
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
        with self._read() as connection:
            row = connection.execute(select(jobs).where(jobs.c.job_id == job_id)).mappings().first()
            if row is None:
                return None
            states = _chain_states(connection, job_id)
        return JobState(
            job_id=row["job_id"],
            status=row["status"],
            name=row["name"],
            source=row["source"],
            questions=tuple(json.loads(row["questions"])),
            method=json.loads(row["method"]),
            document=json.loads(row["document"]) if row["document"] else None,
            error=row["error"],
            created_at=row["created_at"],
            started_at=row["started_at"],
            updated_at=row["updated_at"],
            finished_at=row["finished_at"],
            chains=states,
        )

    def cancel(self, job_id: str) -> bool:
        """Cancels an unfinished job: False when there is no such job, JobConflict when it has
        already finished."""
        now = time.time()
        with self._write() as connection:
            status = connection.execute(
                select(jobs.c.status).where(jobs.c.job_id == job_id)
            ).scalar()
            if status is None:
                return False
            if status in FINISHED:
                raise JobConflict(status)
            connection.execute(
                update(jobs)
                .where(jobs.c.job_id == job_id)
                .values(
                    status=CANCELLED,
                    error="cancelled by the client",
                    owner=None,
                    lease_expires_at=None,
                    input_data=None,
                    uri=None,
                    updated_at=now,
                    finished_at=now,
                )
            )
            _add_event(connection, job_id, "end", _end_data(connection, job_id, CANCELLED, None))
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
        with self._read() as connection:
            row = connection.execute(select(jobs).where(jobs.c.job_id == job_id)).mappings().first()
            if row is None:
                return None
            states = _chain_states(connection, job_id)
        return JobInput(
            job_id=job_id,
            name=row["name"],
            uri=row["uri"],
            data=row["input_data"],
            mime_type=row["mime_type"],
            questions=tuple(json.loads(row["questions"])),
            method=json.loads(row["method"]),
            text=row["text"],
            chains=states,
        )

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
            connection.execute(
                insert(chains),
                [
                    {
                        "job_id": job_id,
                        "chain_index": index,
                        "question": question,
                        "n_segments": document["n_segments"],
                        "step": 0,
                        "memory": None,
                        "status": "pending",
                        "prompt_tokens": 0,
                        "completion_tokens": 0,
                        "compute_s": 0.0,
                        "updated_at": now,
                    }
                    for index, question in enumerate(questions)
                ],
            )
        return True

    def checkpoint(self, job_id: str, owner: str, step: StepWrite) -> bool:
        """Advances a chain past `step` and records its event; False when the lease is gone."""
        now = time.time()
        key = and_(chains.c.job_id == job_id, chains.c.chain_index == step.chain_index)
        with self._write() as connection:
            if not self._still_held(connection, owner, job_id):
                return False
            values: dict[str, Any] = {
                "step": step.step + 1,
                "memory": step.memory,
                "prompt_tokens": chains.c.prompt_tokens + step.prompt_tokens,
                "completion_tokens": chains.c.completion_tokens + step.completion_tokens,
                "compute_s": chains.c.compute_s + step.latency_s,
                "updated_at": now,
            }
            if step.final:
                values |= {"status": "ok", "answer": step.answer, "raw_response": step.raw_response}
            connection.execute(update(chains).where(key).values(**values))
            if not step.final:
                n_segments = connection.execute(select(chains.c.n_segments).where(key)).scalar()
                _add_event(
                    connection,
                    job_id,
                    "memory",
                    {
                        "question_index": step.chain_index,
                        "step": step.step,
                        "segments_done": step.step + 1,
                        "segments_total": n_segments,
                        "memory": step.memory,
                    },
                )
            connection.execute(update(jobs).where(jobs.c.job_id == job_id).values(updated_at=now))
        return True

    def fail_chain(self, job_id: str, owner: str, chain_index: int, error: str) -> bool:
        now = time.time()
        with self._write() as connection:
            if not self._still_held(connection, owner, job_id):
                return False
            connection.execute(
                update(chains)
                .where(and_(chains.c.job_id == job_id, chains.c.chain_index == chain_index))
                .values(status="error", error=error, updated_at=now)
            )
        return True

    def finish(self, job_id: str, owner: str, status: str, error: str | None = None) -> bool:
        """Ends a job the owner holds as succeeded or failed, with its `end` event."""
        now = time.time()
        with self._write() as connection:
            finished = connection.execute(
                update(jobs)
                .where(self._held_by(owner, [job_id]))
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
            if finished != 1:
                return False
            _add_event(connection, job_id, "end", _end_data(connection, job_id, status, error))
        return True

    # --- plumbing ---------------------------------------------------------------------------

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
            raise StoreError(f"job store {_safe_url(self.url)}: {_first_line(error)}") from None

    @contextmanager
    def _read(self) -> Iterator[Connection]:
        try:
            with self._reader.connect() as connection:
                yield connection
        except SQLAlchemyError as error:
            raise StoreError(f"job store {_safe_url(self.url)}: {_first_line(error)}") from None


def _chain_states(connection: Connection, job_id: str) -> tuple[ChainState, ...]:
    rows = connection.execute(
        select(chains).where(chains.c.job_id == job_id).order_by(chains.c.chain_index)
    ).mappings()
    return tuple(
        ChainState(
            chain_index=row["chain_index"],
            question=row["question"],
            n_segments=row["n_segments"],
            step=row["step"],
            memory=row["memory"],
            status=row["status"],
            answer=row["answer"],
            raw_response=row["raw_response"],
            error=row["error"],
            prompt_tokens=row["prompt_tokens"],
            completion_tokens=row["completion_tokens"],
            compute_s=row["compute_s"],
        )
        for row in rows
    )


def _end_data(
    connection: Connection, job_id: str, status: str, error: str | None
) -> dict[str, Any]:
    return {
        "status": status,
        "error": error,
        "answers": [
            {"question": s.question, "status": s.status, "answer": s.answer}
            for s in _chain_states(connection, job_id)
        ],
    }


def _add_event(connection: Connection, job_id: str, kind: str, data: dict[str, Any]) -> None:
    connection.execute(
        insert(events).values(
            job_id=job_id,
            kind=kind,
            data=json.dumps({"job_id": job_id, **data}),
            created_at=time.time(),
        )
    )


def _open_engines(url: str) -> tuple[Engine, Engine]:
    """(writer, reader). PostgreSQL: one engine for both. SQLite: several replica processes
    write one file, so the writer takes the write lock when a transaction begins (waiting up to
    the busy timeout) and the reader, in WAL mode, reads beside it without taking any lock."""
    parsed = make_url(url)
    if parsed.get_backend_name() != "sqlite":
        engine = create_engine(url, pool_size=4, max_overflow=8, pool_pre_ping=True)
        return engine, engine
    if parsed.database and parsed.database != ":memory:":
        Path(parsed.database).expanduser().parent.mkdir(parents=True, exist_ok=True)
    writer = create_engine(url, connect_args={"timeout": SQLITE_BUSY_TIMEOUT_MS / 1000})
    reader = create_engine(url, connect_args={"timeout": SQLITE_BUSY_TIMEOUT_MS / 1000})
    for engine in (writer, reader):
        event.listen(engine, "connect", _configure_sqlite)

    @event.listens_for(writer, "begin")
    def begin_immediate(connection: Connection) -> None:
        connection.exec_driver_sql("BEGIN IMMEDIATE")

    return writer, reader


def _configure_sqlite(dbapi_connection: Any, _record: Any) -> None:
    dbapi_connection.isolation_level = None  # SQLAlchemy's events decide where transactions begin
    cursor = dbapi_connection.cursor()
    cursor.execute("PRAGMA journal_mode=WAL")
    cursor.execute(f"PRAGMA busy_timeout={SQLITE_BUSY_TIMEOUT_MS}")
    cursor.execute("PRAGMA synchronous=NORMAL")
    cursor.close()


def _safe_url(url: str) -> str:
    try:
        return make_url(url).render_as_string(hide_password=True)
    except ArgumentError:
        return "(invalid URL)"


def _first_line(error: BaseException) -> str:
    text = str(getattr(error, "orig", None) or error)
    return text.strip().splitlines()[0] if text.strip() else type(error).__name__
