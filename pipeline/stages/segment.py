"""Segment + plan: documents with their text in, documents with their segments and chains out."""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from dataclasses import replace
from typing import Any

import pyarrow as pa

from connectors.engines.factory import EngineSpec, load_tokenizer
from connectors.state.database import StateStoreError
from operators.core.chain import ChainStatus
from operators.core.document import Document, PlannedChain, documents_of, documents_table
from operators.core.segmentation import segment, tokenize
from pipeline.stages.run import RunContext, open_store

logger = logging.getLogger(__name__)


@functools.cache
def cached_tokenizer(spec: EngineSpec) -> Any:
    return load_tokenizer(spec)


class SegmentStage:
    """Documents with their text in, documents with their segments and chains out (the text
    dropped: the segments hold it). Tokenizes each document once, cuts it into segments and
    records its chains (one per question) in the state store. A document whose chains are all
    answered already (unchanged since an earlier run, or answered by an earlier attempt) is
    recorded for the run, so its answers are the run's too, and goes no further: only new and
    changed documents, and those with unfinished chains, reach the memory stage. A document
    asked nothing of its own but in a collection goes no further here: the collection stage
    reads it (`pipeline.stages.collection`). Runs as plain Ray tasks; `tokenizer_factory` gives
    the engine's tokenizer, by default loaded once per worker process."""

    def __init__(
        self, run: RunContext, tokenizer_factory: Callable[[EngineSpec], Any] = cached_tokenizer
    ) -> None:
        self.run = run
        self.tokenizer_factory = tokenizer_factory

    def __call__(self, batch: pa.Table) -> pa.Table:
        planned = []
        for document in documents_of(batch):
            if document.error is not None:  # failed to read or parse: in errors already
                continue
            try:
                plan = self._planned(document)
            except StateStoreError:  # not the document's fault: the job stops
                raise
            except Exception as error:  # one bad document never stops the job
                logger.exception("cannot segment %s", document.uri)
                message = str(error) or type(error).__name__
                self.run.record_error(document, "segment", type(error).__name__, message)
                continue
            if plan is not None:
                planned.append(plan)
        return documents_table(planned)

    def _planned(self, document: Document) -> Document | None:
        questions = self.run.questions_for(document.questions)
        if not questions and self.run.in_a_collection(document):
            return None  # read for its collections only: their rows answer for it
        if not questions:
            self.run.record_error(
                document,
                "segment",
                "NoQuestion",
                "no question for this document: give questions in the job, or beside the file",
            )
            return None
        store = open_store(self.run.store_url)
        original = store.document_with_content(
            self.run.run_id, self.run.attempt, document.content_sha256 or "", document.uri
        )
        if original is not None:
            # Same text, same chains: this copy's answers rows share the original's chains,
            # which run once, for the original.
            note = f"duplicate of {original}: same content, answered once"
            document = replace(document, warnings=(*document.warnings, note))
        chains = [
            PlannedChain(
                self.run.chain_key(document.content_sha256 or "", question.text),
                question.question_id,
                question.text,
            )
            for question in questions
        ]
        statuses = store.chain_statuses([chain.chain_key for chain in chains])
        answered = all(statuses.get(chain.chain_key) == ChainStatus.DONE for chain in chains)
        segments = None
        n_tokens = None
        if original is None and not answered:
            tokenizer = self.tokenizer_factory(self.run.engine)
            tokenized = tokenize(document.doc_id, document.text or "", tokenizer)
            max_tokens = self.run.limits.max_tokens
            if tokenized.n_tokens > max_tokens:
                message = (
                    f"too large: {tokenized.n_tokens:,} tokens, over the limit of {max_tokens:,}"
                )
                self.run.record_error(document, "segment", "TooLarge", message)
                return None
            segments = tuple(segment(tokenized, tokenizer, self.run.method.segmentation()))
            n_tokens = tokenized.n_tokens
        planned = replace(document, text=None, n_tokens=n_tokens, segments=segments)
        statuses = store.plan_document(self.run.record_of(planned), chains)
        if original is not None or answered:
            return None  # planned (its answers rows), not run
        return replace(
            planned,
            chains=tuple(replace(chain, status=statuses.get(chain.chain_key)) for chain in chains),
        )
