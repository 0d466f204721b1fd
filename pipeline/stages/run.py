"""What every stage knows of the run it works for: small, picklable, shipped to each worker."""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass, field
from fnmatch import fnmatchcase

from connectors.engines.factory import EngineSpec
from connectors.state.records import DocumentRecord, ErrorRecord
from connectors.state.store import StateStore
from operators.config import DocumentLimits, MethodConfig
from operators.core.document import Document
from pipeline.resume import chain_key, memory_keys


@dataclass(frozen=True)
class Question:
    question_id: str
    text: str


COLLECTION_SCHEME = "collection:"


@dataclass(frozen=True)
class CollectionPlan:
    """A collection as the stages see it (the job's `CollectionSpec` with its questions given
    ids): which documents it holds, their order, and the questions asked of it."""

    name: str
    order_by: str
    documents: tuple[str, ...]  # globs over the documents' names
    source: int | None  # only documents of this source, when set
    questions: tuple[Question, ...]

    @property
    def uri(self) -> str:
        """What its answers rows have for `source_uri` (its `name` is the collection's)."""
        return f"{COLLECTION_SCHEME}{self.name}"

    def position(self, document: Document) -> int | None:
        """The index of the first glob the document matches, None when not a member: a listed
        collection reads its members glob by glob, by name within one."""
        if self.source is not None and document.source_index != self.source:
            return None
        for index, pattern in enumerate(self.documents):
            if fnmatchcase(document.name, pattern):
                return index
        return None


@dataclass(frozen=True)
class RunContext:
    """What every stage needs to know about the run; small and picklable."""

    run_id: str
    attempt: int
    store_url: str = field(repr=False)  # may hold a database password
    engine: EngineSpec  # resolved: its answer settings are concrete and in every chain's key
    method: MethodConfig
    questions: tuple[Question, ...]  # asked of every document
    limits: DocumentLimits = field(default_factory=DocumentLimits)  # over one: an errors row
    collections: tuple[CollectionPlan, ...] = ()  # each read as one document by its chains

    def in_a_collection(self, document: Document) -> bool:
        return any(c.position(document) is not None for c in self.collections)

    def chain_key(self, content_sha256: str, question: str) -> str:
        return chain_key(content_sha256, question, self.engine, self.method)

    def memory_keys(self, content_sha256: str, question: str) -> tuple[str, ...]:
        """With a re-read budget: the keys of the same chain answered another way, whose final
        memory a re-reading chain starts its answer step from (ChainWork)."""
        return memory_keys(content_sha256, question, self.engine, self.method)

    def record_of(self, document: Document) -> DocumentRecord:
        """The state store's row for a planned document (or collection) of this run."""
        return DocumentRecord(
            run_id=self.run_id,
            attempt=self.attempt,
            source_uri=document.uri,
            doc_id=document.doc_id,
            name=document.name,
            content_sha256=document.content_sha256 or "",
            parser=document.parser,
            pages=document.pages,
            warnings=document.warnings,
            metadata=document.metadata,
            n_tokens=document.n_tokens,
            n_segments=None if document.segments is None else len(document.segments),
        )

    def record_error(self, document: Document, stage: str, error_type: str, message: str) -> None:
        """The document leaves the stream: its errors row says where and why."""
        open_store(self.store_url).record_error(
            ErrorRecord(
                run_id=self.run_id,
                attempt=self.attempt,
                source_uri=document.uri,
                stage=stage,
                error_type=error_type,
                message=message,
                doc_id=document.doc_id,
                name=document.name,
            )
        )

    def questions_for(self, own_questions: Sequence[str]) -> list[Question]:
        """The run's questions, then the document's own ones it does not already ask."""
        asked = list(self.questions)
        known = {question.text for question in asked}
        for index, text in enumerate(own_questions):
            if text not in known:
                known.add(text)
                asked.append(Question(f"d{index}", text))
        return asked


@functools.cache
def open_store(url: str) -> StateStore:
    """One store (and connection pool) per worker process."""
    return StateStore(url)
