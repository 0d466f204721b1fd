"""The state store: chain checkpoints, corpus-run membership and the Serve job queue in one SQL
database (SQLite by default, PostgreSQL by URL), through SQLAlchemy Core. Tables: `schema.py`.

Every model call is one `steps` row, written in the same transaction that advances its chain's
checkpoint (`chains.step`, `chains.memory`), so after a crash a chain resumes from its last
written step and its trajectory has no gap and no duplicate (`pipeline.resume` drives that).

A Serve replica runs a job only while it holds the job's lease (`owner`, `lease_expires_at`):
each of its writes is conditional on the lease, and a step and its event are one transaction,
so a replica that lost its lease (cancelled, or presumed dead and replaced) can no longer write
and a resumed job has exactly one event per step. Jobs are claimed with `SELECT ... FOR UPDATE
SKIP LOCKED` on PostgreSQL; on SQLite, where every write transaction begins with `BEGIN
IMMEDIATE`, the claim holds the database's write lock instead.

A corpus run over an archive holds the archive's row of `run_locks` on a lease for as long as
it runs (`connectors.state.locks`), so two runs over one archive never overlap.

The store is picklable: each process opens its own connection pools on first use.
"""

from __future__ import annotations

import functools
import json
import logging
import os
import sqlite3
import time
import uuid
from collections.abc import Callable, Collection, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import asdict
from pathlib import Path
from typing import Any, TypeVar

from alembic import command
from alembic.config import Config
from sqlalchemy import (
    ColumnElement,
    Join,
    Table,
    and_,
    case,
    create_engine,
    delete,
    event,
    func,
    insert,
    or_,
    select,
    text,
    union,
    update,
)
from sqlalchemy.engine import URL, Connection, Engine, RowMapping, make_url
from sqlalchemy.exc import (
    ArgumentError,
    DBAPIError,
    DisconnectionError,
    OperationalError,
    SQLAlchemyError,
)

from connectors.sql import redacted, with_default_driver
from connectors.state.records import (
    ChainState,
    Checkpoint,
    DocumentChanges,
    DocumentRecord,
    ErrorRecord,
    Event,
    JobInput,
    JobState,
    LockHolder,
    NewJob,
    RunProgress,
    RunStart,
    StepCheckpoint,
)
from connectors.state.schema import (
    ABANDONED,
    CANCELLED,
    DONE,
    FAILED,
    FINISHED_JOB,
    FINISHED_RUN,
    PENDING,
    QUEUED,
    RUNNING,
    UNFINISHED_JOB,
    UNFINISHED_RUN,
    chains,
    documents,
    errors,
    events,
    groundings,
    jobs,
    rejected_quotes,
    run_chains,
    run_locks,
    runs,
    steps,
)
from pipeline.core.document import PlannedChain
from pipeline.core.evidence import Grounding

