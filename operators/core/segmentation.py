"""Cutting a document into ordered, fixed-size token segments with the model's own tokenizer."""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

REFERENCE_CHUNK_SIZE = 5000


class Tokenizer(Protocol):
    """The slice of a Hugging Face fast tokenizer that segmentation needs."""

    def __call__(self, text: str, **kwargs: object) -> dict[str, list]: ...

    def decode(self, ids: Sequence[int], **kwargs: object) -> str: ...


@dataclass(frozen=True)
class SegmentationConfig:
    chunk_size: int = REFERENCE_CHUNK_SIZE
    # 0 keeps the reference's exact boundaries; N > 0 moves each boundary back by at most N tokens
    # to the nearest line break (else space), so no word or multi-byte character is cut.
    snap_window: int = 0

    def __post_init__(self) -> None:
        if self.chunk_size < 1:
            raise ValueError(f"chunk_size must be at least 1, got {self.chunk_size}")
        if not 0 <= self.snap_window < self.chunk_size:
            raise ValueError(f"snap_window must be in [0, chunk_size), got {self.snap_window}")


@dataclass(frozen=True)
class DocumentRef:
    """A collection's document as its segments carry it: its name, its place in the reading
    order and its order key (`operators.core.collection`), and its pages."""

    name: str
    position: int  # 1-based, in the collection's reading order
    count: int  # documents in the collection
    order_key: str = ""  # shown beside the name: "modified 2023-05-02"; "" for listed order
    page_starts: tuple[int, ...] = ()  # PDFs: where each page starts in the document's text

    @property
    def label(self) -> str:
        """What every segment and every kept quote of the document is labelled with."""
        key = f", {self.order_key}" if self.order_key else ""
        return f"doc {self.position}: {self.name}{key}"

    def header(self, *, continued: bool = False) -> str:
        """The line the model reads before a segment of the document."""
        key = f" ({self.order_key})" if self.order_key else ""
        more = ", continued" if continued else ""
        return f"## Document {self.position} of {self.count}{more}: {self.name}{key}"


@dataclass(frozen=True)
class Segment:
    doc_id: str
    index: int
    token_start: int
    token_end: int
    char_start: int
    char_end: int
    text: str
    # The document of a collection it belongs to; None when a document is read alone. Offsets
    # are into that document's text either way; `index` counts across the whole collection.
    document: DocumentRef | None = None

    @property
    def n_tokens(self) -> int:
        return self.token_end - self.token_start

    @property
    def shown_text(self) -> str:
        """What an update step shows the model: the text, after its document's header in a
        collection (a document's first segment starts at its first token)."""
        if self.document is None:
            return self.text
        return f"{self.document.header(continued=self.token_start > 0)}\n\n{self.text}"


@dataclass(frozen=True)
class TokenizedDocument:
    doc_id: str
    text: str
    token_ids: list[int]
    char_starts: list[int]  # character offset where each token starts

    @property
    def n_tokens(self) -> int:
        return len(self.token_ids)


def tokenize(doc_id: str, text: str, tokenizer: Tokenizer) -> TokenizedDocument:
    """Tokenizes without special tokens; special-token strings in the text stay plain text."""
    encoding = tokenizer(
        text,
        add_special_tokens=False,
        return_offsets_mapping=True,
        split_special_tokens=True,
    )
    offsets = encoding["offset_mapping"]
    return TokenizedDocument(
        doc_id=doc_id,
        text=text,
        token_ids=list(encoding["input_ids"]),
        char_starts=[start for start, _ in offsets],
    )


def boundaries(doc: TokenizedDocument, config: SegmentationConfig) -> list[int]:
    """Token positions where segments start, plus the end position."""
    cuts = [0]
    n = doc.n_tokens
    while cuts[-1] + config.chunk_size < n:
        target = cuts[-1] + config.chunk_size
        cuts.append(_snap(doc, target, config.snap_window) if config.snap_window else target)
    cuts.append(n)
    return cuts if n else [0]


def _snap(doc: TokenizedDocument, target: int, window: int) -> int:
    """The nearest position at or before `target` whose token starts a line, else a word."""
    lowest = max(target - window, 1)
    for wanted in ("\n", " "):
        for position in range(target, lowest - 1, -1):
            start = doc.char_starts[position]
            if start > doc.char_starts[position - 1] and _starts_with_break(
                doc.text, start, wanted
            ):
                return position
    return target


def _starts_with_break(text: str, char_start: int, wanted: str) -> bool:
    # Byte-level BPE tokens carry their leading space or newline; other tokenizers put it before.
    return (
        text[char_start : char_start + 1] == wanted or text[char_start - 1 : char_start] == wanted
    )


def segment(
    doc: TokenizedDocument, tokenizer: Tokenizer, config: SegmentationConfig
) -> list[Segment]:
    """Ordered segments covering the whole document. With exact boundaries a segment's text is
    the decoded token slice, as in the reference; with snapping it is the exact character slice."""
    cuts = boundaries(doc, config)
    segments = []
    for index, (start, end) in enumerate(itertools.pairwise(cuts)):
        # The first segment starts at the document's start: text before the first token (a
        # control character the tokenizer's normaliser drops) is not lost from the offsets.
        char_start = doc.char_starts[start] if index else 0
        char_end = doc.char_starts[end] if end < doc.n_tokens else len(doc.text)
        if config.snap_window:
            text = doc.text[char_start:char_end]
        else:
            text = tokenizer.decode(doc.token_ids[start:end])
        segments.append(Segment(doc.doc_id, index, start, end, char_start, char_end, text))
    return segments
