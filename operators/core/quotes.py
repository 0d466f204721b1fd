"""Verified quotes: the lines of a model's reply that really are in the section it read.

The `verified-quotes` memory strategy asks the model to copy the section's helpful sentences
word for word. Small models paraphrase, shorten and invent; so each reply line is looked up in
the section, and what enters the memory is always the section's own text, never the model's:

1. Found exactly (case and runs of whitespace folded) once in the section: the sentence or line
   that holds it, so a copied fragment ("processor ZephyrPay timed out", or "120") keeps its
   context (the whole log line, the whole clause). Found more than once: the fragment alone,
   since which of its sentences the model meant is unknown; a fragment shorter than
   `QUOTE_MIN_CHARS` that recurs says nothing and is rejected.
2. Found approximately, for lines of `QUOTE_MIN_WORDS` words or more:
   `rapidfuzz.fuzz.partial_ratio_alignment` at `QUOTE_MIN_SCORE` or more (a dropped comma, a
   changed quote mark, a word's ending; one changed word, "Virginia" for "Vermont", still
   matches, and the section's sentence is what is stored).
3. A paraphrase ("The agreement is governed by the laws of the State of Vermont." for "This
   Agreement ... shall be governed by the laws of the State of Vermont, ..."): the section's
   sentence holding the largest share of the line's content words, when that share is at least
   `PARAPHRASE_MIN_SHARE` of at least `PARAPHRASE_MIN_WORDS` words and it holds every number of
   the line.
4. Anything else is rejected: the trajectory lists it. A NONE reply adds nothing.

Sentences and lines are widened from a match to the nearest sentence end or line break, at most
`CONTEXT_CHARS` either side.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from rapidfuzz import fuzz

from operators.core.extraction import STOP_WORDS
from operators.core.figures import is_table_row

# 90 allows a few changed characters in a 60-character sentence; a sentence the model wrote
# itself, even about the same fact, scores far lower.
QUOTE_MIN_SCORE = 90.0
# Fuzzy matching needs this many words: a short line that is not found exactly is not a quote.
QUOTE_MIN_WORDS = 4
# A fragment shorter than this that recurs in the section is too common to say where it came from.
QUOTE_MIN_CHARS = 12
# A paraphrase is anchored to the sentence holding this share of its content words, or more.
PARAPHRASE_MIN_SHARE = 0.75
PARAPHRASE_MIN_WORDS = 3
# How far a quote is widened to reach the start and end of its sentence or line.
CONTEXT_CHARS = 300
# The reply that means "nothing helps".
NOTHING_FOUND = "NONE"

_BULLET = re.compile(r"^\s*(?:[-*\u2022>]+|\d+[.)])\s*")
_WRAPPING_QUOTES = "\"'\u201c\u201d\u2018\u2019`"
_SPACE = re.compile(r"\s+")
# Where a sentence or a record ends: after . ? ! and a space; at a line break after . ? ! ; :
# or before a line that starts a record (a digit, a bullet, a heading, a table row) or is blank.
# A line break inside running text (a wrapped PDF line) is not one.
_BOUNDARY = re.compile(r"(?<=[.?!])[ \t]+|(?<=[.?!;:])[ \t]*\n|\n(?=[ \t]*[\n\d#*|\u2022-])")
# Marks that tables print beside figures and labels and models leave out when they copy.
_IGNORED_MARKS = frozenset("$\u00ae\u2122")
_WORD = re.compile(r"[^\W_]+(?:[-.][^\W_]+)*")


@dataclass(frozen=True)
class QuoteCheck:
    """A reply split into what was found in the section (as the section's text) and not."""

    kept: tuple[str, ...] = ()
    rejected: tuple[str, ...] = ()


def check_quotes(reply: str, section: str) -> QuoteCheck:
    """The section's sentences (or fragments) that the lines of `reply` quote or paraphrase,
    and the lines that are neither (a NONE reply is neither)."""
    folded, offsets = _fold_with_offsets(section)
    sentences: list[tuple[str, frozenset[str]]] | None = None  # built on the first paraphrase
    kept: list[str] = []
    rejected: list[str] = []
    for line in reply.splitlines():
        candidate = _BULLET.sub("", line).strip().strip(_WRAPPING_QUOTES).strip()
        if not candidate or (
            candidate.upper().startswith(NOTHING_FOUND) and len(candidate.split()) <= 2
        ):
            continue
        needle = _fold_with_offsets(candidate)[0].strip().rstrip(".,;:")
        quote = None
        if span := _locate(needle, folded):
            start, end = offsets[span[0]], offsets[span[1] - 1] + 1
            if folded.find(needle, span[0] + 1) < 0:
                quote = _enclosing_sentence(section, start, end)
            elif len(needle) >= QUOTE_MIN_CHARS:  # it recurs: whose sentence is unknown
                quote = _enclosing_words(section, start, end)
        else:
            if sentences is None:
                sentences = [
                    (text, frozenset(_content_words(text))) for text in _sentences(section)
                ]
            quote = _paraphrased(candidate, sentences)
        if quote is None:
            rejected.append(line.strip())
        elif quote not in kept:
            kept.append(quote)
    return QuoteCheck(tuple(kept), tuple(rejected))


def _paraphrased(line: str, sentences: list[tuple[str, frozenset[str]]]) -> str | None:
    """The sentence holding the largest share of `line`'s content words and all its numbers."""
    words = set(_content_words(line))
    if len(words) < PARAPHRASE_MIN_WORDS:
        return None
    numbers = {word for word in words if any(char.isdigit() for char in word)}
    best, best_share = None, PARAPHRASE_MIN_SHARE
    for text, sentence_words in sentences:
        share = len(words & sentence_words) / len(words)
        if (
            share >= best_share
            and numbers <= sentence_words
            and (best is None or share > best_share)
        ):
            best, best_share = text, share
    return best


def _content_words(text: str) -> list[str]:
    return [word for word in _WORD.findall(text.lower()) if word not in STOP_WORDS]


def _sentences(text: str) -> list[str]:
    cuts = _boundaries(text, 0, len(text))
    starts = [0, *(end for _, end in cuts)]
    ends = [*(start for start, _ in cuts), len(text)]
    pieces = (_SPACE.sub(" ", text[a:b]).strip() for a, b in zip(starts, ends, strict=True))
    return [piece for piece in pieces if piece]


def _boundaries(text: str, start: int, end: int) -> list[tuple[int, int]]:
    """The spans between sentences or records that start within `text[start:end]`, in order."""
    spans = {match.span() for match in _BOUNDARY.finditer(text, start, end)}
    # A table row is a record of its own: a quote of its label and a figure is that row,
    # neither its heading nor the rows after it.
    line_start = text.rfind("\n", 0, start) + 1
    while line_start <= end:
        line_end = text.find("\n", line_start)
        line_end = len(text) if line_end < 0 else line_end
        next_end = text.find("\n", line_end + 1)
        next_line = text[line_end + 1 : len(text) if next_end < 0 else next_end]
        if is_table_row(text[line_start:line_end], next_line):
            spans.update(((line_start - 1, line_start), (line_end, line_end + 1)))
        line_start = line_end + 1
    return sorted(span for span in spans if start <= span[0] < end)


def _locate(needle: str, folded: str) -> tuple[int, int] | None:
    """The span of `folded` that `needle` matches, exactly or fuzzily; None when absent."""
    if not needle:
        return None
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
        if char in _IGNORED_MARKS:
            continue
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
    begins = [cut_end for _, cut_end in _boundaries(text, floor, start) if cut_end <= start]
    begin = begins[-1] if begins else 0 if floor == 0 else start
    ceiling = min(len(text), end + CONTEXT_CHARS)
    finishes = _boundaries(text, max(start, end - 1), ceiling)
    stop = finishes[0][0] if finishes else len(text) if ceiling == len(text) else end
    return _enclosing_words(text, begin, stop)


def _enclosing_words(text: str, start: int, end: int) -> str:
    while start > 0 and not text[start - 1].isspace():
        start -= 1
    while 0 < end < len(text) and not text[end - 1].isspace() and not text[end].isspace():
        end += 1
    return _SPACE.sub(" ", text[start:end]).strip()
