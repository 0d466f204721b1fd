"""Chains in the state store: the checkpoint protocol that `pipeline.resume` drives, and the
writes it is made of, which the Serve job queue makes inside its own transactions.

Every model call is one `steps` row, written in the same transaction that advances its chain's
checkpoint (`chains.step`, `chains.memory`), so after a crash a chain resumes from its last
written step and its trajectory has no gap and no duplicate.
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict
from typing import Any

from sqlalchemy import and_, func, select, update
from sqlalchemy.engine import Connection

from connectors.state.database import Database, reconnecting, upsert
from connectors.state.records import Checkpoint, StepCheckpoint
from connectors.state.schema import chains, groundings, rejected_quotes, steps
from operators.core.chain import ChainStatus
from operators.core.document import PlannedChain
from operators.core.evidence import Grounding


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
