"""The Serve job queue in the state store: what clients do (create, read, cancel, follow a job's
events) and what replicas do (claim jobs, run their chains, finish them).

A Serve replica runs a job only while it holds the job's lease (`owner`, `lease_expires_at`):
each of its writes is conditional on the lease, and a step and its event are one transaction,
so a replica that lost its lease (cancelled, or presumed dead and replaced) can no longer write
and a resumed job has exactly one event per step. Jobs are claimed with `SELECT ... FOR UPDATE
SKIP LOCKED` on PostgreSQL; on SQLite, where every write transaction begins with `BEGIN
IMMEDIATE`, the claim holds the database's write lock instead.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

from sqlalchemy import ColumnElement, and_, func, insert, or_, select, update
from sqlalchemy.engine import Connection, RowMapping

from connectors.state.chains import pending_chain_row, write_failure, write_grounding, write_step
from connectors.state.database import Database, reconnecting
from connectors.state.export import trajectory_row, with_rejected_quotes
from connectors.state.records import ChainState, Event, JobInput, JobState, NewJob, StepCheckpoint
from connectors.state.schema import (
    CANCELLED,
    FINISHED_JOB,
    QUEUED,
    RUNNING,
    UNFINISHED_JOB,
    chains,
    events,
    groundings,
    jobs,
    rejected_quotes,
    steps,
)
from operators.core.chain import ChainStatus
from operators.core.document import PlannedChain
from operators.core.evidence import Grounding

T = TypeVar("T")
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


class JobConflict(Exception):
    """The job is not in a state that allows the operation."""

    def __init__(self, status: str) -> None:
        super().__init__(f"the job is already {status}")
        self.status = status


class JobStore(Database):
    """The Serve job queue: jobs, their events, and their chains, which replicas run under a
    lease."""

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
            status=ChainStatus(by_key[key]["status"]),
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
        {"question": s.question, "status": s.status.answer_status, "answer": s.answer}
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