T = TypeVar("T")
logger = logging.getLogger(__name__)
SUPPORTED_DIALECTS = ("sqlite", "postgresql")
# How long a SQLite write waits for another process's write lock; `?timeout=SECONDS` in the URL
# sets it for one store.
SQLITE_BUSY_TIMEOUT_S = 60.0
# How long a PostgreSQL server that refuses connections (restarting, failing over) is waited
# for before a store call fails.
RECONNECT_WAIT_S = 30.0
MIGRATIONS = Path(__file__).with_name("migrations")
# Held while migrating a PostgreSQL database, so replicas starting together migrate one by one.
MIGRATION_LOCK_KEY = 0x6D656D73  # "mems"
# A job chain's status as the API shows it: "ok" once answered, "error" once failed, else "pending".
ANSWER_STATUS = {DONE: "ok", FAILED: "error"}
JOB_CHAIN_COLUMNS = (
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


class StateStoreError(RuntimeError):
    """A state store that cannot be used, in one line: which database, what is wrong.
    `disconnected`: the server dropped the connection under the call (a restart), which rolled
    its transaction back."""

    def __init__(self, message: str, disconnected: bool = False) -> None:
        super().__init__(message)
        self.disconnected = disconnected


def reconnecting(method: Callable[..., T]) -> Callable[..., T]:
    """A store call run again when PostgreSQL dropped its connection under it (a restart, a
    failover): its transaction was rolled back, and every write of the store is an upsert or a
    guarded update, so running it again is safe. The next attempt's connection waits for the
    server (`_connect`), up to RECONNECT_WAIT_S in all."""

    @functools.wraps(method)
    def call(self: StateStore, *args: Any, **kwargs: Any) -> T:
        deadline = time.monotonic() + RECONNECT_WAIT_S
        while True:
            try:
                return method(self, *args, **kwargs)
            except StateStoreError as error:
                if not error.disconnected or time.monotonic() > deadline:
                    raise
                logger.warning("%s; running %s again", error, method.__name__)
                time.sleep(0.25)

    return call


class JobConflict(Exception):
    """The job is not in a state that allows the operation."""

    def __init__(self, status: str) -> None:
        super().__init__(f"the job is already {status}")
        self.status = status


class StateStore:
    def __init__(self, url: str) -> None:
        parsed = parse_store_url(url)
        self.url = parsed.render_as_string(hide_password=False)
        self.safe_url = redacted(parsed)
        self._writer: Engine | None = None
        self._reader: Engine | None = None

    def __repr__(self) -> str:
        return f"StateStore({self.safe_url!r})"

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_writer": None, "_reader": None}

    @property
    def writer(self) -> Engine:
        """Every transaction on it may write; on SQLite it takes the write lock first."""
        if self._writer is None:
            self._writer = open_store_engine(self.url)
        return self._writer

    @property
    def reader(self) -> Engine:
        """For reads only; on SQLite (WAL) it reads beside the writer without any lock."""
        if self._reader is None:
            if make_url(self.url).get_backend_name() == "sqlite":
                self._reader = open_store_engine(self.url, write_lock=False)
            else:
                self._reader = self.writer
        return self._reader

    def close(self) -> None:
        for engine in {id(e): e for e in (self._writer, self._reader) if e is not None}.values():
            engine.dispose()
        self._writer = self._reader = None

    # --- setup ------------------------------------------------------------------------------

    def migrate(self) -> None:
        """Brings the schema to the newest revision: creates it in a new database, upgrades an
        older one in place. Raises StateStoreError when the database is unreachable or refuses
        writes."""
        config = Config()
        config.set_main_option("script_location", str(MIGRATIONS))
        try:
            create_sqlite_file(self.url)
            with self._write() as connection:
                if connection.dialect.name == "postgresql":
                    connection.execute(
                        text("SELECT pg_advisory_xact_lock(:key)"), {"key": MIGRATION_LOCK_KEY}
                    )
                config.attributes["connection"] = connection
                command.upgrade(config, "head")
        except (SQLAlchemyError, OSError) as error:
            raise self._failure(error) from None

    # --- corpus runs: planning (segment stage) and membership -----------------------------

    @reconnecting
    def begin_run(
        self,
        run_id: str | None,
        summary: Mapping[str, Any],
        *,
        job_key: str | None = None,
        archive_key: str | None = None,
    ) -> RunStart:
        """Registers an attempt of a run. With `run_id`: of that run, new or not. Without: of
        job `job_key` over `archive_key`, whose latest run is resumed (its next attempt) when it
        is this job's and unfinished (failed, or killed while running); else a new run
        `<job_key>-<n>` begins, and an unfinished run of another job is abandoned. A new run's
        previous run is the last finished one over the archive. Call it holding the archive's
        lock (`connectors.state.locks`): then no other process runs what it resumes."""
        now = time.time()
        with self._write() as connection:
            over_archive = (
                select(runs.c.run_id, runs.c.status, runs.c.job_key)
                .where(runs.c.archive_key == archive_key)
                .order_by(runs.c.created_at.desc())
            )
            if run_id is None:
                if job_key is None or archive_key is None:
                    raise ValueError("begin_run needs a run_id, or a job_key and an archive_key")
                latest = connection.execute(over_archive.limit(1)).first()
                unfinished = latest is not None and latest.status in UNFINISHED_RUN
                if unfinished and latest.job_key == job_key:
                    run_id = latest.run_id
                else:
                    if unfinished:
                        connection.execute(
                            update(runs)
                            .where(runs.c.run_id == latest.run_id)
                            .values(status=ABANDONED)
                        )
                    run_id = _next_run_id(connection, job_key)
            found = connection.execute(
                select(runs.c.attempt, runs.c.previous_run_id).where(runs.c.run_id == run_id)
            ).first()
            values = {
                "status": RUNNING,
                "summary": json.dumps(summary, sort_keys=True, default=str),
                "started_at": now,
                "finished_at": None,
            }
            if found is not None:
                attempt = found.attempt + 1
                connection.execute(
                    update(runs).where(runs.c.run_id == run_id).values(attempt=attempt, **values)
                )
                return RunStart(run_id, attempt, found.previous_run_id)
            previous = None
            if archive_key is not None:
                previous = connection.execute(
                    over_archive.where(runs.c.status.in_(FINISHED_RUN)).limit(1)
                ).first()
            previous_run_id = None if previous is None else previous.run_id
            connection.execute(
                insert(runs).values(
                    run_id=run_id,
                    attempt=1,
                    created_at=now,
                    job_key=job_key,
                    archive_key=archive_key,
                    previous_run_id=previous_run_id,
                    **values,
                )
            )
        return RunStart(run_id, 1, previous_run_id)

    @reconnecting
    def finish_run(self, run_id: str, status: str) -> None:
        with self._write() as connection:
            connection.execute(
                update(runs)
                .where(runs.c.run_id == run_id)
                .values(status=status, finished_at=time.time())
            )

    @reconnecting
    def try_lock(
        self, key: str, holder: LockHolder, is_gone: Callable[[LockHolder], bool]
    ) -> LockHolder | None:
        """Takes lock `key` for `holder` when it is free, its lease has run out by
        `holder.acquired_at`, or `is_gone` says its holder no longer lives; returns None then,
        else who holds it."""
        row = {"lock_key": key, **asdict(holder)}
        with self._write() as connection:
            _upsert(connection, run_locks, row, keys=["lock_key"], update=[])
            current = (
                connection.execute(
                    select(run_locks).where(run_locks.c.lock_key == key).with_for_update()
                )
                .mappings()
                .one()
            )
            held = LockHolder(**{name: current[name] for name in asdict(holder)})
            if held.owner == holder.owner:
                return None
            if held.expires_at > holder.acquired_at and not is_gone(held):
                return held
            connection.execute(
                update(run_locks)
                .where(and_(run_locks.c.lock_key == key, run_locks.c.owner == held.owner))
                .values(asdict(holder))
            )
        return None

    @reconnecting
    def renew_lock(self, key: str, owner: str, expires_at: float) -> bool:
        """Extends the lease of a lock `owner` holds; False when it no longer holds it."""
        with self._write() as connection:
            renewed = connection.execute(
                update(run_locks)
                .where(and_(run_locks.c.lock_key == key, run_locks.c.owner == owner))
                .values(expires_at=expires_at)
            ).rowcount
        return renewed == 1

    @reconnecting
    def release_lock(self, key: str, owner: str) -> None:
        with self._write() as connection:
            connection.execute(
                delete(run_locks).where(
                    and_(run_locks.c.lock_key == key, run_locks.c.owner == owner)
                )
            )

    @reconnecting
    def supersede_previous(self, run_id: str, attempt: int) -> DocumentChanges:
        """Compares the run's attempt with the previous finished run over its archive: marks
        that run's answers rows this one replaced (`superseded_by`: the same document and
        question with another chain, or a document no longer listed) and counts the documents
        new, changed, unchanged and removed. Idempotent: a rerun of the attempt marks anew."""
        with self._write() as connection:
            previous_run_id = connection.execute(
                select(runs.c.previous_run_id).where(runs.c.run_id == run_id)
            ).scalar()
            if previous_run_id is None:
                return DocumentChanges(new=_count_documents(connection, run_id, attempt))
            previous_attempt = connection.execute(
                select(runs.c.attempt).where(runs.c.run_id == previous_run_id)
            ).scalar_one()
            listed = _listed(run_id, attempt)
            now = run_chains.alias("now")
            answered_anew = (
                select(now.c.chain_key)
                .where(
                    now.c.run_id == run_id,
                    now.c.attempt == attempt,
                    now.c.source_uri == run_chains.c.source_uri,
                    now.c.question_id == run_chains.c.question_id,
                    now.c.chain_key != run_chains.c.chain_key,
                )
                .exists()
            )
            connection.execute(
                update(run_chains)
                .where(run_chains.c.superseded_by == run_id)
                .values(superseded_by=None)
            )
            connection.execute(
                update(run_chains)
                .where(
                    _of_attempt(previous_run_id, previous_attempt),
                    or_(answered_anew, run_chains.c.source_uri.not_in(listed)),
                )
                .values(superseded_by=run_id)
            )
            current, before = documents.alias("current"), documents.alias("before")
            new, changed, unchanged = connection.execute(
                select(
                    func.count().filter(before.c.source_uri.is_(None)),
                    func.count().filter(before.c.content_sha256 != current.c.content_sha256),
                    func.count().filter(before.c.content_sha256 == current.c.content_sha256),
                )
                .select_from(
                    current.outerjoin(
                        before,
                        and_(
                            before.c.run_id == previous_run_id,
                            before.c.attempt == previous_attempt,
                            before.c.source_uri == current.c.source_uri,
                        ),
                    )
                )
                .where(current.c.run_id == run_id, current.c.attempt == attempt)
            ).one()
            removed = connection.execute(
                select(func.count())
                .select_from(before)
                .where(
                    before.c.run_id == previous_run_id,
                    before.c.attempt == previous_attempt,
                    before.c.source_uri.not_in(listed),
                )
            ).scalar_one()
        return DocumentChanges(previous_run_id, new, changed, unchanged, removed)

    @reconnecting
    def plan_document(
        self,
        document: DocumentRecord,
        planned: Sequence[PlannedChain],
    ) -> dict[str, str]:
        """Records the document and its chains for the run; chains seen before keep their
        progress. Returns each chain's status."""
        now = time.time()
        with self._write() as connection:
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

    @reconnecting
    def document_with_content(
        self, run_id: str, attempt: int, content_sha256: str, source_uri: str
    ) -> str | None:
        """The first other document planned in this attempt of the run with the same content
        (by URI order among them), else None. Read before the document is planned: of two
        copies planned at once, at most one finds the other, so one of them always runs."""
        query = (
            select(documents.c.source_uri)
            .where(
                and_(
                    documents.c.run_id == run_id,
                    documents.c.attempt == attempt,
                    documents.c.content_sha256 == content_sha256,
                    documents.c.source_uri != source_uri,
                )
            )
            .order_by(documents.c.source_uri)
            .limit(1)
        )
        with self._read() as connection:
            return connection.execute(query).scalar()

    @reconnecting
    def chain_statuses(self, chain_keys: Sequence[str]) -> dict[str, str]:
        """The status of each chain the store knows."""
        with self._read() as connection:
            return _statuses(connection, chain_keys)

    @reconnecting
    def record_error(self, error: ErrorRecord) -> None:
        row = {**asdict(error), "created_at": time.time()}
        with self._write() as connection:
            _upsert(
                connection,
                errors,
                row,
                keys=["run_id", "source_uri", "stage"],
                update=[name for name in row if name not in ("run_id", "source_uri", "stage")],
            )

    # --- chains: what `pipeline.resume` reads and writes ------------------------------------

    @reconnecting
    def load_checkpoint(self, chain_key: str) -> Checkpoint | None:
        query = (
            select(
                chains.c.status,
                chains.c.step,
                chains.c.memory,
                chains.c.answer,
                groundings.c.chain_key.is_not(None).label("has_evidence"),
            )
            .select_from(chains.outerjoin(groundings, groundings.c.chain_key == chains.c.chain_key))
            .where(chains.c.chain_key == chain_key)
        )
        with self._read() as connection:
            row = connection.execute(query).first()
        if row is None:
            return None
        return Checkpoint(row.status, row.step, row.memory, row.answer, bool(row.has_evidence))

    @reconnecting
    def mark_running(self, chain_key: str) -> bool:
        now = time.time()
        with self._write() as connection:
            connection.execute(
                update(chains)
                .where(chains.c.chain_key == chain_key)
                .values(
                    status=RUNNING,
                    error=None,
                    updated_at=now,
                    started_at=func.coalesce(chains.c.started_at, now),
                )
            )
        return True

    @reconnecting
    def record_step(self, checkpoint: StepCheckpoint) -> bool:
        """Writes one step and advances its chain, atomically."""
        with self._write() as connection:
            write_step(connection, checkpoint)
        return True

    @reconnecting
    def mark_failed(self, chain_key: str, error: str) -> bool:
        with self._write() as connection:
            write_failure(connection, chain_key, error)
        return True

    @reconnecting
    def record_grounding(self, chain_key: str, grounding: Grounding) -> bool:
        with self._write() as connection:
            write_grounding(connection, chain_key, grounding)
        return True

    # --- reading a run back (export) ------------------------------------------------------

    def answers(
        self, run_id: str, attempt: int, chain_keys: Collection[str] | None = None
    ) -> Iterator[dict[str, Any]]:
        """One row per (document, question) of the run's attempt; of the given chains only,
        when `chain_keys` is given."""
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
                chains.c.answered_in_run,
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
        if chain_keys is not None:
            query = query.where(run_chains.c.chain_key.in_(list(chain_keys)))
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
                steps.c.reread_spans,
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

    def superseded(self, run_id: str, attempt: int) -> Iterator[dict[str, Any]]:
        """The earlier run's answers rows that the run's attempt superseded, with why: the
        document `changed` or was `removed`, or was `answered anew` with the same content."""
        before, current = documents.alias("before"), documents.alias("current")
        query = (
            select(
                run_chains.c.run_id,
                chains.c.answered_in_run,
                run_chains.c.superseded_by,
                case(
                    (current.c.source_uri.is_(None), "removed"),
                    (current.c.content_sha256 != before.c.content_sha256, "changed"),
                    else_="answered anew",
                ).label("change"),
                before.c.doc_id,
                before.c.name,
                run_chains.c.source_uri,
                run_chains.c.question_id,
                run_chains.c.question,
                chains.c.status,
                chains.c.answer,
                before.c.content_sha256,
                run_chains.c.chain_key,
            )
            .select_from(
                _joined(chains)
                .join(
                    before,
                    and_(
                        before.c.run_id == run_chains.c.run_id,
                        before.c.source_uri == run_chains.c.source_uri,
                    ),
                )
                .outerjoin(
                    current,
                    and_(
                        current.c.run_id == run_id,
                        current.c.attempt == attempt,
                        current.c.source_uri == run_chains.c.source_uri,
                    ),
                )
            )
            .where(run_chains.c.superseded_by == run_id)
            .order_by(run_chains.c.source_uri, run_chains.c.question_id)
        )
        return self._stream(query)

    @reconnecting
    def chain_status_counts(self, run_id: str, attempt: int) -> dict[str, int]:
        query = (
            select(chains.c.status, func.count())
            .select_from(_joined(chains))
            .where(_of_attempt(run_id, attempt))
            .group_by(chains.c.status)
        )
        with self._read() as connection:
            return {status: count for status, count in connection.execute(query)}

    @reconnecting
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
        with self._read() as connection:
            return RunProgress(*connection.execute(query).one())

    @reconnecting
    def document_counts(self, run_id: str, attempt: int) -> tuple[int, int]:
        """(documents with answers rows, documents with error rows) of the run's attempt."""
        answered = select(func.count(func.distinct(run_chains.c.source_uri))).where(
            _of_attempt(run_id, attempt)
        )
        failed = select(func.count(func.distinct(errors.c.source_uri))).where(
            and_(errors.c.run_id == run_id, errors.c.attempt == attempt)
        )
        with self._read() as connection:
            return connection.execute(answered).scalar_one(), connection.execute(
                failed
            ).scalar_one()

    @reconnecting
    def busy_window(self, run_id: str, attempt: int, since: float) -> float:
        """Seconds from the start of the first model call to the end of the last one among
        the steps the run's attempt wrote after `since` (0 when it wrote none)."""
        query = (
            select(func.min(steps.c.created_at - steps.c.latency_s), func.max(steps.c.created_at))
            .select_from(_joined(steps))
            .where(_of_attempt(run_id, attempt), steps.c.created_at >= since)
        )
        with self._read() as connection:
            first, last = connection.execute(query).one()
        return 0.0 if first is None else last - first

    # --- Serve jobs: what clients do ---------------------------------------------------------

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

    @reconnecting
    def get_job(self, job_id: str) -> JobState | None:
        return self._load_job(job_id, _job_state)

    @reconnecting
    def cancel_job(self, job_id: str) -> bool:
        """Cancels an unfinished job: False when there is no such job, JobConflict when it has
        already finished."""
        with self._write() as connection:
            status = connection.execute(
                select(jobs.c.status).where(jobs.c.job_id == job_id)
            ).scalar()
            if status is None:
                return False
            if status in FINISHED_JOB:
                raise JobConflict(status)
            _end_job(connection, jobs.c.job_id == job_id, CANCELLED, "cancelled by the client")
            _add_end_event(connection, job_id, CANCELLED, None)
        return True

    @reconnecting
    def events_after(self, job_id: str, after: int, limit: int = 500) -> list[Event]:
        with self._read() as connection:
            rows = connection.execute(
                select(events.c.event_id, events.c.kind, events.c.data)
                .where(and_(events.c.job_id == job_id, events.c.event_id > after))
                .order_by(events.c.event_id)
                .limit(limit)
            ).all()
        return [Event(event_id, kind, json.loads(data)) for event_id, kind, data in rows]

    @reconnecting
    def count_jobs_by_status(self) -> dict[str, int]:
        with self._read() as connection:
            rows = connection.execute(
                select(jobs.c.status, func.count()).group_by(jobs.c.status)
            ).all()
        return {status: count for status, count in rows}

    # --- Serve jobs: what replicas do (each write needs the job's lease) ---------------------

    @reconnecting
    def claim_jobs(self, owner: str, lease_s: float, limit: int) -> list[str]:
        """Takes up to `limit` jobs that are queued or whose runner's lease ran out, oldest
        first, and leases them to `owner`. Replicas claiming at once get different jobs: rows
        another replica is claiming are skipped (PostgreSQL), or claims take turns (SQLite)."""
        if limit < 1:
            return []
        now = time.time()
        claimable = and_(
            jobs.c.status.in_(UNFINISHED_JOB),
            or_(jobs.c.owner.is_(None), jobs.c.lease_expires_at < now),
        )
        with self._write() as connection:
            job_ids = list(
                connection.execute(
                    select(jobs.c.job_id)
                    .where(claimable)
                    .order_by(jobs.c.created_at)
                    .limit(limit)
                    .with_for_update(skip_locked=True)
                ).scalars()
            )
            if job_ids:
                connection.execute(
                    update(jobs)
                    .where(jobs.c.job_id.in_(job_ids))
                    .values(
                        status=RUNNING,
                        owner=owner,
                        lease_expires_at=now + lease_s,
                        started_at=func.coalesce(jobs.c.started_at, now),
                        updated_at=now,
                    )
                )
        return job_ids

    @reconnecting
    def renew_leases(self, owner: str, job_ids: Sequence[str], lease_s: float) -> set[str]:
        """Extends the leases `owner` still holds; returns the jobs it still holds."""
        if not job_ids:
            return set()
        now = time.time()
        held = self._held_by(owner, job_ids)
        with self._write() as connection:
            connection.execute(update(jobs).where(held).values(lease_expires_at=now + lease_s))
            return set(connection.execute(select(jobs.c.job_id).where(held)).scalars())

    @reconnecting
    def release_jobs(self, owner: str, job_ids: Sequence[str]) -> None:
        """Gives jobs back unfinished (the replica is shutting down) for any replica to resume."""
        if not job_ids:
            return
        with self._write() as connection:
            connection.execute(
                update(jobs)
                .where(self._held_by(owner, job_ids))
                .values(owner=None, lease_expires_at=None, updated_at=time.time())
            )

    @reconnecting
    def load_job_input(self, job_id: str) -> JobInput | None:
        return self._load_job(job_id, _job_input)

    @reconnecting
    def save_job_document(
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
                        PlannedChain(job_chain_key(job_id, index), f"q{index}", question),
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

    @reconnecting
    def record_job_step(
        self, job_id: str, owner: str, chain_index: int, step: StepCheckpoint
    ) -> bool:
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

    @reconnecting
    def fail_job_chain(self, job_id: str, owner: str, chain_index: int, error: str) -> bool:
        with self._write() as connection:
            if not self._still_held(connection, owner, job_id):
                return False
            write_failure(connection, job_chain_key(job_id, chain_index), error)
        return True

    @reconnecting
    def job_trajectory(self, job: JobState) -> list[dict[str, Any]]:
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

    @reconnecting
    def record_job_grounding(
        self, job_id: str, owner: str, chain_index: int, grounding: Grounding
    ) -> bool:
        """Records where chain `chain_index`'s answer is found in the job's document."""
        with self._write() as connection:
            if not self._still_held(connection, owner, job_id):
                return False
            write_grounding(connection, job_chain_key(job_id, chain_index), grounding)
        return True

    @reconnecting
    def finish_job(self, job_id: str, owner: str, status: str, error: str | None = None) -> bool:
        """Ends a job the owner holds as succeeded or failed, with its `end` event."""
        with self._write() as connection:
            if not _end_job(connection, self._held_by(owner, [job_id]), status, error):
                return False
            _add_end_event(connection, job_id, status, error)
        return True

    # --- plumbing ---------------------------------------------------------------------------

    def _load_job(
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

    @reconnecting
    def holds_lease(self, owner: str, job_id: str) -> bool:
        with self._read() as connection:
            return self._still_held(connection, owner, job_id)

    def _still_held(self, connection: Connection, owner: str, job_id: str) -> bool:
        holder = connection.execute(
            select(jobs.c.job_id).where(self._held_by(owner, [job_id]))
        ).first()
        return holder is not None

    @contextmanager
    def _write(self) -> Iterator[Connection]:
        try:
            with self._connect(self.writer) as connection, connection.begin():
                yield connection
        except SQLAlchemyError as error:
            raise self._failure(error) from None

    @contextmanager
    def _read(self) -> Iterator[Connection]:
        try:
            with self._connect(self.reader) as connection:
                yield connection
        except SQLAlchemyError as error:
            raise self._failure(error) from None

    def _connect(self, engine: Engine) -> Connection:
        """A connection from the pool. A PostgreSQL server that refuses connections (a restart)
        is waited for, up to RECONNECT_WAIT_S; the pool's pre-ping replaces the connections the
        restart closed. A transaction the restart cut fails (the caller's error)."""
        waited, delay = 0.0, 0.25
        while True:
            try:
                return engine.connect()
            except OperationalError as error:
                if (
                    engine.dialect.name != "postgresql"
                    or refused_login(error)
                    or waited + delay > RECONNECT_WAIT_S
                ):
                    raise
                logger.warning(
                    "state store %s unreachable, retrying in %.2f s: %s",
                    self.safe_url, delay, first_line(error),
                )  # fmt: skip
                time.sleep(delay)
                waited, delay = waited + delay, min(2 * delay, 4.0)

    def _failure(self, error: BaseException) -> StateStoreError:
        """The error as one line that says what happened to the database."""
        reason = first_line(error)
        path = sqlite_path(self.url)
        if path is not None and not path.exists():
            reason = (
                f"the database file {path} is gone: it was removed while in use, and the "
                f"progress it held with it ({reason})"
            )
        elif path is not None and "database is locked" in reason:
            reason = (
                f"database is locked: another process held its write lock over the busy "
                f"timeout of {sqlite_busy_timeout_s(self.url):g} s (?timeout=SECONDS in the "
                "URL waits longer); what was written is kept, run the job again to resume"
            )
        disconnected = isinstance(error, DBAPIError) and error.connection_invalidated
        return StateStoreError(f"state store {self.safe_url}: {reason}", disconnected)

    def _stream(self, query: Any, batch_size: int = 1000) -> Iterator[dict[str, Any]]:
        with self._read() as connection:
            result = connection.execution_options(yield_per=batch_size).execute(query)
            for row in result:
                yield dict(row._mapping)


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


def sqlite_path(url: str | URL) -> Path | None:
    """The file of a SQLite store; None for PostgreSQL and in-memory SQLite."""
    parsed = make_url(url)
    if parsed.get_backend_name() != "sqlite" or parsed.database in (None, "", ":memory:"):
        return None
    return Path(parsed.database).expanduser()


def sqlite_busy_timeout_s(url: str | URL) -> float:
    timeout = make_url(url).query.get("timeout")
    return float(timeout) if isinstance(timeout, str) else SQLITE_BUSY_TIMEOUT_S


def create_sqlite_file(url: str | URL) -> None:
    """Creates a SQLite store's file (and folder) if missing: only migrating does; the store's
    connections open the file as it is, so a file removed while in use is found gone rather
    than silently made anew, empty."""
    path = sqlite_path(url)
    if path is not None and not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        sqlite3.connect(path).close()


def open_store_engine(url: str | URL, *, write_lock: bool = True) -> Engine:
    """An engine on a store database. Several processes write one SQLite file: WAL lets readers
    run beside the writer, and with `write_lock` every transaction begins with BEGIN IMMEDIATE,
    taking the write lock up front, so it waits for it (busy timeout) instead of failing when
    another writer committed after it started reading. A SQLite connection is only handed out
    while its file is still the one at the store's path: one opened on a file since removed
    would write on into the deleted file."""
    parsed = make_url(url)
    if parsed.get_backend_name() != "sqlite":
        return create_engine(parsed, pool_size=4, max_overflow=8, pool_pre_ping=True)
    path = sqlite_path(parsed)
    busy_timeout_s = sqlite_busy_timeout_s(parsed)
    if path is None:
        engine = create_engine(parsed)
    else:

        def open_file() -> sqlite3.Connection:
            return sqlite3.connect(
                f"{path.absolute().as_uri()}?mode=rw",
                uri=True,
                timeout=busy_timeout_s,
                check_same_thread=False,
            )

        engine = create_engine(parsed.difference_update_query(["timeout"]), creator=open_file)

    @event.listens_for(engine, "connect")
    def configure(dbapi_connection: Any, record: Any) -> None:
        dbapi_connection.isolation_level = None  # SQLAlchemy's events begin transactions
        cursor = dbapi_connection.cursor()
        cursor.execute("PRAGMA journal_mode=WAL")
        cursor.execute(f"PRAGMA busy_timeout={int(busy_timeout_s * 1000)}")
        cursor.execute("PRAGMA synchronous=NORMAL")
        cursor.close()
        if path is not None:
            record.info["file"] = _file_identity(path)

    @event.listens_for(engine, "checkout")
    def still_the_same_file(_dbapi_connection: Any, record: Any, _proxy: Any) -> None:
        if path is not None and _file_identity(path) != record.info.get("file"):
            raise DisconnectionError(f"{path} was removed or replaced")  # the pool reconnects

    if write_lock:

        @event.listens_for(engine, "begin")
        def begin_immediate(connection: Connection) -> None:
            connection.exec_driver_sql("BEGIN IMMEDIATE")

    return engine


def _file_identity(path: Path) -> tuple[int, int] | None:
    try:
        found = os.stat(path)
    except FileNotFoundError:
        return None
    return found.st_dev, found.st_ino


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
    reread = step_row.pop("reread_spans")
    step_row["reread_spans"] = json.dumps([list(span) for span in reread]) if reread else None
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
            "answered_in_run": chains.c.run_id,
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


def write_grounding(connection: Connection, chain_key: str, grounding: Grounding) -> None:
    """Records where a chain's answer was found in the source, inside the caller's transaction."""
    row = {
        "chain_key": chain_key,
        "grounded": grounding.grounded,
        "reason": grounding.reason,
        "evidence": json.dumps([item.as_dict() for item in grounding.evidence], ensure_ascii=False),
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


def trajectory_row(row: Mapping[str, Any]) -> dict[str, Any]:
    """A `steps` row joined with its rejected quotes, as a trajectory table has it."""
    return {
        **row,
        "rejected_quotes": json.loads(row["rejected_quotes"] or "[]"),
        "reread_spans": json.loads(row.get("reread_spans") or "[]"),
    }


def refused_login(error: OperationalError) -> bool:
    """A wrong password or an unknown role or database: waiting for the server will not help."""
    reason = error.orig
    sqlstate = getattr(reason, "sqlstate", None)
    return sqlstate in {"28000", "28P01", "3D000"} or any(
        words in str(reason) for words in ("authentication failed", "does not exist")
    )


def first_line(error: BaseException) -> str:
    """The first line of a database error, without SQLAlchemy's statement and background."""
    reason = str(getattr(error, "orig", None) or error).strip()
    return reason.splitlines()[0] if reason else type(error).__name__


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


def job_chain_key(job_id: str, chain_index: int) -> str:
    """The key of a job's chain in the `chains` table, and the chain's id."""
    return f"{job_id}#q{chain_index}"


def _chain_states(connection: Connection, job_id: str, n_questions: int) -> tuple[ChainState, ...]:
    """The job's chains in question order; none before its document is read."""
    keys = [job_chain_key(job_id, index) for index in range(n_questions)]
    rows = connection.execute(
        select(
            *(chains.c[name] for name in (*JOB_CHAIN_COLUMNS, "status")),
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
            **{name: by_key[key][name] for name in JOB_CHAIN_COLUMNS},
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


# --- plumbing ---


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


def _listed(run_id: str, attempt: int) -> Any:
    """The source URIs the run's attempt listed: answered or in errors."""
    return union(
        select(documents.c.source_uri).where(
            documents.c.run_id == run_id, documents.c.attempt == attempt
        ),
        select(errors.c.source_uri).where(errors.c.run_id == run_id, errors.c.attempt == attempt),
    )


def _count_documents(connection: Connection, run_id: str, attempt: int) -> int:
    return connection.execute(
        select(func.count())
        .select_from(documents)
        .where(documents.c.run_id == run_id, documents.c.attempt == attempt)
    ).scalar_one()


def _next_run_id(connection: Connection, job_key: str) -> str:
    """`<job_key>-<n>`, n one more than the job's runs so far (and unused)."""
    number = connection.execute(
        select(func.count()).select_from(runs).where(runs.c.job_key == job_key)
    ).scalar_one()
    while True:
        number += 1
        run_id = f"{job_key}-{number}"
        if connection.execute(select(runs.c.run_id).where(runs.c.run_id == run_id)).first() is None:
            return run_id


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
