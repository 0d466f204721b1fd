"""Verified quotes: the lines of a model's reply that really are in the section it read.

The `verified-quotes` memory strategy asks the model to copy the section's helpful sentences
word for word. Small models paraphrase, merge sentences and invent; so each reply line is looked
up in the section, and only what is found there enters the memory, as the section's own text.
The memory then cannot hold a sentence the document does not.

A line is found when, after folding case and runs of whitespace, it is a substring of the
section, or, when it has at least `QUOTE_MIN_WORDS` words, `rapidfuzz.fuzz.partial_ratio_alignment`
scores it at least `QUOTE_MIN_SCORE` against the section (a dropped comma, a changed quote mark, a
word's ending). What enters the memory is the section's own text around the match, widened to the
enclosing sentence or line (at most `CONTEXT_CHARS` either side), so a copied fragment
("processor ZephyrPay timed out") keeps its context (the whole log line) and what the memory
stores is verbatim: a near-copy with one word changed ("Virginia" for "Vermont") is stored as the
section has it. A fragment that occurs more than once in the section ("disk usage on") is kept as
the fragment alone, since which of its sentences the model meant is unknown. Lines shorter than
`QUOTE_MIN_CHARS` are too common to locate and are rejected with the lines not found; a NONE
reply adds nothing.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from rapidfuzz import fuzz

# 90 allows a few changed characters in a 60-character sentence; a sentence the model wrote
# itself, even about the same fact, scores far lower.
QUOTE_MIN_SCORE = 90.0
# Fuzzy matching needs this many words: a short line that is not found exactly is not a quote.
QUOTE_MIN_WORDS = 4
# A line shorter than this is too common to say where it came from ("the Agreement").
QUOTE_MIN_CHARS = 12
# How far a quote is widened to reach the start and end of its sentence or line.
CONTEXT_CHARS = 300
# The reply that means "nothing helps".
NOTHING_FOUND = "NONE"

_BULLET = re.compile(r"^\s*(?:[-*\u2022>]+|\d+[.)])\s*")
_WRAPPING_QUOTES = "\"'\u201c\u201d\u2018\u2019`"
_SPACE = re.compile(r"\s+")
_SENTENCE_ENDS = ("\n", ". ", "? ", "! ")


@dataclass(frozen=True)
class QuoteCheck:
    """A reply split into what was found in the section (as the section's text) and not."""

    kept: tuple[str, ...] = ()
    rejected: tuple[str, ...] = ()


def check_quotes(reply: str, section: str) -> QuoteCheck:
    """Each line of `reply` found in `section`, as the section's sentence or line that holds it,
    and the lines not found (a NONE reply is neither)."""
    folded, offsets = _fold_with_offsets(section)
    kept: list[str] = []
    rejected: list[str] = []
    for line in reply.splitlines():
        candidate = _BULLET.sub("", line).strip().strip(_WRAPPING_QUOTES).strip()
        if not candidate or (
            candidate.upper().startswith(NOTHING_FOUND) and len(candidate.split()) <= 2
        ):
            continue
        needle = _SPACE.sub(" ", candidate.lower()).rstrip(".,;:")
        span = _locate(needle, folded) if len(needle) >= QUOTE_MIN_CHARS else None
        if span is None:
            rejected.append(line.strip())
            continue
        start, end = offsets[span[0]], offsets[span[1] - 1] + 1
        if folded.find(needle, span[0] + 1) >= 0:  # it occurs again: whose sentence is unknown
            quote = _enclosing_words(section, start, end)
        else:
            quote = _enclosing_sentence(section, start, end)
        if quote not in kept:
            kept.append(quote)
    return QuoteCheck(tuple(kept), tuple(rejected))


def _locate(needle: str, folded: str) -> tuple[int, int] | None:
    """The span of `folded` that `needle` matches, exactly or fuzzily; None when absent."""
    start = folded.find(needle)
    if start >= 0:
        return start, start + len(needle)
    if len(needle) > len(folded) or len(needle.split()) < QUOTE_MIN_WORDS:
        return None
    alignment = fuzz.partial_ratio_alignment(needle, folded, score_cutoff=QUOTE_MIN_SCORE)
    if alignment is None or alignment.dest_end <= alignment.dest_start:
        return None
    return _snap(needle, folded, alignment.dest_start, alignment.dest_end)


def _snap(needle: str, folded: str, start: int, end: int) -> tuple[int, int]:
    """A fuzzy span moved onto the needle's first and last words when they are near its ends
    (the alignment window has the needle's length, so it can start or end a little off)."""
    words = needle.split()
    slack = max(8, len(needle) // 10)
    first = folded.find(words[0], max(0, start - slack), start + slack + len(words[0]))
    last = folded.rfind(words[-1], max(0, end - slack - len(words[-1])), end + slack)
    if first >= 0:
        start = first
    if last >= 0 and last + len(words[-1]) > start:
        end = last + len(words[-1])
    return start, end


def _fold_with_offsets(text: str) -> tuple[str, list[int]]:
    """`text` lower-cased with each run of whitespace as one space, and for each character of
    the result its offset in `text`."""
    folded: list[str] = []
    offsets: list[int] = []
    for offset, char in enumerate(text):
        if char.isspace():
            if folded and folded[-1] == " ":
                continue
            char = " "
        elif len(lower := char.lower()) == 1:  # a few letters lower-case to two characters
            char = lower
        folded.append(char)
        offsets.append(offset)
    return "".join(folded), offsets


def _enclosing_sentence(text: str, start: int, end: int) -> str:
    """`text[start:end]` widened back to the start of its sentence or line and on to its end,
    each by at most `CONTEXT_CHARS`, and always to whole words."""
    floor = max(0, start - CONTEXT_CHARS)
    begins = [0] if floor == 0 else []
    begins += [
        found + len(mark)
        for mark in _SENTENCE_ENDS
        if (found := text.rfind(mark, floor, start)) >= 0
    ]
    begin = max(begins, default=start)
    ceiling = min(len(text), end + CONTEXT_CHARS)
    finishes = [len(text)] if ceiling == len(text) else []
    finishes += [
        found + len(mark.rstrip())
        for mark in _SENTENCE_ENDS
        if (found := text.find(mark, end - 1, ceiling)) >= 0
    ]
    return _enclosing_words(text, begin, min(finishes, default=end))


def _enclosing_words(text: str, start: int, end: int) -> str:
    while start > 0 and not text[start - 1].isspace():
        start -= 1
    while 0 < end < len(text) and not text[end - 1].isspace() and not text[end].isspace():
        end += 1
    return _SPACE.sub(" ", text[start:end]).strip()
