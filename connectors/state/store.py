"""Chain checkpoints in an SQL database (SQLite or PostgreSQL), through SQLAlchemy Core.

A chain is content-addressed: its key hashes the document's text, the question, the model and the
method, so a rerun (or another run over the same content) finds its progress. Every model call
is one `steps` row, written in the same transaction that advances the chain's checkpoint
(`chains.step`, `chains.memory`), so after a crash a chain resumes from its last written step and
its trajectory has no gap and no duplicate.

A run's membership tables (`documents`, `run_chains`, `errors`) say which documents and
questions belong to the run; each row carries the run's attempt number, so the export of a rerun
shows exactly the inputs that attempt saw.

The serving job store (`serving/store.py`) builds on this module: the same URL parsing and
engines, and its chains checkpointed in the same `chains` and `steps` tables by `write_step`.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any

from sqlalchemy import (
    Boolean,
    Column,
    ColumnElement,
    Float,
    Integer,
    Join,
    MetaData,
    String,
    Table,
    Text,
    and_,
    create_engine,
    event,
    func,
    select,
    update,
)
from sqlalchemy.engine import URL, Connection, Engine, make_url
from sqlalchemy.exc import ArgumentError, SQLAlchemyError

from connectors.sql import redacted, with_default_driver

if TYPE_CHECKING:
    from pipeline.core.chain import MemoryChain, StepRecord

PENDING, RUNNING, DONE, FAILED = "pending", "running", "done", "failed"
SUPPORTED_DIALECTS = ("sqlite", "postgresql")
SQLITE_BUSY_TIMEOUT_MS = 60_000

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
)

chains = Table(
    "chains",
    metadata,
    Column("chain_key", String(64), primary_key=True),
    Column("run_id", String(64), nullable=False),  # the run that last planned it
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
)

# Where each answered chain's answer and memory are found in the source (pipeline.core.evidence).
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


class StateStoreError(RuntimeError):
    """A state store that cannot be used, in one line: what is wrong and what to do."""


@dataclass(frozen=True)
class DocumentRecord:
    run_id: str
    attempt: int
    source_uri: str
    doc_id: str
    name: str
    content_sha256: str
    parser: str | None
    pages: int | None
    warnings: Sequence[str]
    metadata: Mapping[str, Any]
    n_tokens: int | None = None
    n_segments: int | None = None


@dataclass(frozen=True)
class PlannedChain:
    chain_key: str
    question_id: str
    question: str


@dataclass(frozen=True)
class Checkpoint:
    status: str
    step: int
    memory: str | None


@dataclass(frozen=True)
class StepCheckpoint:
    """One finished model call (its `steps` row; the record's chain_id is the chain key) and
    the chain state right after it."""

    record: StepRecord
    next_step: int
    memory: str
    done: bool
    answer: str | None
    raw_response: str | None

    @classmethod
    def after(cls, chain: MemoryChain, record: StepRecord) -> StepCheckpoint:
        return cls(record, chain.step, chain.memory, chain.done, chain.answer, chain.raw_response)

    @property
    def chain_key(self) -> str:
        return self.record.chain_id


@dataclass(frozen=True)
class ErrorRecord:
    run_id: str
    attempt: int
    source_uri: str
    stage: str  # "read", "parse", "segment", "memory"
    error_type: str
    message: str
    doc_id: str | None = None
    name: str | None = None


@dataclass(frozen=True)
class RunProgress:
    steps_done: int
    steps_planned: int
    chains_done: int
    chains_planned: int


class StateStore:
    """Checkpoints and run membership in one database. Picklable: each process opens its own
    connection pool on first use."""

    def __init__(self, url: str) -> None:
        parsed = parse_store_url(url)
        self.url = parsed.render_as_string(hide_password=False)
        self.safe_url = redacted(parsed)
        self._engine: Engine | None = None

    def __repr__(self) -> str:
        return f"StateStore({self.safe_url!r})"

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_engine": None}

    @property
    def engine(self) -> Engine:
        if self._engine is None:
            self._engine = open_store_engine(self.url)
        return self._engine

    def close(self) -> None:
        if self._engine is not None:
            self._engine.dispose()
            self._engine = None

    # --- setup ----------------------------------------------------------------------------

    def create(self) -> None:
        """Creates the tables when missing; raises StateStoreError when the database is
        unreachable or refuses writes."""
        try:
            metadata.create_all(self.engine)
        except SQLAlchemyError as error:
            raise StateStoreError(f"state store {self.safe_url}: {first_line(error)}") from None

    def begin_run(self, run_id: str, summary: Mapping[str, Any]) -> int:
        """Registers an attempt of the run and returns its number (1 for a new run)."""
        now = time.time()
        with self._transaction() as connection:
            found = connection.execute(
                select(runs.c.attempt).where(runs.c.run_id == run_id)
            ).scalar_one_or_none()
            attempt = 1 if found is None else found + 1
            _upsert(
                connection,
                runs,
                {
                    "run_id": run_id,
                    "attempt": attempt,
                    "status": RUNNING,
                    "summary": json.dumps(summary, sort_keys=True, default=str),
                    "created_at": now,
                    "started_at": now,
                    "finished_at": None,
                },
                keys=["run_id"],
                update=["attempt", "status", "summary", "started_at", "finished_at"],
            )
        return attempt

    def finish_run(self, run_id: str, status: str) -> None:
        with self._transaction() as connection:
            connection.execute(
                update(runs)
                .where(runs.c.run_id == run_id)
                .values(status=status, finished_at=time.time())
            )

    # --- planning (segment stage) ---------------------------------------------------------

    def plan_document(
        self,
        document: DocumentRecord,
        planned: Sequence[PlannedChain],
    ) -> dict[str, str]:
        """Records the document and its chains for the run; chains seen before keep their
        progress. Returns each chain's status."""
        now = time.time()
        with self._transaction() as connection:
            _upsert(
                connection,
                documents,
                _document_row(document, now),
                keys=["run_id", "source_uri"],
                update=[
                    c.name for c in documents.columns if c.name not in ("run_id", "source_uri")
                ],
            )
            for chain in planned:
                _upsert(
                    connection,
                    chains,
                    pending_chain_row(
                        chain,
                        run_id=document.run_id,
                        doc_id=document.doc_id,
                        source_uri=document.source_uri,
                        n_segments=document.n_segments or 0,
                        n_tokens=document.n_tokens or 0,
                        now=now,
                    ),
                    keys=["chain_key"],
                    update=["run_id", "doc_id", "source_uri", "question_id", "question"],
                )
                _upsert(
                    connection,
                    run_chains,
                    {
                        "run_id": document.run_id,
                        "source_uri": document.source_uri,
                        "question_id": chain.question_id,
                        "attempt": document.attempt,
                        "chain_key": chain.chain_key,
                        "question": chain.question,
                        "updated_at": now,
                    },
                    keys=["run_id", "source_uri", "question_id"],
                    update=["attempt", "chain_key", "question", "updated_at"],
                )
            return _statuses(connection, [chain.chain_key for chain in planned])

    def chain_statuses(self, chain_keys: Sequence[str]) -> dict[str, str]:
        """The status of each chain the store knows."""
        with self._transaction() as connection:
            return _statuses(connection, chain_keys)

    def record_error(self, error: ErrorRecord) -> None:
        row = {**asdict(error), "created_at": time.time()}
        with self._transaction() as connection:
            _upsert(
                connection,
                errors,
                row,
                keys=["run_id", "source_uri", "stage"],
                update=[name for name in row if name not in ("run_id", "source_uri", "stage")],
            )

    # --- checkpoints (memory stage) -------------------------------------------------------

    def load_checkpoint(self, chain_key: str) -> Checkpoint | None:
        with self._transaction() as connection:
            row = connection.execute(
                select(chains.c.status, chains.c.step, chains.c.memory).where(
                    chains.c.chain_key == chain_key
                )
            ).first()
        return None if row is None else Checkpoint(row.status, row.step, row.memory)

    def ungrounded_answer(self, chain_key: str) -> tuple[str | None, str] | None:
        """(answer, final memory) of an answered chain whose evidence was never recorded (a
        crash came between the two), else None."""
        with self._transaction() as connection:
            row = connection.execute(
                select(chains.c.answer, chains.c.memory)
                .select_from(
                    chains.outerjoin(groundings, groundings.c.chain_key == chains.c.chain_key)
                )
                .where(
                    and_(
                        chains.c.chain_key == chain_key,
                        chains.c.status == DONE,
                        groundings.c.chain_key.is_(None),
                    )
                )
            ).first()
        return None if row is None else (row.answer, row.memory or "")

    def mark_running(self, chain_key: str, run_id: str) -> None:
        now = time.time()
        with self._transaction() as connection:
            connection.execute(
                update(chains)
                .where(chains.c.chain_key == chain_key)
                .values(
                    status=RUNNING,
                    run_id=run_id,
                    error=None,
                    updated_at=now,
                    started_at=func.coalesce(chains.c.started_at, now),
                )
            )

    def record_step(self, checkpoint: StepCheckpoint) -> None:
        """Writes one step and advances its chain, atomically."""
        with self._transaction() as connection:
            write_step(connection, checkpoint)

    def mark_failed(self, chain_key: str, error: str) -> None:
        with self._transaction() as connection:
            write_failure(connection, chain_key, error)

    def record_grounding(
        self, chain_key: str, grounded: bool, reason: str, evidence: Sequence[Mapping[str, Any]]
    ) -> None:
        with self._transaction() as connection:
            write_grounding(connection, chain_key, grounded, reason, evidence)

    # --- reading a run back (export) ------------------------------------------------------

    def answers(self, run_id: str, attempt: int) -> Iterator[dict[str, Any]]:
        """One row per (document, question) of the run's attempt."""
        query = (
            select(
                run_chains.c.run_id,
                documents.c.doc_id,
                documents.c.name,
                run_chains.c.source_uri,
                documents.c.content_sha256,
                documents.c.parser,
                documents.c.pages,
                documents.c.warnings,
                run_chains.c.question_id,
                run_chains.c.question,
                run_chains.c.chain_key,
                chains.c.status,
                chains.c.answer,
                chains.c.raw_response,
                chains.c.memory.label("final_memory"),
                chains.c.step.label("steps_done"),
                chains.c.n_segments,
                chains.c.n_tokens,
                chains.c.prompt_tokens,
                chains.c.completion_tokens,
                chains.c.compute_s,
                chains.c.started_at,
                chains.c.finished_at,
                chains.c.error,
                groundings.c.grounded,
                groundings.c.reason.label("grounding_reason"),
                groundings.c.evidence,
            )
            .select_from(
                _with_documents(chains).outerjoin(
                    groundings, groundings.c.chain_key == chains.c.chain_key
                )
            )
            .where(_of_attempt(run_id, attempt))
            .order_by(run_chains.c.source_uri, run_chains.c.question_id)
        )
        return self._stream(query)

    def trajectory(self, run_id: str, attempt: int) -> Iterator[dict[str, Any]]:
        """One row per memory update (and final answer) of every chain of the run's attempt."""
        query = (
            select(
                run_chains.c.run_id,
                run_chains.c.chain_key,
                documents.c.doc_id,
                run_chains.c.source_uri,
                run_chains.c.question_id,
                steps.c.step,
                steps.c.kind,
                steps.c.segment_index,
                steps.c.token_start,
                steps.c.token_end,
                steps.c.char_start,
                steps.c.char_end,
                steps.c.memory_after,
                steps.c.prompt_tokens,
                steps.c.completion_tokens,
                steps.c.finish_reason,
                steps.c.latency_s,
                rejected_quotes.c.quotes.label("rejected_quotes"),
            )
            .select_from(with_rejected_quotes(_with_documents(steps)))
            .where(_of_attempt(run_id, attempt))
            .order_by(run_chains.c.source_uri, run_chains.c.question_id, steps.c.step)
        )
        return self._stream(query)

    def errors(self, run_id: str, attempt: int) -> Iterator[dict[str, Any]]:
        query = (
            select(
                errors.c.run_id,
                errors.c.doc_id,
                errors.c.name,
                errors.c.source_uri,
                errors.c.stage,
                errors.c.error_type,
                errors.c.message,
            )
            .where(and_(errors.c.run_id == run_id, errors.c.attempt == attempt))
            .order_by(errors.c.source_uri, errors.c.stage)
        )
        return self._stream(query)

    def chain_status_counts(self, run_id: str, attempt: int) -> dict[str, int]:
        query = (
            select(chains.c.status, func.count())
            .select_from(_joined(chains))
            .where(_of_attempt(run_id, attempt))
            .group_by(chains.c.status)
        )
        with self._transaction() as connection:
            return {status: count for status, count in connection.execute(query)}

    def progress(self, run_id: str, attempt: int) -> RunProgress:
        """Model calls done and planned, and chains answered and planned, of the chains the
        run's attempt has planned so far."""
        query = (
            select(
                func.coalesce(func.sum(chains.c.step), 0),
                func.coalesce(func.sum(chains.c.n_segments + 1), 0),
                func.count().filter(chains.c.status == DONE),
                func.count(),
            )
            .select_from(_joined(chains))
            .where(_of_attempt(run_id, attempt))
        )
        with self._transaction() as connection:
            return RunProgress(*connection.execute(query).one())

    def document_counts(self, run_id: str, attempt: int) -> tuple[int, int]:
        """(documents with answers rows, documents with error rows) of the run's attempt."""
        answered = select(func.count(func.distinct(run_chains.c.source_uri))).where(
            _of_attempt(run_id, attempt)
        )
        failed = select(func.count(func.distinct(errors.c.source_uri))).where(
            and_(errors.c.run_id == run_id, errors.c.attempt == attempt)
        )
        with self._transaction() as connection:
            return connection.execute(answered).scalar_one(), connection.execute(
                failed
            ).scalar_one()

    def busy_window(self, run_id: str, attempt: int, since: float) -> float:
        """Seconds from the start of the first model call to the end of the last one among
        the steps the run's attempt wrote after `since` (0 when it wrote none)."""
        query = (
            select(func.min(steps.c.created_at - steps.c.latency_s), func.max(steps.c.created_at))
            .select_from(_joined(steps))
            .where(_of_attempt(run_id, attempt), steps.c.created_at >= since)
        )
        with self._transaction() as connection:
            first, last = connection.execute(query).one()
        return 0.0 if first is None else last - first

    # --- plumbing ---------------------------------------------------------------------------

    def _transaction(self):  # type: ignore[no-untyped-def]
        try:
            return self.engine.begin()
        except SQLAlchemyError as error:
            raise StateStoreError(f"state store {self.safe_url}: {first_line(error)}") from None

    def _stream(self, query: Any, batch_size: int = 1000) -> Iterator[dict[str, Any]]:
        with self.engine.connect() as connection:
            result = connection.execution_options(yield_per=batch_size).execute(query)
            for row in result:
                yield dict(row._mapping)


# --- what the serving job store shares ------------------------------------------------------


def parse_store_url(url: str, what: str = "state store") -> URL:
    """A SQLite or PostgreSQL URL (plain postgresql:// means psycopg 3); StateStoreError
    otherwise, naming `what` the URL is for."""
    try:
        parsed = make_url(url)
    except (ArgumentError, ValueError):
        raise StateStoreError(
            f"cannot parse the {what} URL {url!r}: write it as sqlite:///path/state.db "
            "or postgresql+psycopg://user:password@host:port/db"
        ) from None
    if parsed.get_backend_name() not in SUPPORTED_DIALECTS:
        raise StateStoreError(
            f"{what} {parsed.get_backend_name()!r} is not supported: use SQLite or PostgreSQL"
        )
    return with_default_driver(parsed)


def open_store_engine(
    url: str | URL,
    *,
    write_lock: bool = True,
    busy_timeout_ms: int = SQLITE_BUSY_TIMEOUT_MS,
    pool_size: int = 2,
    max_overflow: int = 4,
) -> Engine:
    """An engine on a store database. Several processes write one SQLite file: WAL lets readers
    run beside the writer, and with `write_lock` every transaction begins with BEGIN IMMEDIATE,
    taking the write lock up front, so it waits for it (busy timeout) instead of failing when
    another writer committed after it started reading."""
    if make_url(url).get_backend_name() != "sqlite":
        return create_engine(
            url, pool_size=pool_size, max_overflow=max_overflow, pool_pre_ping=True
        )
    engine = create_engine(url, connect_args={"timeout": busy_timeout_ms / 1000})

    @event.listens_for(engine, "connect")
    def configure(dbapi_connection: Any, _record: Any) -> None:
        dbapi_connection.isolation_level = None  # SQLAlchemy's events begin transactions
        cursor = dbapi_connection.cursor()
        cursor.execute("PRAGMA journal_mode=WAL")
        cursor.execute(f"PRAGMA busy_timeout={busy_timeout_ms}")
        cursor.execute("PRAGMA synchronous=NORMAL")
        cursor.close()

    if write_lock:

        @event.listens_for(engine, "begin")
        def begin_immediate(connection: Connection) -> None:
            connection.exec_driver_sql("BEGIN IMMEDIATE")

    return engine


# What a chain's checkpoints and its answer's evidence are kept in, wherever the chain runs.
CHECKPOINT_TABLES = (chains, steps, rejected_quotes, groundings)


def pending_chain_row(
    chain: PlannedChain,
    *,
    run_id: str,
    doc_id: str,
    source_uri: str,
    n_segments: int,
    n_tokens: int,
    now: float,
) -> dict[str, Any]:
    """The `chains` row of a chain that has not run a step yet."""
    return {
        "chain_key": chain.chain_key,
        "run_id": run_id,
        "doc_id": doc_id,
        "source_uri": source_uri,
        "question_id": chain.question_id,
        "question": chain.question,
        "status": PENDING,
        "step": 0,
        "n_segments": n_segments,
        "n_tokens": n_tokens,
        "prompt_tokens": 0,
        "completion_tokens": 0,
        "compute_s": 0.0,
        "created_at": now,
        "updated_at": now,
    }


def write_step(connection: Connection, checkpoint: StepCheckpoint) -> None:
    """Writes one step and advances its chain, inside the caller's transaction."""
    now = time.time()
    step_row = asdict(checkpoint.record)
    step_row["chain_key"] = step_row.pop("chain_id")
    dropped = step_row.pop("rejected_quotes")
    step_row["memory_after"] = step_row.pop("output")
    step_row["created_at"] = now
    of_chain = steps.c.chain_key == checkpoint.chain_key
    chain_values: dict[str, Any] = {
        "step": checkpoint.next_step,
        "memory": checkpoint.memory,
        "status": DONE if checkpoint.done else RUNNING,
        "updated_at": now,
        "prompt_tokens": select(func.sum(steps.c.prompt_tokens)).where(of_chain).scalar_subquery(),
        "completion_tokens": select(func.sum(steps.c.completion_tokens))
        .where(of_chain)
        .scalar_subquery(),
        "compute_s": select(func.sum(steps.c.latency_s)).where(of_chain).scalar_subquery(),
    }
    if checkpoint.done:
        chain_values |= {
            "answer": checkpoint.answer,
            "raw_response": checkpoint.raw_response,
            "finished_at": now,
            "error": None,
        }
    _upsert(
        connection,
        steps,
        step_row,
        keys=["chain_key", "step"],
        update=[name for name in step_row if name not in ("chain_key", "step")],
    )
    connection.execute(
        update(chains).where(chains.c.chain_key == checkpoint.chain_key).values(chain_values)
    )
    if dropped:
        row = {"chain_key": checkpoint.chain_key, "step": checkpoint.record.step,
               "quotes": json.dumps(list(dropped), ensure_ascii=False)}  # fmt: skip
        _upsert(connection, rejected_quotes, row, keys=["chain_key", "step"], update=["quotes"])


def write_grounding(
    connection: Connection,
    chain_key: str,
    grounded: bool,
    reason: str,
    evidence: Sequence[Mapping[str, Any]],
) -> None:
    """Records where a chain's answer was found in the source, inside the caller's transaction."""
    row = {
        "chain_key": chain_key,
        "grounded": grounded,
        "reason": reason,
        "evidence": json.dumps(list(evidence), ensure_ascii=False),
        "created_at": time.time(),
    }
    _upsert(connection, groundings, row, keys=["chain_key"],
            update=["grounded", "reason", "evidence", "created_at"])  # fmt: skip


def write_failure(connection: Connection, chain_key: str, error: str) -> None:
    """Marks an unanswered chain failed, inside the caller's transaction."""
    now = time.time()
    connection.execute(
        update(chains)
        .where(and_(chains.c.chain_key == chain_key, chains.c.status != DONE))
        .values(status=FAILED, error=error, updated_at=now, finished_at=now)
    )


def first_line(error: BaseException) -> str:
    """The first line of a database error, without SQLAlchemy's statement and background."""
    reason = str(getattr(error, "orig", None) or error).strip()
    return reason.splitlines()[0] if reason else type(error).__name__


# --- plumbing -----------------------------------------------------------------------------------


def _joined(table: Table) -> Join:
    """run_chains joined with `table` (chains or steps) by chain key."""
    return run_chains.join(table, table.c.chain_key == run_chains.c.chain_key)


def with_rejected_quotes(steps_joined: Table | Join) -> Join:
    """`steps` (or a join holding it) with each step's rejected quotes, where it has any."""
    return steps_joined.outerjoin(
        rejected_quotes,
        and_(
            rejected_quotes.c.chain_key == steps.c.chain_key,
            rejected_quotes.c.step == steps.c.step,
        ),
    )


def _with_documents(table: Table) -> Join:
    """`_joined(table)`, and the documents of the run."""
    return _joined(table).join(
        documents,
        and_(
            documents.c.run_id == run_chains.c.run_id,
            documents.c.source_uri == run_chains.c.source_uri,
        ),
    )


def _of_attempt(run_id: str, attempt: int) -> ColumnElement[bool]:
    return and_(run_chains.c.run_id == run_id, run_chains.c.attempt == attempt)


def _statuses(connection: Connection, chain_keys: Sequence[str]) -> dict[str, str]:
    if not chain_keys:
        return {}
    found = connection.execute(
        select(chains.c.chain_key, chains.c.status).where(chains.c.chain_key.in_(chain_keys))
    )
    return {key: status for key, status in found}


def _document_row(document: DocumentRecord, now: float) -> dict[str, Any]:
    row = asdict(document)
    row["warnings"] = json.dumps(list(document.warnings))
    row["metadata"] = json.dumps(dict(document.metadata), sort_keys=True, default=str)
    row["updated_at"] = now
    return row


def _upsert(
    connection: Connection,
    table: Table,
    values: Mapping[str, Any],
    *,
    keys: Sequence[str],
    update: Sequence[str],
) -> None:
    if connection.dialect.name == "postgresql":
        from sqlalchemy.dialects.postgresql import insert
    else:
        from sqlalchemy.dialects.sqlite import insert
    statement = insert(table).values(**values)
    if update:
        statement = statement.on_conflict_do_update(
            index_elements=list(keys), set_={name: statement.excluded[name] for name in update}
        )
    else:
        statement = statement.on_conflict_do_nothing(index_elements=list(keys))
    connection.execute(statement)
