"""Reading a run back from the state store: the rows of its answers, trajectory, errors and
superseded tables, streamed in batches, and its progress and counts."""

from __future__ import annotations

import json
from collections.abc import Collection, Iterator, Mapping, Sequence
from dataclasses import replace
from typing import Any

from sqlalchemy import Join, Table, and_, case, func, select

from connectors.state.database import Database, reconnecting
from connectors.state.records import RunProgress
from connectors.state.runs import of_attempt
from connectors.state.schema import (
    chains,
    documents,
    errors,
    groundings,
    rejected_quotes,
    run_chains,
    steps,
)
from operators.core.chain import ChainStatus
from operators.core.collection import COLLECTION_PARSER, members_read


class ExportStore(Database):
    """Reading a run's attempt back: its tables, its progress and its counts."""

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
            .where(of_attempt(run_id, attempt))
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
            .where(of_attempt(run_id, attempt))
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
            .where(of_attempt(run_id, attempt))
            .group_by(chains.c.status)
        )
        with self._read() as connection:
            return {status: count for status, count in connection.execute(query)}

    @reconnecting
    def progress(self, run_id: str, attempt: int) -> RunProgress:
        """Model calls done and planned, chains answered and planned, and the collections'
        members read and planned, of the chains the run's attempt has planned so far."""
        query = (
            select(
                func.coalesce(func.sum(chains.c.step), 0),
                func.coalesce(func.sum(chains.c.n_segments + 1), 0),
                func.count().filter(chains.c.status == ChainStatus.DONE.value),
                func.count(),
            )
            .select_from(_joined(chains))
            .where(of_attempt(run_id, attempt))
        )
        collections = (
            select(
                chains.c.step,
                chains.c.status,
                documents.c.content_sha256,
                documents.c.metadata,
            )
            .select_from(_with_documents(chains))
            .where(of_attempt(run_id, attempt), documents.c.parser == COLLECTION_PARSER)
        )
        with self._read() as connection:
            progress = RunProgress(*connection.execute(query).one())
            members = list(connection.execute(collections))
        return _with_members(progress, members) if members else progress

    @reconnecting
    def document_counts(self, run_id: str, attempt: int) -> tuple[int, int]:
        """(documents with answers rows, documents with error rows) of the run's attempt."""
        answered = select(func.count(func.distinct(run_chains.c.source_uri))).where(
            of_attempt(run_id, attempt)
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
            .where(of_attempt(run_id, attempt), steps.c.created_at >= since)
        )
        with self._read() as connection:
            first, last = connection.execute(query).one()
        return 0.0 if first is None else last - first


def _with_members(progress: RunProgress, rows: Sequence[Any]) -> RunProgress:
    """`progress` with the collections' members read and planned, from each collection chain's
    (step, status, content sha256, metadata): a DONE chain has read every member; another has
    read those whose segments its steps have all read (`member_segments`, in the metadata of
    a collection whose segments were cut; a duplicate collection, whose chains are its
    original's, takes them from a collection of the same content)."""
    parsed = [
        (step, status, content, json.loads(text or "{}")) for step, status, content, text in rows
    ]
    cut = {
        content: meta["member_segments"]
        for _, _, content, meta in parsed
        if "member_segments" in meta
    }
    done = planned = 0
    for step, status, content, meta in parsed:
        count = len(meta.get("members") or ())
        planned += count
        if status == ChainStatus.DONE.value:
            done += count
        elif content in cut:
            done += min(count, members_read(cut[content], step))
    return replace(progress, members_done=done, members_planned=planned)


def trajectory_row(row: Mapping[str, Any]) -> dict[str, Any]:
    """A `steps` row joined with its rejected quotes, as a trajectory table has it."""
    return {
        **row,
        "rejected_quotes": json.loads(row["rejected_quotes"] or "[]"),
        "reread_spans": json.loads(row.get("reread_spans") or "[]"),
    }


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
