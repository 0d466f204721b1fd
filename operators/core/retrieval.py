"""Passages of a document ranked by BM25 (the `bm25s` library), within a token budget.

Two users: the re-read at answer time (a chain's final step sees the passages its question and
final memory point to: backward retrieval with one call of fixed size, so cost stays linear in
length) and the `rag-bm25` evaluation method (the same passages, the question alone, no memory).
Passages never cross a segment; their token counts are estimated from their segment's, so no
tokenizer is needed here.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from operators.core.figures import cells_as_lines
from operators.core.segmentation import Segment

PASSAGE_WORDS = 300
# How much a chain's memory counts beside its question when passages are ranked for a re-read.
HINT_WEIGHT = 0.3
# Names the ranking rule and how a passage is shown inside the re-read's digest: a change to
# either re-runs answer steps (and `templates.EARLIER_REREAD_DIGESTS` gets the old digest).
PASSAGE_RANKING = (
    f"bm25 {PASSAGE_WORDS} words, question + {HINT_WEIGHT} x memory; table cells one a line;"
    " the best passage last"
)
_WORD = re.compile(r"\S+")


@dataclass(frozen=True)
class Passage:
    index: int  # in document order
    char_start: int  # offsets in the document's text
    char_end: int
    text: str
    shown: str  # the text as the answer prompt shows it
    n_tokens: int  # of `shown`, estimated from its segment's tokens per character
    document: str | None = None  # its document's label, in a collection


def as_printed(text: str) -> str:
    return text


def split_passages(
    segments: Sequence[Segment],
    words: int = PASSAGE_WORDS,
    show: Callable[[str], str] = cells_as_lines,
) -> list[Passage]:
    """Each segment cut into runs of `words` words, in document order, each shown to the model
    as `show` writes it (by default a table row's cells one a line) and costing what it shows."""
    if words < 1:
        raise ValueError(f"words must be at least 1, got {words}")
    passages: list[Passage] = []
    for segment in segments:
        spans = [match.span() for match in _WORD.finditer(segment.text)]
        density = segment.n_tokens / max(len(segment.text), 1)
        for first in range(0, len(spans), words):
            start, end = spans[first][0], spans[min(first + words, len(spans)) - 1][1]
            shown = show(segment.text[start:end])
            passages.append(
                Passage(
                    index=len(passages),
                    char_start=segment.char_start + start,
                    char_end=segment.char_start + end,
                    text=segment.text[start:end],
                    shown=shown,
                    n_tokens=max(1, math.ceil(len(shown) * density)),
                    document=segment.document.label if segment.document else None,
                )
            )
    return passages


def select_passages(
    passages: Sequence[Passage],
    query: str,
    budget_tokens: int,
    hints: str = "",
    best_last: bool = False,
) -> list[Passage]:
    """The passages that best match `query` (BM25, English stop words dropped), best first until
    `budget_tokens` is spent, returned in document order (`best_last`: the best one last).

    `hints` (a chain's final memory) add to the ranking at `HINT_WEIGHT` of the query's: each
    score is divided by its best before they are added, so a long memory cannot outvote the
    question. Passages that share no term with the query or the hints are never chosen."""
    if budget_tokens < 1 or not passages:
        return []
    import bm25s  # imported here: only chains that re-read need it

    corpus = bm25s.tokenize([p.text for p in passages], stopwords="en", show_progress=False)
    retriever = bm25s.BM25()
    retriever.index(corpus, show_progress=False)
    scores = np.zeros(len(passages))
    for text, weight in ((query, 1.0), (hints, HINT_WEIGHT)):
        terms = _terms(bm25s.tokenize([text], stopwords="en", show_progress=False))
        known = [term for term in terms if term in corpus.vocab]
        if known:
            found = retriever.get_scores(known)
            if found.max() > 0:
                scores += weight * found / found.max()
    chosen: list[Passage] = []
    spent = 0
    for position in np.argsort(-scores, kind="stable"):
        if scores[position] <= 0:
            break
        passage = passages[int(position)]
        if spent + passage.n_tokens <= budget_tokens:
            chosen.append(passage)
            spent += passage.n_tokens
    return chosen[::-1] if best_last else sorted(chosen, key=lambda passage: passage.index)


def _terms(tokenized: object) -> list[str]:
    vocab = tokenized.vocab  # type: ignore[attr-defined]
    by_id = {token_id: token for token, token_id in vocab.items()}
    return [by_id[token_id] for token_id in tokenized.ids[0] if by_id[token_id]]  # type: ignore[attr-defined]


def render_passages(passages: Sequence[Passage]) -> str:
    """The passages as the answer prompt shows them: numbered in the order given; in a
    collection each after its document's label."""
    return "\n\n".join(
        f"[{number}] {f'({p.document}) ' if p.document else ''}{p.shown}"
        for number, p in enumerate(passages, 1)
    )
