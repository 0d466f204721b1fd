"""A collection: several documents read in order by one memory chain.

A question that spans an archive ("How did iPhone net sales change over the last three
quarterly reports?") is asked of a collection instead of each document alone. Its documents are
put in order (`order_members`), each is tokenized and cut into segments on its own, so no
segment crosses a document boundary (`segment_collection`), and every segment carries its
document's `DocumentRef`: the model reads the document's header before each of its segments
(`Segment.shown_text`), a verifying memory prefixes each kept quote with the document's label
(`TemplateSet.next_memory`), and evidence names the document and its page
(`operators.core.evidence`). Segment indexes count across the collection, so step k of its chain
reads segment k as for one document; offsets stay those of each document's own text.

A document read alone has no `DocumentRef`: its prompts and chain keys are unchanged.
"""

from __future__ import annotations

import hashlib
import json
import math
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any, Literal, get_args

from operators.core.segmentation import (
    DocumentRef,
    Segment,
    SegmentationConfig,
    Tokenizer,
    segment,
    tokenize,
)

# The orders of local files (`ask --across --order-by`); a job's collection may also be ordered
# by a field of its source (`metadata.<key>`: an SQL or dataset column, an S3 object's).
OrderBy = Literal["listed", "name", "mtime"]
ORDERS: tuple[str, ...] = get_args(OrderBy)
METADATA_ORDER = "metadata."
COLLECTION_PARSER = "collection"  # a collection's `parser` in the store's documents table
_SHOWN_VALUE = 40  # characters of a metadata value a header shows


@dataclass(frozen=True)
class Member:
    """One document of a collection, with what ordering may need."""

    doc_id: str  # unique within the collection: a path, a URI, a sample's file name
    name: str  # what the model and the evidence call it
    text: str
    page_starts: tuple[int, ...] = ()
    mtime: float | None = None  # seconds since the epoch (local files)
    metadata: Mapping[str, Any] = field(default_factory=dict)  # its source's fields


@dataclass(frozen=True)
class CollectionSegments:
    segments: list[Segment]
    n_tokens: int
    documents: tuple[DocumentRef, ...]  # in reading order


def check_order_by(order_by: str) -> None:
    """Refuses (ValueError) an order other than those of `ORDERS` or `metadata.<key>` with a
    key: the one rule a job's spec and `order_members` both apply."""
    if order_by in ORDERS or metadata_key(order_by).strip():
        return
    raise ValueError(
        f"order_by must be one of {', '.join(ORDERS)} or metadata.<key> (<key>: a field of "
        f"the source), got {order_by!r}"
    )


def metadata_key(order_by: str) -> str:
    """The metadata field `order_by` names ("metadata.filed" -> "filed"), "" when none."""
    return order_by.removeprefix(METADATA_ORDER) if order_by.startswith(METADATA_ORDER) else ""


def order_members(members: Sequence[Member], order_by: str) -> list[tuple[Member, str]]:
    """The members in reading order, each with the order key its label shows: none when
    listed (the position is the order), none by name (the name is the key), the modification
    day (UTC) by mtime, "<key> <value>" by metadata.<key>. Ties keep the listed order. A member
    without the order's value (no mtime; no such field, or a null one) is a ValueError naming it.
    """
    check_order_by(order_by)
    if order_by == "listed":
        return [(member, "") for member in members]
    if order_by == "name":
        return [(member, "") for member in sorted(members, key=lambda m: m.name)]
    if order_by == "mtime":
        missing = [member.name for member in members if member.mtime is None]
        if missing:
            raise ValueError(f"no modification time for {', '.join(missing)}")
        ordered = sorted(members, key=lambda m: m.mtime or 0.0)
        return [(member, f"modified {_day(member.mtime or 0.0)}") for member in ordered]
    return _by_metadata(members, metadata_key(order_by))


def _by_metadata(members: Sequence[Member], key: str) -> list[tuple[Member, str]]:
    """Sorted by the field `key`: as numbers when every value is one, else as text (ISO dates
    sort as text)."""
    values = [member.metadata.get(key) for member in members]
    missing = [m.name for m, value in zip(members, values, strict=True) if _is_null(value)]
    if missing:
        raise ValueError(f"no metadata.{key} for {', '.join(missing)}")
    numbers = all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in values)
    order = sorted(range(len(members)), key=lambda i: values[i] if numbers else str(values[i]))
    return [(members[i], f"{key} {_shown(values[i])}") for i in order]


def _is_null(value: Any) -> bool:
    return value is None or (isinstance(value, float) and math.isnan(value))


