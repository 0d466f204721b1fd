"""Corpus runs in the state store: each run's attempts, the documents and chains an attempt
plans, its errors rows, and which answers of the previous run over the archive it supersedes.

A corpus run over an archive holds the archive's row of `run_locks` on a lease for as long as
it runs (`connectors.state.locks` holds it through `try_lock`, `renew_lock` and
`release_lock`), so two runs over one archive never overlap.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict
from typing import Any

from sqlalchemy import ColumnElement, and_, delete, func, insert, or_, select, union, update
from sqlalchemy.engine import Connection

from connectors.state.chains import pending_chain_row
from connectors.state.database import Database, reconnecting, upsert
from connectors.state.records import (
    DocumentChanges,
    DocumentRecord,
    ErrorRecord,
    LockHolder,
    RunStart,
)
from connectors.state.schema import (
    ABANDONED,
    FINISHED_RUN,
    RUNNING,
    UNFINISHED_RUN,
    chains,
    documents,
    errors,
    run_chains,
    run_locks,
    runs,
)
from operators.core.document import PlannedChain


class RunStore(Database):
    """Corpus runs: their attempts, the run lock over an archive, the documents and chains a
    run plans (the segment stage), and what it supersedes of the previous run."""

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
            upsert(connection, run_locks, row, keys=["lock_key"], update=[])
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
                    of_attempt(previous_run_id, previous_attempt),
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
            upsert(
                connection,
                documents,
                _document_row(document, now),
                keys=["run_id", "source_uri"],
                update=[
                    c.name for c in documents.columns if c.name not in ("run_id", "source_uri")
                ],
            )
            for chain in planned:
                upsert(
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
                upsert(
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
    def previous_document(self, run_id: str, source_uri: str) -> DocumentRecord | None:
        """The document at `source_uri` as the previous finished run over the run's archive
        recorded it in its last attempt; None when there is no such run, or it had no such
        document."""
        previous = runs.alias("previous")
        query = (
            select(documents)
            .select_from(
                runs.join(previous, previous.c.run_id == runs.c.previous_run_id).join(
                    documents,
                    and_(
                        documents.c.run_id == previous.c.run_id,
                        documents.c.attempt == previous.c.attempt,
                    ),
                )
            )
            .where(runs.c.run_id == run_id, documents.c.source_uri == source_uri)
        )
        with self._read() as connection:
            row = connection.execute(query).mappings().first()
        if row is None:
            return None
        return DocumentRecord(
            **{name: row[name] for name in _RECORD_COLUMNS},
            warnings=tuple(json.loads(row["warnings"] or "[]")),
            metadata=json.loads(row["metadata"] or "{}"),
        )

    @reconnecting
    def listed_of(self, run_id: str, attempt: int, source_uris: Sequence[str]) -> set[str]:
        """Those of `source_uris` the run's attempt planned (documents) or failed (errors)."""
        if not source_uris:
            return set()
        query = select(_listed(run_id, attempt).subquery().c.source_uri)
        with self._read() as connection:
            listed = {uri for (uri,) in connection.execute(query)}
        return listed & set(source_uris)

    @reconnecting
    def chain_statuses(self, chain_keys: Sequence[str]) -> dict[str, str]:
        """The status of each chain the store knows."""
        with self._read() as connection:
            return _statuses(connection, chain_keys)

    @reconnecting
    def record_error(self, error: ErrorRecord) -> None:
        row = {**asdict(error), "created_at": time.time()}
        with self._write() as connection:
            upsert(
                connection,
                errors,
                row,
                keys=["run_id", "source_uri", "stage"],
                update=[name for name in row if name not in ("run_id", "source_uri", "stage")],
            )


def of_attempt(run_id: str, attempt: int) -> ColumnElement[bool]:
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


_RECORD_COLUMNS = (
    "run_id", "attempt", "source_uri", "doc_id", "name", "content_sha256", "parser", "pages",
    "n_tokens", "n_segments",
)  # fmt: skip


def _document_row(document: DocumentRecord, now: float) -> dict[str, Any]:
    row = asdict(document)
    row["warnings"] = json.dumps(list(document.warnings))
    row["metadata"] = json.dumps(dict(document.metadata), sort_keys=True, default=str)
    row["updated_at"] = now
    return row
