"""Chains in the state store: the checkpoint protocol that `pipeline.resume` drives, and the
writes it is made of, which the Serve job queue makes inside its own transactions.

Every model call is one `steps` row, written in the same transaction that advances its chain's
checkpoint (`chains.step`, `chains.memory`), so after a crash a chain resumes from its last
written step and its trajectory has no gap and no duplicate. A chain may also start where
another stood after the same first segments (`continue_chain`: a grown collection goes on from
its previous chain's memory), with that chain's `steps` rows over them copied as they are.
"""

from __future__ import annotations

import json
import time
from collections.abc import Sequence
from dataclasses import asdict
from typing import Any

from sqlalchemy import and_, func, insert, select, update
from sqlalchemy.engine import Connection

from connectors.state.database import Database, reconnecting, upsert
from connectors.state.records import Checkpoint, StepCheckpoint
from connectors.state.schema import chains, groundings, rejected_quotes, steps
from operators.core.chain import ChainStatus, StepKind
from operators.core.document import PlannedChain
from operators.core.evidence import Grounding
from operators.core.segmentation import Segment


class ChainStore(Database):
    """The checkpoint protocol `pipeline.resume` drives (`ChainCheckpoints`)."""

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
        return Checkpoint(
            ChainStatus(row.status), row.step, row.memory, row.answer, bool(row.has_evidence)
        )

    @reconnecting
    def mark_running(self, chain_key: str) -> bool:
        now = time.time()
        with self._write() as connection:
            connection.execute(
                update(chains)
                .where(chains.c.chain_key == chain_key)
                .values(
                    status=ChainStatus.RUNNING.value,
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

    @reconnecting
    def continue_chain(self, chain_key: str, from_key: str, segments: Sequence[Segment]) -> bool:
        """Starts chain `chain_key`, which has run no step, where chain `from_key` stood after
        reading `segments`, the first segments of both: `from_key`'s steps over them are copied
        as they are (with their rejected quotes and times), and the chain's checkpoint is the
        memory after the last of them, so `pipeline.resume` goes on from there as after a
        crash. Only when `from_key`'s first steps read exactly these segments (the same index
        and offsets, step by step). Returns whether the chain was continued."""
        n_steps = len(segments)
        if n_steps == 0:
            return False
        with self._write() as connection:
            found = connection.execute(
                select(chains.c.status, chains.c.step)
                .where(chains.c.chain_key == chain_key)
                .with_for_update()
            ).first()
            if found is None or found.step != 0 or found.status == ChainStatus.DONE.value:
                return False
            rows = (
                connection.execute(
                    select(steps)
                    .where(steps.c.chain_key == from_key, steps.c.step < n_steps)
                    .order_by(steps.c.step)
                )
                .mappings()
                .all()
            )
            read = [
                (row["step"], row["kind"], row["segment_index"], row["token_start"],
                 row["token_end"], row["char_start"], row["char_end"])
                for row in rows
            ]  # fmt: skip
            expected = [
                (step, StepKind.UPDATE.value, piece.index, piece.token_start, piece.token_end,
                 piece.char_start, piece.char_end)
                for step, piece in enumerate(segments)
            ]  # fmt: skip
            if read != expected:
                return False
            connection.execute(insert(steps), [{**row, "chain_key": chain_key} for row in rows])
            quotes = connection.execute(
                select(rejected_quotes).where(
                    rejected_quotes.c.chain_key == from_key, rejected_quotes.c.step < n_steps
                )
            ).mappings()
            copied = [{**row, "chain_key": chain_key} for row in quotes]
            if copied:
                connection.execute(insert(rejected_quotes), copied)
            connection.execute(
                update(chains)
                .where(chains.c.chain_key == chain_key)
                .values(
                    step=n_steps,
                    memory=rows[-1]["memory_after"],
                    prompt_tokens=sum(row["prompt_tokens"] for row in rows),
                    completion_tokens=sum(row["completion_tokens"] for row in rows),
                    compute_s=sum(row["latency_s"] for row in rows),
                    updated_at=time.time(),
                )
            )
        return True

    @reconnecting
    def carried_steps(self, chain_key: str, from_key: str) -> int:
        """How many of chain `chain_key`'s steps are copies of chain `from_key`'s
        (`continue_chain`): the same step with the same memory, written at the same time."""
        mine, theirs = steps.alias("mine"), steps.alias("theirs")
        query = (
            select(func.count())
            .select_from(
                mine.join(
                    theirs,
                    and_(
                        theirs.c.chain_key == from_key,
                        theirs.c.step == mine.c.step,
                        theirs.c.created_at == mine.c.created_at,
                        theirs.c.memory_after == mine.c.memory_after,
                    ),
                )
            )
            .where(mine.c.chain_key == chain_key)
        )
        with self._read() as connection:
            return connection.execute(query).scalar_one()


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
        "status": ChainStatus.PENDING.value,
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
        "status": (ChainStatus.DONE if checkpoint.done else ChainStatus.RUNNING).value,
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
    upsert(
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
        upsert(connection, rejected_quotes, row, keys=["chain_key", "step"], update=["quotes"])


def write_grounding(connection: Connection, chain_key: str, grounding: Grounding) -> None:
    """Records where a chain's answer was found in the source, inside the caller's transaction."""
    row = {
        "chain_key": chain_key,
        "grounded": grounding.grounded,
        "reason": grounding.reason,
        "evidence": json.dumps([item.as_dict() for item in grounding.evidence], ensure_ascii=False),
        "created_at": time.time(),
    }
    upsert(connection, groundings, row, keys=["chain_key"],
            update=["grounded", "reason", "evidence", "created_at"])  # fmt: skip


def write_failure(connection: Connection, chain_key: str, error: str) -> None:
    """Marks an unanswered chain failed, inside the caller's transaction."""
    now = time.time()
    connection.execute(
        update(chains)
        .where(and_(chains.c.chain_key == chain_key, chains.c.status != ChainStatus.DONE.value))
        .values(status=ChainStatus.FAILED.value, error=error, updated_at=now, finished_at=now)
    )