def _shown(value: Any) -> str:
    """A value as a header shows it: on one line, cut to `_SHOWN_VALUE` characters."""
    text = " ".join(str(value).split())
    return text if len(text) <= _SHOWN_VALUE else text[: _SHOWN_VALUE - 1] + "…"


def _day(timestamp: float) -> str:
    return datetime.fromtimestamp(timestamp, UTC).strftime("%Y-%m-%d")


def document_refs(ordered: Sequence[tuple[Member, str]]) -> tuple[DocumentRef, ...]:
    count = len(ordered)
    return tuple(
        DocumentRef(member.name, position, count, key, member.page_starts)
        for position, (member, key) in enumerate(ordered, 1)
    )


def with_longest_header(
    questions: Sequence[str], ordered: Sequence[tuple[Member, str]]
) -> list[str]:
    """The questions as long as an update prompt's question plus the longest document header,
    so a context check (`operators.config.check_context_fit`) counts the header each segment is
    shown with."""
    header = max(
        (ref.header(continued=True) for ref in document_refs(ordered)), key=len, default=""
    )
    return [f"{question}\n{header}" for question in questions]


def segment_collection(
    ordered: Sequence[tuple[Member, str]], tokenizer: Tokenizer, config: SegmentationConfig
) -> CollectionSegments:
    """Each document cut on its own, in order: indexes count across the collection, offsets
    are into each document's own text, every segment carries its `DocumentRef`."""
    refs = document_refs(ordered)
    segments: list[Segment] = []
    n_tokens = 0
    for (member, _), ref in zip(ordered, refs, strict=True):
        tokenized = tokenize(member.doc_id, member.text, tokenizer)
        n_tokens += tokenized.n_tokens
        for piece in segment(tokenized, tokenizer, config):
            segments.append(in_collection(piece, len(segments), ref))
    return CollectionSegments(segments, n_tokens, refs)


def member_segments(segments: Sequence[Segment], count: int) -> list[int]:
    """How many of a collection's segments each of its `count` members has, in reading order
    (a member cut into none: 0)."""
    counts = [0] * count
    for piece in segments:
        if piece.document is not None:
            counts[piece.document.position - 1] += 1
    return counts


def members_read(segments_per_member: Sequence[int], steps_done: int) -> int:
    """How many members, from the first, a chain has read whole after `steps_done` steps (step
    k reads segment k, so a member is read once the step after its last segment has run)."""
    read = end = 0
    for count in segments_per_member:
        end += count
        if end > steps_done:
            break
        read += 1
    return read


def in_collection(piece: Segment, index: int, ref: DocumentRef) -> Segment:
    """A document's segment as the collection's `index`-th, carrying its document."""
    return Segment(
        piece.doc_id,
        index,
        piece.token_start,
        piece.token_end,
        piece.char_start,
        piece.char_end,
        piece.text,
        ref,
    )


def combined_text(ordered: Sequence[tuple[Member, str]]) -> str:
    """The collection as one text: each document after its header, a blank line between.
    What a one-call method (`direct`) reads; its hash names the collection's content."""
    return "\n\n".join(
        f"{ref.header()}\n\n{member.text}"
        for (member, _), ref in zip(ordered, document_refs(ordered), strict=True)
    )


def collection_sha256(ordered: Sequence[tuple[Member, str]]) -> str:
    """Names what a collection's chain reads: its documents' headers and texts, in order."""
    return hashlib.sha256(combined_text(ordered).encode()).hexdigest()


def member_sha256(member: Member, order_key: str) -> str:
    """Names what a collection's chain reads of one member at its place, however many follow
    it: its name, its order key and its text (its header but for the count, and its text). Two
    collections whose first members have the same hashes read the same first segments."""
    identity = json.dumps([member.name, order_key, member.text], ensure_ascii=False)
    return hashlib.sha256(identity.encode()).hexdigest()


# A kept line's label, as `TemplateSet.next_memory` writes it: "[doc 2: 2023 Q1 AAPL.pdf] ...".
_LABEL_PREFIX = re.compile(r"^\[doc \d+: [^\]\n]*\] ", re.MULTILINE)


def labelled(line: str, label: str) -> str:
    """A memory line prefixed with its document's label."""
    return f"[{label}] {line}" if label else line


def strip_labels(memory: str) -> str:
    """The memory without its lines' document labels: the source's own text, to be found in
    the documents again."""
    return _LABEL_PREFIX.sub("", memory)


def has_documents(segments: Sequence[Segment]) -> bool:
    return any(piece.document is not None for piece in segments)
