"""The one document record: what each stage fills in survives its trip through an Arrow block."""

from __future__ import annotations

from dataclasses import replace

from operators.core.document import (
    DOCUMENT_SCHEMA,
    Document,
    PlannedChain,
    documents_of,
    documents_table,
)
from operators.core.segmentation import Segment

LISTED = Document(
    uri="s3://archive/q3/report.pdf",
    name="report.pdf",
    source_index=2,
    size=2048,
    metadata={"key": "q3/report.pdf", "etag": "abc"},
    questions=("What was revenue?",),
)


def test_each_stage_s_fields_survive_the_arrow_block() -> None:
    read = replace(LISTED, data=b"%PDF-1.7 ...")
    parsed = replace(
        read, data=None, text="Page one.\n\nPage two.", parser="pdf:pdfminer", pages=2,
        page_starts=(0, 11), warnings=("page 2: little text",), content_sha256="f" * 64,
    )  # fmt: skip
    segments = (
        Segment(parsed.doc_id, 0, 0, 3, 0, 9, "Page one."),
        Segment(parsed.doc_id, 1, 3, 6, 11, 20, "Page two."),
    )
    planned = replace(
        parsed, text=None, n_tokens=6, segments=segments,
        chains=(PlannedChain("k1", "q0", "What was revenue?", "pending"),),
    )  # fmt: skip
    for document in (LISTED, read, parsed, planned):
        table = documents_table([document])
        assert table.schema.equals(DOCUMENT_SCHEMA)
        assert documents_of(table) == [document]


def test_doc_id_comes_from_the_uri_and_segments_keep_it() -> None:
    assert LISTED.doc_id == "c02087a71000aa30"  # sha256 of the URI, its first 16 hex digits
    other = replace(LISTED, uri="s3://archive/q3/other.pdf")
    assert other.doc_id != LISTED.doc_id and len(other.doc_id) == 16
    piece = Segment(LISTED.doc_id, 0, 0, 1, 0, 1, "x")
    (back,) = documents_of(documents_table([replace(LISTED, segments=(piece,))]))
    assert back.segments is not None and back.segments[0].doc_id == LISTED.doc_id


def test_a_document_without_segments_stays_without() -> None:
    answered = replace(LISTED, segments=None, chains=(PlannedChain("k", "q0", "Q?", "done"),))
    (back,) = documents_of(documents_table([answered]))
    assert back.segments is None and back.chains[0].status == "done"
