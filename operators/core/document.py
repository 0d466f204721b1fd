"""The one record a document is, from its source to the memory operator, and its Arrow row.

A source lists a `Document` with its name, metadata and questions (and its text or bytes when it
has them at hand); the read task fills in `data`; parsing turns `data` into `text`; segmentation
turns `text` into `segments` and plans its `chains`. Each step returns the same record with its
own fields filled (`dataclasses.replace`) and what it consumed dropped, so no stage carries a
document's bytes, text and segments at once. A stage that cannot go on with a document records
it in the errors table and drops it from the stream.

Every stage of the Ray Data stream exchanges `DOCUMENT_SCHEMA` rows: `to_row` and `from_row`
convert, and `documents_table` builds a block.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable, Mapping
from dataclasses import asdict, dataclass, field
from typing import Any

import pyarrow as pa

from operators.core.segmentation import DocumentRef, Segment


@dataclass(frozen=True)
class PlannedChain:
    """One question asked of a document; `status` is what the state store knew when planned."""

    chain_key: str
    question_id: str
    question: str
    status: str | None = None


@dataclass(frozen=True)
class Document:
    uri: str
    name: str
    source_index: int = 0  # which of the job's sources listed it
    size: int | None = None  # in bytes, from the source's listing
    metadata: Mapping[str, Any] = field(default_factory=dict)
    questions: tuple[str, ...] = ()  # asked of this document alone (a sidecar, a column)
    # Why the source cannot give it (a bad sidecar, an unreadable object): the read stage
    # records it in the errors table.
    error: str | None = None
    data: bytes | None = None  # the raw content, until parsed
    text: str | None = None  # given inline by the source, or parsed from `data`
    content_sha256: str | None = None  # of `text`: part of every chain's key
    parser: str | None = None  # "inline" for text given by the source
    pages: int | None = None
    page_starts: tuple[int, ...] = ()  # PDFs: where each page starts in `text`
    warnings: tuple[str, ...] = ()
    n_tokens: int | None = None
    # None when every chain is answered already: nothing to read.
    segments: tuple[Segment, ...] | None = None
    chains: tuple[PlannedChain, ...] = ()

    @property
    def doc_id(self) -> str:
        return doc_id_of(self.uri)

    def to_row(self) -> dict[str, Any]:
        return {
            "source_index": self.source_index,
            "uri": self.uri,
            "name": self.name,
            "size": self.size,
            "metadata": json.dumps(dict(self.metadata), sort_keys=True, default=str),
            "questions": list(self.questions),
            "error": self.error,
            "data": self.data,
            "text": self.text,
            "content_sha256": self.content_sha256,
            "parser": self.parser,
            "pages": self.pages,
            "page_starts": list(self.page_starts),
            "warnings": list(self.warnings),
            "n_tokens": self.n_tokens,
            "segments": None
            if self.segments is None
            else [_segment_row(piece) for piece in self.segments],
            "chains": [asdict(chain) for chain in self.chains],
        }

    @classmethod
    def from_row(cls, row: Mapping[str, Any]) -> Document:
        doc_id = doc_id_of(row["uri"])
        segments = row["segments"]
        return cls(
            uri=row["uri"],
            name=row["name"],
            source_index=row["source_index"],
            size=row["size"],
            metadata=json.loads(row["metadata"] or "{}"),
            questions=tuple(row["questions"] or ()),
            error=row["error"],
            data=row["data"],
            text=row["text"],
            content_sha256=row["content_sha256"],
            parser=row["parser"],
            pages=row["pages"],
            page_starts=tuple(row["page_starts"] or ()),
            warnings=tuple(row["warnings"] or ()),
            n_tokens=row["n_tokens"],
            segments=None
            if segments is None
            else tuple(_segment(doc_id, piece) for piece in segments),
            chains=tuple(PlannedChain(**chain) for chain in row["chains"] or ()),
        )


def doc_id_of(uri: str) -> str:
    return hashlib.sha256(uri.encode()).hexdigest()[:16]


# A collection's segment carries its document (`DocumentRef`); a document's own has none.
DOCUMENT_REF_TYPE = pa.struct(
    [
        ("name", pa.string()),
        ("position", pa.int32()),
        ("count", pa.int32()),
        ("order_key", pa.string()),
        ("page_starts", pa.list_(pa.int64())),
    ]
)
SEGMENT_TYPE = pa.struct(
    [
        ("index", pa.int32()),
        ("token_start", pa.int64()),
        ("token_end", pa.int64()),
        ("char_start", pa.int64()),
        ("char_end", pa.int64()),
        ("text", pa.string()),
        ("document", DOCUMENT_REF_TYPE),
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
DOCUMENT_SCHEMA = pa.schema(
    [
        ("source_index", pa.int32()),
        ("uri", pa.string()),
        ("name", pa.string()),
        ("size", pa.int64()),
        ("metadata", pa.string()),  # JSON
        ("questions", pa.list_(pa.string())),
        ("error", pa.string()),
        ("data", pa.binary()),
        ("text", pa.string()),
        ("content_sha256", pa.string()),
        ("parser", pa.string()),
        ("pages", pa.int32()),
        ("page_starts", pa.list_(pa.int64())),
        ("warnings", pa.list_(pa.string())),
        ("n_tokens", pa.int64()),
        ("segments", pa.list_(SEGMENT_TYPE)),
        ("chains", pa.list_(PLANNED_CHAIN_TYPE)),
    ]
)


def documents_table(documents: Iterable[Document]) -> pa.Table:
    return pa.Table.from_pylist([d.to_row() for d in documents], schema=DOCUMENT_SCHEMA)


def documents_of(table: pa.Table) -> list[Document]:
    return [Document.from_row(row) for row in table.to_pylist()]


def _segment_row(piece: Segment) -> dict[str, Any]:
    row = asdict(piece)
    del row["doc_id"]  # the document's (or collection's): implied by the row it is in
    return row


def _segment(doc_id: str, row: Mapping[str, Any]) -> Segment:
    ref = row.get("document")
    document = None
    if ref is not None:
        document = DocumentRef(**{**ref, "page_starts": tuple(ref["page_starts"] or ())})
    return Segment(doc_id, **{**row, "document": document})
