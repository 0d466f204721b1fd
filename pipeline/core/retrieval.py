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
from collections.abc import Sequence
from dataclasses import dataclass

from pipeline.core.segmentation import Segment

PASSAGE_WORDS = 300
_WORD = re.compile(r"\S+")


@dataclass(frozen=True)
class Passage:
    index: int  # in document order
    char_start: int  # offsets in the document's text
    char_end: int
    text: str
    n_tokens: int  # estimated from its segment's tokens per character


def split_passages(segments: Sequence[Segment], words: int = PASSAGE_WORDS) -> list[Passage]:
    """Each segment cut into runs of `words` words, in document order."""
    if words < 1:
        raise ValueError(f"words must be at least 1, got {words}")
    passages: list[Passage] = []
    for segment in segments:
        spans = [match.span() for match in _WORD.finditer(segment.text)]
        density = segment.n_tokens / max(len(segment.text), 1)
        for first in range(0, len(spans), words):
            start, end = spans[first][0], spans[min(first + words, len(spans)) - 1][1]
            passages.append(
                Passage(
                    index=len(passages),
                    char_start=segment.char_start + start,
                    char_end=segment.char_start + end,
                    text=segment.text[start:end],
                    n_tokens=max(1, math.ceil((end - start) * density)),
                )
            )
    return passages


def select_passages(passages: Sequence[Passage], query: str, budget_tokens: int) -> list[Passage]:
    """The passages that best match `query` (BM25, English stop words dropped), best first until
    `budget_tokens` is spent, returned in document order. Passages that share no term with the
    query are never chosen."""
    if budget_tokens < 1 or not passages:
        return []
    import bm25s  # imported here: only chains that re-read need it

    corpus = bm25s.tokenize([p.text for p in passages], stopwords="en", show_progress=False)
    query_tokens = bm25s.tokenize([query], stopwords="en", show_progress=False)
    if not any(token in corpus.vocab for token in query_tokens.vocab):
        return []
    retriever = bm25s.BM25()
    retriever.index(corpus, show_progress=False)
    # Query tokens are ids in the query's own vocabulary: retrieve with strings instead.
    terms = [_terms(query_tokens)]
    ranked, scores = retriever.retrieve(terms, k=len(passages), show_progress=False)
    chosen: list[Passage] = []
    spent = 0
    for position, score in zip(ranked[0], scores[0], strict=True):
        if score <= 0:
            break
        passage = passages[int(position)]
        if spent + passage.n_tokens <= budget_tokens:
            chosen.append(passage)
            spent += passage.n_tokens
    return sorted(chosen, key=lambda passage: passage.index)


def _terms(tokenized: object) -> list[str]:
    vocab = tokenized.vocab  # type: ignore[attr-defined]
    by_id = {token_id: token for token, token_id in vocab.items()}
    return [by_id[token_id] for token_id in tokenized.ids[0] if by_id[token_id]]  # type: ignore[attr-defined]


def render_passages(passages: Sequence[Passage]) -> str:
    """The passages as the answer prompt shows them: numbered, in document order."""
    return "\n\n".join(f"[{number}] {p.text}" for number, p in enumerate(passages, 1))
