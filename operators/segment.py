"""Segment + plan: documents in, plans out (the segments and the chains to run over them)."""

from __future__ import annotations

import functools
import json
import logging
from typing import Any

import pyarrow as pa

from connectors.state.store import DONE, DocumentRecord, ErrorRecord, PlannedChain
from operators.run import RunContext, open_store
from pipeline.core.segmentation import Segment, segment, tokenize
from pipeline.engines.factory import EngineSpec, load_tokenizer

logger = logging.getLogger(__name__)

SEGMENT_TYPE = pa.struct(
    [
        ("index", pa.int32()),
        ("token_start", pa.int64()),
        ("token_end", pa.int64()),
        ("char_start", pa.int64()),
        ("char_end", pa.int64()),
        ("text", pa.string()),
    ]
)
PLANNED_CHAIN_TYPE = pa.struct(
    [
        ("chain_key", pa.string()),
        ("question_id", pa.string()),
        ("question", pa.string()),
        ("status", pa.string()),
    ]
)
PLAN_SCHEMA = pa.schema(
    [
        ("source_uri", pa.string()),
        ("doc_id", pa.string()),
        ("name", pa.string()),
        ("n_tokens", pa.int64()),
        # NULL when every chain of the document was already answered: nothing to read
        ("segments", pa.list_(SEGMENT_TYPE)),
        ("page_starts", pa.list_(pa.int64())),
        ("chains", pa.list_(PLANNED_CHAIN_TYPE)),
    ]
)


@functools.cache
def cached_tokenizer(spec: EngineSpec) -> Any:
    return load_tokenizer(spec)


class SegmentStage:
    """Documents in, plans out: tokenizes each document once, cuts it into segments and
    records its chains (one per question) in the state store. A document whose chains are all
    answered already is passed on without its segments. Runs as plain Ray tasks; the tokenizer
    is loaded once per worker process."""

    def __init__(self, run: RunContext) -> None:
        self.run = run

    def __call__(self, batch: pa.Table) -> pa.Table:
        plans = []
        for row in batch.to_pylist():
            try:
                plan = self._plan(row)
            except Exception as error:  # one bad document never stops the job
                logger.exception("cannot segment %s", row["source_uri"])
                self._fail(row, type(error).__name__, str(error) or type(error).__name__)
                continue
            if plan is not None:
                plans.append(plan)
        return pa.Table.from_pylist(plans, schema=PLAN_SCHEMA)

    def _plan(self, row: dict[str, Any]) -> dict[str, Any] | None:
        questions = self.run.questions_for(row["questions"])
        if not questions:
            self._fail(
                row,
                "NoQuestion",
                "no question for this document: give questions in the job, or beside the file",
            )
            return None
        store = open_store(self.run.store_url)
        planned = [
            PlannedChain(
                self.run.chain_key(row["content_sha256"], question.text),
                question.question_id,
                question.text,
            )
            for question in questions
        ]
        statuses = store.chain_statuses([chain.chain_key for chain in planned])
        segments_out = None
        n_tokens = n_segments = None
        if any(statuses.get(chain.chain_key) != DONE for chain in planned):
            tokenizer = cached_tokenizer(self.run.engine)
            tokenized = tokenize(row["doc_id"], row["text"], tokenizer)
            segments = segment(tokenized, tokenizer, self.run.method.segmentation())
            n_tokens, n_segments = tokenized.n_tokens, len(segments)
            segments_out = [_segment_row(piece) for piece in segments]
        document = self._record(row, n_tokens=n_tokens, n_segments=n_segments)
        statuses = store.plan_document(document, planned)
        return {
            "source_uri": row["source_uri"],
            "doc_id": row["doc_id"],
            "name": row["name"],
            "n_tokens": n_tokens,
            "segments": segments_out,
            "page_starts": row["page_starts"] or [],
            "chains": [
                {
                    "chain_key": chain.chain_key,
                    "question_id": chain.question_id,
                    "question": chain.question,
                    "status": statuses.get(chain.chain_key),
                }
                for chain in planned
            ],
        }

    def _record(
        self, row: dict[str, Any], *, n_tokens: int | None, n_segments: int | None
    ) -> DocumentRecord:
        return DocumentRecord(
            run_id=self.run.run_id,
            attempt=self.run.attempt,
            source_uri=row["source_uri"],
            doc_id=row["doc_id"],
            name=row["name"],
            content_sha256=row["content_sha256"],
            parser=row["parser"],
            pages=row["pages"],
            warnings=row["warnings"] or [],
            metadata=json.loads(row["metadata"] or "{}"),
            n_tokens=n_tokens,
            n_segments=n_segments,
        )

    def _fail(self, row: dict[str, Any], error_type: str, message: str) -> None:
        open_store(self.run.store_url).record_error(
            ErrorRecord(
                run_id=self.run.run_id,
                attempt=self.run.attempt,
                source_uri=row["source_uri"],
                stage="segment",
                error_type=error_type,
                message=message,
                doc_id=row["doc_id"],
                name=row["name"],
            )
        )


def _segment_row(piece: Segment) -> dict[str, Any]:
    return {
        "index": piece.index,
        "token_start": piece.token_start,
        "token_end": piece.token_end,
        "char_start": piece.char_start,
        "char_end": piece.char_end,
        "text": piece.text,
    }
