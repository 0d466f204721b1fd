"""Long real texts as filler: whole passages for distractor documents, and a continuous
token stream for needle haystacks. Texts too short for a target length are cycled."""

from __future__ import annotations

import bisect
import re
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from operators.config import ConfigError
from operators.core.segmentation import TokenizedDocument, tokenize
from pipeline.evaluation.samples import count_tokens

TEXT_SEPARATOR = "\n\n"
_BLANK_LINES = re.compile(r"\n\s*\n")
# How far back an insertion point may move to reach the start of a line.
LINE_START_SEARCH_CHARS = 400


@dataclass(frozen=True)
class Passage:
    title: str
    text: str
    n_tokens: int  # of `text` alone


def split_passages(
    name: str, text: str, tokenizer: Any, min_tokens: int = 120, max_tokens: int = 400
) -> list[Passage]:
    """Cuts a text at blank lines into passages of about `min_tokens` or more, with line breaks
    and runs of spaces flattened; paragraphs longer than `max_tokens` stay whole but are skipped,
    so no single passage can overshoot a small target."""
    paragraphs = [" ".join(part.split()) for part in _BLANK_LINES.split(text)]
    paragraphs = [paragraph for paragraph in paragraphs if paragraph]
    counts = count_tokens(paragraphs, tokenizer)
    passages: list[Passage] = []
    pending: list[str] = []
    pending_tokens = 0
    for paragraph, n_tokens in zip(paragraphs, counts, strict=True):
        pending.append(paragraph)
        pending_tokens += n_tokens + 1
        if pending_tokens >= min_tokens:
            if pending_tokens <= max_tokens:
                joined = " ".join(pending)
                title = f"{name}, passage {len(passages) + 1}"
                passages.append(Passage(title, joined, count_tokens([joined], tokenizer)[0]))
            pending, pending_tokens = [], 0
    return passages


def cycle_from(items: Sequence[Passage], start: int) -> Iterator[Passage]:
    """Every item from `start` on, wrapping around, forever."""
    if not items:
        return
    index = start % len(items)
    while True:
        yield items[index]
        index = (index + 1) % len(items)


@dataclass(frozen=True)
class Insertion:
    depth: float  # share of the excerpt's tokens that come before the inserted text
    text: str


class HaystackCorpus:
    """Several texts joined and tokenized once; excerpts of any length start anywhere and wrap
    around to the first text, so a 1M-token haystack exists even from 400K tokens of text."""

    def __init__(self, texts: Mapping[str, str], tokenizer: Any) -> None:
        if not texts:
            raise ConfigError("a haystack needs at least one text")
        self.names = list(texts)
        joined = TEXT_SEPARATOR.join(text.strip() for text in texts.values())
        self.tokenized: TokenizedDocument = tokenize("haystack", joined, tokenizer)
        self._line_starts = [0] + [
            match.end() for match in re.finditer("\n", joined) if match.end() < len(joined)
        ]

    @property
    def n_tokens(self) -> int:
        return self.tokenized.n_tokens

    def line_start_token(self, char: int) -> int:
        """The first token at or after the start of the line that follows `char`."""
        starts = self._line_starts
        line = starts[min(bisect.bisect_left(starts, char), len(starts) - 1)]
        return min(bisect.bisect_left(self.tokenized.char_starts, line), self.n_tokens - 1)

    def excerpt(self, start_token: int, n_tokens: int, insertions: Sequence[Insertion] = ()) -> str:
        """`n_tokens` tokens from `start_token` on (wrapping), with each insertion placed on its
        own line at the line start nearest before its depth."""
        ranges = self._ranges(start_token, n_tokens)
        placed: dict[int, list[tuple[int, str]]] = {index: [] for index in range(len(ranges))}
        for insertion in insertions:
            position = min(max(int(insertion.depth * n_tokens), 0), max(n_tokens - 1, 0))
            range_index, token = self._locate(ranges, position)
            floor = self._char(ranges[range_index][0])
            placed[range_index].append((self._line_start_before(token, floor), insertion.text))
        parts: list[str] = []
        text = self.tokenized.text
        for index, (first, end) in enumerate(ranges):
            cursor, stop = self._char(first), self._char(end)
            for char, inserted in sorted(placed[index]):
                parts += [text[cursor:char], inserted.strip(), "\n"]
                cursor = char
            parts.append(text[cursor:stop])
            if index < len(ranges) - 1:
                parts.append(TEXT_SEPARATOR)
        return "".join(parts)

    def _ranges(self, start_token: int, n_tokens: int) -> list[tuple[int, int]]:
        ranges = []
        position, left = start_token % self.n_tokens, n_tokens
        while left > 0:
            take = min(left, self.n_tokens - position)
            ranges.append((position, position + take))
            left -= take
            position = 0
        return ranges

    @staticmethod
    def _locate(ranges: Sequence[tuple[int, int]], position: int) -> tuple[int, int]:
        offset = 0
        for index, (first, end) in enumerate(ranges):
            if position < offset + end - first:
                return index, first + position - offset
            offset += end - first
        last = len(ranges) - 1
        return last, ranges[last][1] - 1

    def _char(self, token: int) -> int:
        starts = self.tokenized.char_starts
        return starts[token] if token < len(starts) else len(self.tokenized.text)

    def _line_start_before(self, token: int, floor: int) -> int:
        char = self._char(token)
        text = self.tokenized.text
        lowest = max(floor, char - LINE_START_SEARCH_CHARS)
        newline = text.rfind("\n", lowest, char)
        if newline >= 0:
            return newline + 1
        space = text.rfind(" ", lowest, char)
        return space + 1 if space >= 0 else char
