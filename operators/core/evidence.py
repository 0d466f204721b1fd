"""Evidence for an answer: where in the source it came from, and whether it is grounded there.

The grounding rule. Finding the answer's string somewhere proves little: "25%", "1", "Yes" or
"$1,000,000" occur in any filing. An answer is grounded only when both hold in one segment:

1. Its content is found there: exactly after normalisation (case, punctuation and articles
   ignored, whole words and whole numbers only: "25" matches "25%" but not "125" or "25.5"),
   or, for answers that are not short, by `rapidfuzz.fuzz.partial_ratio_alignment` scoring at
   least `ANSWER_FUZZY_MIN_SCORE`, with every number of the answer in the matched text.
2. Context confirms it, within `CONTEXT_CHARS` either side of the match in that segment. The
   context terms are the question's content words (stop words dropped) that the answer does not
   itself contain, each matching any word that starts with its first `STEM_CHARS` characters
   ("governs" ~ "governed", "percentage" ~ "percent").
   - Short answers (fewer than `SHORT_ANSWER_MIN_CHARS` letters and digits, or only digits) and
     answers of one or two content words need `SHORT_MIN_TERMS` context terms beside the match
     (all there are, if fewer; with none, only the memory can vouch), or a memory sentence that
     contains the answer and was found in the source, spanning this match, with a score of at
     least `MEMORY_SUPPORT_MIN_SCORE`. Short answers are never matched fuzzily.
   - Specific answers (`SPECIFIC_ANSWER_MIN_WORDS` content words or more) need
     `SPECIFIC_MIN_TERMS` context term beside the match, or none when the answer itself holds
     every content word of the question.

Amounts follow their own rule, since a filing prints the same numbers in many tables and a
figure's neighbours are other figures. An answer that is one amount ("$39,669 million", "12.5%",
"39,669", with at most `FIGURE_ANSWER_MAX_WORDS` other content word; dates and small counts such
as "60 days" are not amounts) is grounded where that value is printed (by value, in any scale:
"$39.7 billion" is printed "39,669" under "(In millions)") inside a record that names what the
question asks about:
- a table row (`operators.core.figures.is_table_row`)
  holding a key term of the question, or a sentence holding a key term and
  `FIGURE_SENTENCE_MIN_TERMS` terms in all (all, if fewer);
- the key terms are those the document prints about as rarely as its rarest (within
  `KEY_TERM_SPREAD` times): "iPhone", not "net" or "sales", so "Total net sales $ 116,444" does
  not ground an answer about AWS;
- terms that name a period ("three months ended June 25, 2022"), an owner ("Apple's") or a kind
  of line ("segment") do not count: they head every table of the filing.
The evidence is the printed figure; the reason names its row or sentence. The memory does not
vouch for an amount: a memory holds many figures, and a wrong one is found in the source as
surely as the right one. A PDF's table row is written with its column headers ("AWS, Net sales:
Three Months Ended June 30, 2022 $ 19,739; Three Months Ended June 30, 2023 $ 22,140"): there
the question's terms count in the row's label and the figure's own column header only, and a
figure in the column of another period than the question names (the prior year's, six months
instead of three) does not ground it. In a row printed without its headers, where the columns
cannot be told apart, only the first amount grounds an answer: financial statements print the
current period first. An answer that states amounts within a sentence ("revenue of $12.2
billion and $11.9 billion") is matched by the general rule and, besides, is grounded only when
one of its amounts is printed in a record that names the question's key terms.
A question that asks for money ("in millions of dollars", "per share", "$") or a percentage
makes a bare number ("14", "1.20") an amount too, found by the same rule, where a printed
percentage is no amount of money; a bare number under ten without decimals is never grounded
(filings print "1" as a note number or a footnote marker). A question that asks for a change
("By how much did iPhone net sales increase ...") is not answered by a table's cell, which is
one period's level: an amount (not a percentage) printed only in table rows is not grounded;
a sentence that states it ("increased $1.2 billion") grounds it.

No answer (None, blank, or the model saying the document does not tell), a yes/no answer and an
answer without words or numbers are never grounded: there is nothing to locate.

A question that asks for a date ("On what date does this agreement take effect?") needs a date
in the answer: "the Effective Date" is not grounded. An answer that states one date is grounded
by value (`operators.core.dates`): by the general rule, applied to each spelling the document
prints that date in ("May 16, 2017" where the contract reads "16th day of May, 2017").

A question that asks for a document's title ("What is the title of this agreement?") needs an
answer that names a kind of document (`DOCUMENT_KINDS`: "Outsourcing Agreement"): a party's
name or a signatory's "Title: Director", found beside the question's terms, is not a title.

Page furniture is no finding: an answer that only names a reporting period ("Three Months Ended
April 1, 2023", or a year alone, unless the question asks when, or for a period, quarter or year)
or that is a line the document prints `RUNNING_LINE_MIN_PAGES` times or more, numbers aside (a
running footer, "Apple Inc. | Q2 2023 Form 10-Q | 9"), is never grounded, however close to the
question's terms; nor is a date printed only in such a line ("Source: VITALIBIS, INC., 8-K,
3/16/2018" on every page of a filed contract).

In every case the evidence also shows where the final memory's most relevant sentences came
from (matches="memory", fuzzy score at least `min_score`; the initial memory and dropped-lines
markers are skipped).

Cost is linear in the text: the segments' lower-cased texts are joined once (lower-casing keeps
lengths, so offsets stay exact); then there is one C-level regex scan per answer, question term
and tried anchor word of a memory sentence, and fuzzy alignment only in short windows around
anchor hits. Offsets are exact when each segment's text is the slice of the document text that
its char offsets name; segments whose text length disagrees with their offsets are skipped.

In a collection (`operators.core.collection`) the segments of all its documents are searched
together, the rules unchanged; each evidence item names its document and that document's page,
and the memory's document labels are left out before its sentences are looked up.
"""

from __future__ import annotations

import bisect
import functools
import heapq
import re
import string
from collections import Counter
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass, replace
from itertools import islice

from rapidfuzz import fuzz

from operators.core.collection import has_documents, strip_labels
from operators.core.dates import asks_for_date, date_sites, find_dates
from operators.core.extraction import STOP_WORDS, normalize_answer
from operators.core.figures import (
    Figure,
    find_figures,
    is_table_row,
    other_period,
    period_keys,
    same_figure,
)
from operators.core.segmentation import Segment
from operators.core.templates import INITIAL_MEMORY

# Half-width of the window around an answer match in which question terms must appear: about
# one paragraph, so a term from an unrelated clause or table a page away does not count.
CONTEXT_CHARS = 300
# Answers with fewer letters and digits than this ("1", "25%", "Yes") are short.
SHORT_ANSWER_MIN_CHARS = 4
# Answers with this many words or more are specific enough to rest on one nearby term.
SPECIFIC_ANSWER_MIN_WORDS = 3
SHORT_MIN_TERMS = 2
SPECIFIC_MIN_TERMS = 1
# partial_ratio of a fuzzy answer match: 90 allows a plural or a dropped "Inc." in a name of
# twenty characters, not a different name ("john doe" vs "john roe" scores 87.5).
ANSWER_FUZZY_MIN_SCORE = 90.0
# Default floor for memory evidence: a paraphrased memory sentence scores 70-80 against its source
# sentence, a verbatim copy 100; the same sentence with a different key fact falls to about 60.
MIN_SCORE = 70.0
# A memory sentence vouches for an answer found beside it only when it is nearly verbatim.
MEMORY_SUPPORT_MIN_SCORE = 85.0
# Question terms match words that start with their first STEM_CHARS characters.
STEM_CHARS = 5
# Fuzzy alignment runs only around hits of a needle's longest words (ANCHORS_PER_NEEDLE of them,
# cut to ANCHOR_CHARS): the first ANCHOR_TRIES are tried in turn, and a window must also hold
# ANCHORS_NEEDED of the others (or all, if fewer), which a paraphrase keeps and chance rarely does.
ANCHOR_CHARS = 6
ANCHORS_PER_NEEDLE = 5
ANCHORS_NEEDED = 2
ANCHOR_TRIES = 2
# Caps that bound the fuzzy work on repetitive text: hits of an anchor looked at (the first ones),
# windows aligned per anchor (the most promising ones), memory sentences located (the most
# relevant ones). Real text rarely reaches them: a long word seldom occurs 5,000 times.
MAX_ANCHOR_HITS = 5000
MAX_ALIGNMENTS = 100
MAX_MEMORY_SENTENCES = 8
MEMORY_MIN_CHARS = 12
MAX_QUESTION_TERMS = 8
# The question's key terms: those the document prints at most this many times as often as its
# rarest term ("Intelligent" 49 times and "Cloud" 133 in a filing: only "Intelligent" is key).
KEY_TERM_SPREAD = 2
# An answer is a figure when it holds one amount and at most this many other content words.
FIGURE_ANSWER_MAX_WORDS = 1
_UNIT_WORDS = frozenset({"dollars", "usd", "percent", "per", "cent", "share", "approximately"})
# Words that ask for a figure's kind or size ("By what percentage", "How large"): a filing does
# not print them beside the figure, so they are no key term of the figure rule.
_ASKING_WORDS = frozenset({"percentage", "large", "big", "approximately"})
# A sentence grounds a figure when it holds this many of the question's terms (all, if fewer).
FIGURE_SENTENCE_MIN_TERMS = 2
# Words that name a reporting period: they head every column of a filing's tables.
_PERIOD_WORDS_TEXT = """
three six nine twelve months month ended ending quarter quarters year years fiscal period
january february march april may june july august september october november december
jan feb mar apr jun jul aug sep sept oct nov dec
"""
PERIOD_WORDS = frozenset(_PERIOD_WORDS_TEXT.split())
# Words that name a kind of line, not which one: page titles print them above whole tables
# ("SEGMENT RESULTS OF OPERATIONS"), so they tell no row apart.
KIND_WORDS = frozenset({"segment", "segments"})
# What a title names: "Outsourcing Agreement", "Promissory Note", "Statement of Work".
DOCUMENT_KINDS = re.compile(
    r"\b(?:agreements?|contracts?|amendments?|addend(?:um|a)|licen[cs]es?|leases?|plans?|"
    r"memorand(?:um|a)|deeds?|indentures?|guarant(?:ee|y)s?|charters?|by-?laws|certificates?|"
    r"consents?|letters?|notes?|terms|policy|policies|protocols?|statement of work|"
    r"understanding|arrangements?|orders?|reports?|forms?)\b",
    re.IGNORECASE,
)
_TITLE_QUESTION = re.compile(
    r"\b(?:title|name)\s+of\s+(?:this|the)\s+(?:agreement|contract|document)\b", re.IGNORECASE
)
# A line printed this many times is page furniture (a running header or footer), not a finding.
RUNNING_LINE_MIN_PAGES = 3
_DAY_OR_YEAR = re.compile(r"(?:[12]?\d|3[01]|(?:19|20)\d\d)")
# A period's end names a reporting period ("three months ended April 1, 2023"), where "12 months"
# alone is a duration.
_DURATION_WORDS = "three six nine twelve month months year years quarter quarters fiscal period"
_PERIOD_ENDS = PERIOD_WORDS - frozenset(_DURATION_WORDS.split())
_ASKS_FOR_A_PERIOD = frozenset({"when", "period", "periods", "quarter", "quarters", "year"})
_LETTERS = re.compile(r"[^\W\d_]+")
_SCALE_READINGS = (1.0, 1e3, 1e6, 1e9)  # a printed figure's scale is in a heading far away
# A question that asks for money, or for money or a share: a bare number answering it is an
# amount too, and a percentage printed is no amount of money.
_ASKS_FOR_MONEY = re.compile(
    r"\$|\b(?:dollars?|millions?|billions?|thousands?|per share)\b", re.IGNORECASE
)
_ASKS_FOR_A_SHARE = re.compile(r"\bpercent(?:age)?\b", re.IGNORECASE)
_BARE_NUMBER = re.compile(r"[-+(]?\d[\d,]*(?:\.\d+)?\)?")
# A question that asks how much something changed: a table prints levels, not the change.
_ASKS_FOR_A_CHANGE = re.compile(
    r"\bby how much\b|\bhow much did\b.*\b(?:increase|decrease|change|grow|decline|rise|fall)|"
    r"\b(?:difference|change) (?:in|between)\b",
    re.IGNORECASE,
)


_TOKEN = re.compile(r"[^\W_]+")
_ARTICLES = frozenset({"a", "an", "the"})
# Between the words of a phrase: any run of non-alphanumerics except the segment separator NUL,
# optionally with articles, as `normalize_answer` drops them.
_SEP = r"(?:[^\w\x00]|_)+(?:(?:a|an|the)(?:[^\w\x00]|_)+)*"
_NUMBER_GOES_ON = r"(?![^\W_]|[.,]\d)"
_FOLD = str.maketrans(
    dict.fromkeys(
        string.punctuation + "\u2018\u2019\u201c\u201d\u2013\u2014\u2026\u2022\u00a7", " "
    )
)
_BULLET = re.compile(r"^\s*(?:[-*\u2022]+|\d+[.)])\s+")
_SENTENCE_BREAK = re.compile(r"(?<=[.!?])(?<!\b[A-Z]\.)\s+(?=[\"'(\[]?[A-Z0-9])")
_DROPPED_MARKER = re.compile(r"\[dropped \d+ older lines\]")
_NO_ANSWER = re.compile(
    r"^(?:none|unknown|unanswerable|no answer|noanswer|n a|not applicable)$"
    r"|\bnot (?:be )?(?:mentioned|provided|specified|stated|given|found|available|included"
    r"|present|disclosed|known|contained|addressed|indicated|determinable)\b"
    r"|\b(?:no|insufficient|not enough) (?:information|data|details|mention)\b"
    r"|\b(?:cannot|cant|can not) (?:be )?(?:determined|found|answered|inferred|identified)\b"
    r"|\b(?:(?:does|do|did) not|doesnt|dont|didnt) (?:mention|provide|specify|state|say"
    r"|contain|include|give|indicate|disclose)\b"
    r"|\bnot in (?:document|text|memory|section|article|passage|context|provided)\b"
)
_YES_NO = frozenset({"yes", "no", "true", "false"})
# "The answer is that storage-node-17 is full": the reply's "that" is not the answer's content,
# and would keep a verbatim answer from matching its source line or the memory's copy of it.
_LEAD_IN = re.compile(r"^\s*that\s+", re.IGNORECASE)
_LIST_SEPARATOR = re.compile(r"\s*;\s*|,?\s+(?:and|&)\s+")
# Tried after the separators above: "6139624, 5384037, 8361206". Not first, since a comma also
# sits inside one item ("Photronics, Inc. and Dai Nippon"), which the split above keeps whole.
_LIST_SEPARATOR_WITH_COMMAS = re.compile(_LIST_SEPARATOR.pattern + r"|,\s+")
_PAGE = "\x00page"
# "Apple's iPhone net sales": the owner names the whole filing, the rest names the line.
_POSSESSOR = re.compile(r"([^\W_]+)['\u2019]s\b")
# Where a sentence ends in lower-cased text: after . ? ! and a space, or at a blank line.
_RECORD_END = re.compile(r"(?<=[.?!])\s+|\n[ \t]*\n")


@dataclass(frozen=True)
class Evidence:
    segment_index: int
    page: int | None  # 1-based page holding char_start; None without page starts
    char_start: int  # offsets into the whole document text
    char_end: int
    quote: str  # document_text[char_start:char_end]
    score: float  # 0..100; 100 for exact matches after normalisation
    matches: str  # "answer" or "memory"
    # In a collection: the label of the document it is in (offsets and page are that
    # document's); None, and absent from `as_dict`, for a document read alone.
    document: str | None = None

    def as_dict(self) -> dict[str, object]:
        row = asdict(self)
        if self.document is None:
            del row["document"]
        return row


@dataclass(frozen=True)
class Grounding:
    evidence: tuple[Evidence, ...]  # answer matches first, then memory matches; best first
    grounded: bool
    reason: str

    def as_dict(self) -> dict[str, object]:
        return {
            "evidence": [item.as_dict() for item in self.evidence],
            "grounded": self.grounded,
            "grounding_reason": self.reason,  # the name it has in the answers table
        }


def says_not_in_document(answer: str) -> bool:
    """The answer says the document does not tell ("not mentioned", "no information", ...)."""
    return bool(_NO_ANSWER.search(normalize_answer(answer)))


def text_segments(doc_id: str, text: str, size: int = 20_000) -> list[Segment]:
    """`text` cut into exact character slices of about `size`, at a line break where one is
    near: segments to look for evidence in where no token segmentation is at hand."""
    pieces, start = [], 0
    while start < len(text):
        end = min(start + size, len(text))
        if end < len(text):
            newline = text.rfind("\n", start + size // 2, end)
            end = newline + 1 if newline >= 0 else end
        pieces.append(Segment(doc_id, len(pieces), start, end, start, end, text[start:end]))
        start = end
    return pieces


def page_of(char_offset: int, page_starts: Sequence[int] | None) -> int | None:
    """The 1-based page holding `char_offset`, given each page's ascending start offset. Text
    before the first start counts as page 1; of pages starting at one offset, the last holds it."""
    if char_offset < 0:
        raise ValueError(f"char_offset must not be negative, got {char_offset}")
    if not page_starts:
        return None
    return max(bisect.bisect_right(page_starts, char_offset), 1)


def find_evidence(
    question: str,
    answer: str | None,
    final_memory: str,
    segments: Sequence[Segment],
    page_starts: Sequence[int] | None = None,
    *,
    max_items: int = 3,
    min_score: float = MIN_SCORE,
) -> Grounding:
    """Locates `answer` and the memory's sentences in `segments` and applies the grounding rule.

    Evidence holds the answer's supporting matches, then the memory sentences' matches (those
    scoring at least `min_score`), each best first, `max_items` in all.
    """
    if max_items < 0:
        raise ValueError(f"max_items must not be negative, got {max_items}")
    corpus = _Corpus(segments)
    if has_documents(segments):  # a collection's memory labels its lines with their document
        final_memory = strip_labels(final_memory)
    answer = _LEAD_IN.sub("", answer) if answer else answer
    words = _words(answer or "")
    terms = _question_terms(question)
    memory = _memory_matches(final_memory, corpus, min_score, words, terms)
    if (
        by_date := _ground_date(answer or "", question, terms, corpus, memory, max_items)
    ) is not None:
        matches, grounded, reason = by_date
    elif (
        by_figure := _ground_figure(answer or "", question, corpus, max(max_items, 1))
    ) is not None:
        matches, grounded, reason = by_figure
    else:
        matches, grounded, reason = _ground(answer, words, terms, corpus, memory, max(max_items, 1))
        if not grounded and (as_list := _ground_list(answer or "", terms, corpus, memory, reason)):
            matches, grounded, reason = as_list
        if grounded and not _names_an_amount(answer or "", question, corpus):
            matches, grounded = [], False
            reason = (
                "The answer's text is found, but none of the amounts it states is printed in a "
                "table row or sentence that names the question's terms: they may be another "
                "line's figures."
            )
    if grounded and (not_a_finding := _not_a_finding(answer or "", question, corpus)):
        matches, grounded, reason = [], False, not_a_finding
    evidence = [corpus.evidence(m, "answer", page_starts) for m in matches]
    if grounded:
        reason = _with_pages(reason, evidence)
    evidence += [corpus.evidence(m.match, "memory", page_starts) for m in memory]
    return Grounding(tuple(evidence[:max_items]), grounded, reason)


def _not_a_finding(answer: str, question: str, corpus: _Corpus) -> str | None:
    """Why a located answer is no finding (the title and page-furniture rules of the module's
    docstring): a title that names no kind of document, a reporting period, a running header
    or footer; None otherwise."""
    if asks_for_title(question) and not DOCUMENT_KINDS.search(answer):
        return "The question asks for a title and the answer names no kind of document."
    words = _content_words(answer)
    if (
        words
        and all(w in PERIOD_WORDS or _DAY_OR_YEAR.fullmatch(w) for w in words)
        and (any(w in _PERIOD_ENDS for w in words) or (len(words) == 1 and len(words[0]) == 4))
        and not asks_for_date(question)
        and not _ASKS_FOR_A_PERIOD & set(_words(question))
    ):
        return "The answer only names a reporting period, not what the question asks about."
    if _is_running_line(answer, corpus):
        return "The answer is a line printed on page after page (a running header or footer)."
    return None


def _is_running_line(line: str, corpus: _Corpus) -> bool:
    """Whether `line` is printed on page after page, numbers aside: a running header or footer
    ("Apple Inc. | Q2 2023 Form 10-Q | 9", "Source: VITALIBIS, INC., 8-K, 3/16/2018")."""
    shape = _line_shape(line)
    return " " in shape and corpus.line_shapes[shape] >= RUNNING_LINE_MIN_PAGES


def _in_running_line(corpus: _Corpus, position: int) -> bool:
    start, end = _line_bounds(corpus, position)
    return _is_running_line(corpus.text[start:end], corpus)


def _line_shape(text: str) -> str:
    """A line with its numbers, case and punctuation left out: page after page, a running
    footer has one shape ("apple inc q form q" for "Apple Inc. | Q2 2023 Form 10-Q | 9")."""
    return " ".join(_LETTERS.findall(text.lower()))


def asks_for_title(question: str) -> bool:
    return _TITLE_QUESTION.search(question) is not None


def _ground_list(
    answer: str,
    terms: list[str],
    corpus: _Corpus,
    memory: list[_MemoryMatch],
    whole_reason: str,
) -> tuple[list[_Match], bool, str] | None:
    """An answer not grounded whole, read as a list: split at "and" and ";" first, then at
    commas too (a comma also sits inside one item: "Photronics, Inc."). None when it lists
    fewer than two items either way; a refusal names the first split tried."""
    first_refusal, tried = None, list[str]()
    for separator in (_LIST_SEPARATOR, _LIST_SEPARATOR_WITH_COMMAS):
        items = _list_items(answer, separator)
        if len(items) < 2 or items == tried:
            continue
        outcome = _ground_items(items, terms, corpus, memory, whole_reason)
        if outcome[1]:
            return outcome
        first_refusal, tried = first_refusal or outcome, items
    return first_refusal


def _ground_items(
    items: list[str],
    terms: list[str],
    corpus: _Corpus,
    memory: list[_MemoryMatch],
    whole_reason: str,
) -> tuple[list[_Match], bool, str]:
    """A list answer not found whole is grounded when each of its items is; its matches are
    each item's best one, in order. A refused list names its first item that is not grounded."""
    grounded_items = [_ground(item, _words(item), terms, corpus, memory, 1) for item in items]
    for item, (_, item_grounded, why) in zip(items, grounded_items, strict=True):
        if not item_grounded:
            reason = f"{whole_reason} Of the {len(items)} items it lists, {item!r} is not grounded"
            return [], False, f"{reason}: {why}"
    whys = (why for _, _, why in grounded_items)
    reasons = " ".join(f"{item!r}: {why}" for item, why in zip(items, whys, strict=True))
    matches = [item_matches[0] for item_matches, _, _ in grounded_items]
    return matches, True, f"Each of the {len(items)} items the answer lists is grounded. {reasons}"


def _with_pages(reason: str, answer_evidence: Sequence[Evidence]) -> str:
    """The reason with its n-th page placeholder filled from the n-th answer match's page (a
    whole answer's reason names only its best match, the first)."""
    pieces = reason.split(_PAGE)
    pages = (
        ("" if item.document is None else f" of {item.document}")
        + ("" if item.page is None else f", page {item.page}")
        for item in answer_evidence
    )
    return pieces[0] + "".join(page + piece for page, piece in zip(pages, pieces[1:], strict=False))


def _list_items(answer: str, separator: re.Pattern[str]) -> list[str]:
    """The items of an answer that lists several ("A and B", "A; B", "A, B"), each with words;
    only a lower-case "and" separates, so a title such as "SERVICES AND HOSTING AGREEMENT" stays
    whole."""
    items = (item.strip(" \t\n()[]\"'.,") for item in separator.split(answer))
    return [item for item in items if _words(item)]


@dataclass(frozen=True)
class _Match:
    start: int  # offsets into _Corpus.text
    end: int
    score: float


@dataclass(frozen=True)
class _MemoryMatch:
    phrase: str  # the sentence's words, lower-cased, articles dropped, one space apart
    match: _Match


@dataclass(frozen=True)
class _Candidate:
    match: _Match
    terms: tuple[str, ...]  # context terms found near the match
    memory_support: bool

    @property
    def strength(self) -> int:
        return len(self.terms) + self.memory_support


class _Corpus:
    """The segments' lower-cased texts joined by NUL, with each segment's start in the join."""

    def __init__(self, segments: Sequence[Segment]) -> None:
        self.segments = [s for s in segments if len(s.text) == s.char_end - s.char_start]
        self.starts: list[int] = []
        position = 0
        for seg in self.segments:
            self.starts.append(position)
            position += len(seg.text) + 1
        self.text = "\x00".join(_lower(seg.text) for seg in self.segments)

    @functools.cached_property
    def line_shapes(self) -> Counter[str]:
        """How many lines of the text have each shape (`_line_shape`); counted once, when an
        answer is first checked against them."""
        return Counter(_line_shape(line) for line in self.text.replace("\x00", "\n").splitlines())

    def locate(self, position: int) -> tuple[int, int, int]:
        """The index in `segments` of the segment holding `position`, and its bounds."""
        i = bisect.bisect_right(self.starts, position) - 1
        return i, self.starts[i], self.starts[i] + len(self.segments[i].text)

    def occurrences(self, pattern: re.Pattern[str]) -> Iterator[re.Match[str]]:
        return (m for m in pattern.finditer(self.text) if _starts_word(self.text, m.start()))

    def evidence(self, match: _Match, matches: str, page_starts: Sequence[int] | None) -> Evidence:
        i, lo, _ = self.locate(match.start)
        seg = self.segments[i]
        start, end = seg.char_start + match.start - lo, seg.char_start + match.end - lo
        quote = seg.text[match.start - lo : match.end - lo]
        document = seg.document.label if seg.document else None
        pages = seg.document.page_starts if seg.document else page_starts
        return Evidence(
            seg.index, page_of(start, pages), start, end, quote, match.score, matches, document
        )

    def align(self, text: str, cutoff: float) -> list[_Match]:
        """Fuzzy matches of `text` scoring at least `cutoff`, best first, without overlaps.

        Only windows around a hit of one of the needle's longest words are aligned, those that
        hold most of its other long words first; a window reaches half the needle's length
        beyond it on either side.
        """
        needle = _fold(text)
        anchors = _anchors(needle)
        pad = len(needle) // 2 + 8
        for word, offset in anchors[:ANCHOR_TRIES]:
            prefix = word[:ANCHOR_CHARS]
            others = {w[:ANCHOR_CHARS] for w, _ in anchors} - {prefix}
            needed = min(ANCHORS_NEEDED, len(others))
            windows: list[tuple[int, int, int]] = []
            hits = self.occurrences(re.compile(re.escape(prefix)))
            for hit in islice(hits, MAX_ANCHOR_HITS):
                _, lo, hi = self.locate(hit.start())
                start = max(lo, hit.start() - offset - pad)
                end = min(hi, hit.start() - offset + len(needle) + pad)
                held = sum(other in self.text[start:end] for other in others)
                if held >= needed:
                    windows.append((-held, start, end))
            matches: list[_Match] = []
            for _, start, end in heapq.nsmallest(MAX_ALIGNMENTS, windows):
                window = self.text[start:end].translate(_FOLD)
                found = fuzz.partial_ratio_alignment(needle, window, score_cutoff=cutoff)
                if found is not None:
                    span = self._snap(start + found.dest_start, start + found.dest_end)
                    if span[0] < span[1]:
                        matches.append(_Match(*span, found.score))
            if matches:
                return _best_disjoint(matches)
        return []

    def _snap(self, start: int, end: int) -> tuple[int, int]:
        """Trims a span to alphanumerics at both ends, then widens it to whole words."""
        text = self.text
        while start < end and not text[start].isalnum():
            start += 1
        while end > start and not text[end - 1].isalnum():
            end -= 1
        if start == end:
            return start, end
        while start > 0 and text[start - 1].isalnum():
            start -= 1
        while end < len(text) and text[end].isalnum():
            end += 1
        return start, end


def _ground(
    answer: str | None,
    words: list[str],
    question_terms: list[str],
    corpus: _Corpus,
    memory: list[_MemoryMatch],
    max_items: int,
) -> tuple[list[_Match], bool, str]:
    """The answer's supporting matches (at most `max_items`, best first), whether it is grounded,
    and why; a grounded reason holds `_PAGE` where the best match's page goes."""
    if not (answer or "").strip():
        return [], False, "No answer was given."
    normalized = normalize_answer(answer or "")
    if not normalized or not words:
        return [], False, "The answer has no words or numbers to look up."
    if says_not_in_document(answer or ""):
        return [], False, "No answer: the model said the document does not give one."
    if normalized in _YES_NO:
        return [], False, "A yes/no answer cannot be traced to a passage; see the memory evidence."
    short = sum(map(len, words)) < SHORT_ANSWER_MIN_CHARS or all(w.isdigit() for w in words)
    specific = not short and len(_content_words(answer or "")) >= SPECIFIC_ANSWER_MIN_WORDS
    phrase = " ".join(words)

    terms = [t for t in question_terms if not any(_term_matches(t, w) for w in words)]
    required = min(SPECIFIC_MIN_TERMS if specific else SHORT_MIN_TERMS, len(terms))
    positions = {t: _term_positions(corpus, t) for t in terms}
    supporters = [
        m.match
        for m in memory
        if m.match.score >= MEMORY_SUPPORT_MIN_SCORE and f" {phrase} " in f" {m.phrase} "
    ]
    strongest = len(terms) + bool(supporters)

    def judge(match: _Match) -> _Candidate:
        _, lo, hi = corpus.locate(match.start)
        window_start = max(lo, match.start - CONTEXT_CHARS)
        window_end = min(hi, match.end + CONTEXT_CHARS)
        near = tuple(
            t
            for t in terms
            if _any_in(positions[t], window_start, match.start)
            or _any_in(positions[t], match.end, window_end)
        )
        supported = any(s.start <= match.start and match.end <= s.end for s in supporters)
        return _Candidate(match, near, supported)

    def accepted(candidate: _Candidate) -> bool:
        if required:
            return len(candidate.terms) >= required or candidate.memory_support
        return specific or candidate.memory_support

    good: list[_Candidate] = []
    found = unbeatable = 0
    for hit in corpus.occurrences(_phrase_pattern(words)):
        found += 1
        candidate = judge(_Match(hit.start(), hit.end(), 100.0))
        if accepted(candidate):
            good.append(candidate)
            unbeatable += candidate.strength == strongest
            if unbeatable >= max(max_items, 1):
                break  # later matches can only tie, and ties go to the earliest
    if not good and not short:
        fuzzy = [
            judge(m)
            for m in corpus.align(answer or "", ANSWER_FUZZY_MIN_SCORE)
            if _numbers_in(words, corpus.text[m.start : m.end])
        ]
        found = max(found, len(fuzzy))
        good = [c for c in fuzzy if accepted(c)]
    if not good and found:
        reason = (
            f"The answer appears {found} time(s) in the text but never near the question's terms "
            "or a passage the memory recorded, so it may be a coincidence."
        )
        return [], False, reason
    if not good:
        return [], False, "The answer does not appear in the document."
    good.sort(key=lambda c: (-c.strength, -c.match.score, c.match.start))
    best = good[0]
    where = f"segment {corpus.segments[corpus.locate(best.match.start)[0]].index}{_PAGE}"
    score = best.match.score
    how = "exactly" if score == 100.0 else f"approximately (score {score:.0f})"
    if best.terms:
        why = "next to the question's terms " + ", ".join(repr(t) for t in best.terms)
    elif best.memory_support:
        why = "inside a passage the memory recorded"
    else:
        why = "and itself covers the question's terms"
    return [c.match for c in good[:max_items]], True, f"The answer appears {how} in {where} {why}."


def _ground_date(
    answer: str,
    question: str,
    terms: list[str],
    corpus: _Corpus,
    memory: list[_MemoryMatch],
    max_items: int,
) -> tuple[list[_Match], bool, str] | None:
    """The date rule (see the module's docstring); None when the question does not ask for a
    date, the answer states several, or gives none at all."""
    if not asks_for_date(question) or not answer.strip() or says_not_in_document(answer):
        return None
    stated = set(find_dates(answer))
    if not stated:
        return [], False, "The question asks for a date and the answer states none."
    if len(stated) > 1:
        return None
    (date,) = stated
    sites = [(start, end) for start, end, d in date_sites(corpus.text) if d == date]
    if not sites:
        return [], False, f"The answer's date ({date.isoformat()}) is not printed in the document."
    spellings = dict.fromkeys(
        corpus.text[start:end] for start, end in sites if not _in_running_line(corpus, start)
    )
    if not spellings:
        return (
            [],
            False,
            (
                f"The answer's date ({date.isoformat()}) is printed only in a line printed on "
                "page after page (a running header or footer), which dates the copy, not what "
                "the question asks."
            ),
        )
    refusal = None
    for spelling in spellings:
        matches, grounded, reason = _ground(
            spelling, _words(spelling), terms, corpus, memory, max(max_items, 1)
        )
        if grounded:
            return matches, True, f"The answer's date is printed as {spelling!r}. {reason}"
        refusal = refusal or (matches, grounded, reason)
    return refusal


def _ground_figure(
    answer: str, question: str, corpus: _Corpus, max_items: int
) -> tuple[list[_Match], bool, str] | None:
    """The figure rule (see the module's docstring); None when the answer does not state
    exactly one figure or says the document does not tell."""
    figures = find_figures(answer)
    if len(figures) != 1 or says_not_in_document(answer):
        return None
    stated = figures[0]
    asks_for_amount = _ASKS_FOR_MONEY.search(question) or _ASKS_FOR_A_SHARE.search(question)
    if not (_is_amount(stated) or (asks_for_amount and _is_bare(answer))):
        return None
    besides = _content_words(answer[: stated.start] + " " + answer[stated.end :])
    if len([w for w in besides if w not in _UNIT_WORDS]) > FIGURE_ANSWER_MAX_WORDS:
        return None  # a sentence with a figure in it: the general rule matches it whole
    shown = answer.strip()[stated.start : stated.end] or "the figure"
    if not _is_amount(stated) and abs(stated.value) < 10 and not stated.decimals:
        return [], False, f"{shown} alone is no amount: a filing prints it as a note or footnote."
    printed, good = _figure_sites(stated, question, corpus)
    if good and not stated.percent and _ASKS_FOR_A_CHANGE.search(question):
        good = [site for site in good if not site[2]]  # a table's cells are levels
        if not good:
            return (
                [],
                False,
                (
                    f"The question asks for a change, and {shown} is printed only as a table "
                    "cell: a level of one period, not the change between periods."
                ),
            )
    if not good:
        if printed:
            return (
                [],
                False,
                (
                    f"{shown} is printed {printed} time(s), but never in a table row or "
                    "sentence that names the question's terms, so it may be another line's figure."
                ),
            )
        return [], False, f"{shown} is not printed in the document."
    best, near, is_row = good[0]
    kind = "table row" if is_row else "sentence"
    where = f"segment {corpus.segments[corpus.locate(best.start)[0]].index}{_PAGE}"
    named = ", ".join(repr(t) for t in near)
    matches = [match for match, _, _ in good[:max_items]]
    return (
        matches,
        True,
        f"{shown} is printed in a {kind} with the question's terms {named}, in {where}.",
    )


def _figure_sites(
    stated: Figure, question: str, corpus: _Corpus
) -> tuple[int, list[tuple[_Match, list[str], bool]]]:
    """How often the figure `stated` is printed, and where it is printed in a record that names
    the question's key terms (best first: most terms, then earliest), each with the terms found
    and whether the record is a table row."""
    owners = frozenset(_lower(owner) for owner in _POSSESSOR.findall(question))
    dropped = PERIOD_WORDS | KIND_WORDS | _ASKING_WORDS | owners
    terms = [t for t in _question_terms(question, dropped) if not t.isdigit()]
    counts = {t: n for t in terms if (n := len(_term_positions(corpus, t)))}
    keys = {t for t in counts if counts[t] <= KEY_TERM_SPREAD * min(counts.values())}
    asked = period_keys(question.lower())
    money = bool(_ASKS_FOR_MONEY.search(question)) and not stated.percent
    printed = [
        f for f in find_figures(corpus.text) if _states(stated, f) and not (money and f.percent)
    ]
    good: list[tuple[int, _Match, list[str], bool]] = []
    for figure in printed:
        start, end, is_row = _record(corpus, figure.start)
        record = corpus.text[start:end]
        label, cell, cells = _headed_parts(record, figure.start - start) if is_row else ("",) * 3
        words = _TOKEN.findall(f"{label} {cell}" if cells else record)
        near = [t for t in counts if any(_term_matches(t, w) for w in words)]
        needed = 1 if is_row else min(FIGURE_SENTENCE_MIN_TERMS, len(counts))
        if not keys.intersection(near) or len(near) < needed:
            continue
        if cells and other_period(cell, cells, asked):
            continue
        if is_row and not cells and not _first_amount(record, figure.start - start):
            continue
        good.append((-len(near), _Match(figure.start, figure.end, 100.0), near, is_row))
    good.sort(key=lambda item: (item[0], item[1].start))
    return len(printed), [(match, near, is_row) for _, match, near, is_row in good]


def _first_amount(row: str, at: int) -> bool:
    """Whether the figure at `at` is the first amount of a row printed without its headers."""
    return next((f.start for f in find_figures(row) if _is_amount(f)), at) >= at


def _names_an_amount(answer: str, question: str, corpus: _Corpus) -> bool:
    """Whether one of the amounts an answer states is printed in a record that names the
    question's key terms (True for an answer without amounts)."""
    amounts = [f for f in find_figures(answer) if _is_amount(f)]
    return not amounts or any(_figure_sites(f, question, corpus)[1] for f in amounts)


def _headed_parts(row: str, at: int) -> tuple[str, str, str]:
    """A row written with its column headers ("aws, net sales: three months ended june 30, 2022
    $ 19,739; three months ended june 30, 2023 $ 22,140"), split around the figure at `at`: its
    label, the figure's own cell (its column's header) and all its cells; three empty strings
    for a row without headers."""
    label, colon, cells = row.partition(": ")
    if not colon or at < len(label) + len(colon):
        return "", "", ""
    return label, row[max(row.rfind("; ", 0, at), len(label)) : at], cells


def _is_bare(answer: str) -> bool:
    """An answer that is a number and nothing else ("1", "-17", "1.20")."""
    return bool(_BARE_NUMBER.fullmatch(answer.strip().rstrip(".")))


def _is_amount(figure: Figure) -> bool:
    """A money amount, a percentage, a scaled figure or one of four digits or more: what tables
    print. Small counts ("60 days", "12 months") keep the general rule."""
    return figure.currency or figure.percent or figure.scale != 1.0 or abs(figure.value) >= 1000


def _states(answer: Figure, printed: Figure) -> bool:
    """Whether a printed figure is the answer's value, in any scale its heading may give it."""
    if printed.percent != answer.percent and answer.percent:
        return False
    if printed.significant < answer.significant:
        return False  # "16" printed cannot be the source of "16,465"
    scales = _SCALE_READINGS if printed.scale == 1.0 and not printed.percent else (printed.scale,)
    return any(same_figure(answer, replace(printed, scale=scale)) for scale in scales)


def _record(corpus: _Corpus, position: int) -> tuple[int, int, bool]:
    """The table row (a line of two figures or more) or the sentence around `position`, within
    its segment: its bounds in the corpus text and whether it is a row."""
    _, lo, hi = corpus.locate(position)
    text = corpus.text
    line_start, line_end = _line_bounds(corpus, position)
    # The corpus text is lower-cased, so the next line cannot tell wrapped prose from a row.
    if is_table_row(text[line_start:line_end]):
        return line_start, line_end, True
    floor, ceiling = max(lo, position - CONTEXT_CHARS), min(hi, position + CONTEXT_CHARS)
    starts = [m.end() for m in _RECORD_END.finditer(text, floor, position)]
    start = starts[-1] if starts else floor
    stop = _RECORD_END.search(text, position, ceiling)
    return start, stop.start() if stop else ceiling, False


def _line_bounds(corpus: _Corpus, position: int) -> tuple[int, int]:
    """The bounds of the line holding `position`, within its segment."""
    _, lo, hi = corpus.locate(position)
    start = max(lo, corpus.text.rfind("\n", lo, position) + 1)
    end = corpus.text.find("\n", position, hi)
    return start, hi if end < 0 else end


def _memory_matches(
    final_memory: str,
    corpus: _Corpus,
    min_score: float,
    answer_words: list[str],
    question_terms: list[str],
) -> list[_MemoryMatch]:
    """The best source match of the memory's most relevant sentences (those holding the answer,
    then those sharing most question terms), best first, one per span."""
    phrase = f" {' '.join(answer_words)} "

    def relevance(item: tuple[int, list[str]]) -> tuple[int, int, int]:
        index, words = item
        has_answer = bool(answer_words) and phrase in f" {' '.join(words)} "
        shared = sum(any(_term_matches(t, w) for w in words) for t in question_terms)
        return -has_answer, -shared, index

    sentences = _memory_sentences(final_memory)
    ranked = sorted(enumerate(_words(s) for s in sentences), key=relevance)
    found: list[_MemoryMatch] = []
    for index, words in ranked[:MAX_MEMORY_SENTENCES]:
        matches = corpus.align(sentences[index], min_score)
        if matches:
            found.append(_MemoryMatch(" ".join(words), matches[0]))
    found.sort(key=lambda m: (-m.match.score, m.match.start))
    spans: set[tuple[int, int]] = set()
    unique = []
    for m in found:
        if (m.match.start, m.match.end) not in spans:
            spans.add((m.match.start, m.match.end))
            unique.append(m)
    return unique


def _memory_sentences(memory: str) -> list[str]:
    """The memory's sentences, without bullets, the initial memory and dropped-lines markers."""
    sentences = []
    for line in memory.splitlines():
        line = _BULLET.sub("", line).strip()
        if not line or _DROPPED_MARKER.fullmatch(line):
            continue
        for sentence in _SENTENCE_BREAK.split(line):
            sentence = sentence.strip()
            if sentence.rstrip(".").lower() == INITIAL_MEMORY.lower():
                continue
            if sum(ch.isalnum() for ch in sentence) >= MEMORY_MIN_CHARS:
                sentences.append(sentence)
    return sentences


def _lower(text: str) -> str:
    """Lower case with the length kept, so offsets into the result are offsets into `text`."""
    lowered = text.lower()
    if len(lowered) == len(text):
        return lowered
    return "".join(low if len(low := ch.lower()) == 1 else ch for ch in text)


def _fold(text: str) -> str:
    """Lower case, punctuation turned into spaces: what fuzzy matching compares."""
    return _lower(text).translate(_FOLD).strip()


def _words(text: str) -> list[str]:
    """Lower-cased alphanumeric runs without articles (all of them if nothing else is left)."""
    tokens = _TOKEN.findall(_lower(text))
    return [t for t in tokens if t not in _ARTICLES] or tokens


def _content_words(text: str) -> list[str]:
    """Whitespace-separated words holding a letter or digit, stop words left out."""
    words = (" ".join(_TOKEN.findall(_lower(w))) for w in text.split())
    return [w for w in words if w and w not in STOP_WORDS]


def _question_terms(question: str, dropped: frozenset[str] = frozenset()) -> list[str]:
    terms: list[str] = []
    for token in _TOKEN.findall(_lower(question)):
        keep = len(token) >= 3 or any(c.isdigit() for c in token)
        if keep and token not in STOP_WORDS and token not in dropped and token not in terms:
            terms.append(token)
    return terms[:MAX_QUESTION_TERMS]


def _term_matches(term: str, word: str) -> bool:
    if any(c.isdigit() for c in term):
        return word == term
    return word.startswith(term[:STEM_CHARS])


def _term_positions(corpus: _Corpus, term: str) -> list[int]:
    if any(c.isdigit() for c in term):
        pattern = re.compile(re.escape(term) + _NUMBER_GOES_ON)
    else:
        pattern = re.compile(re.escape(term[:STEM_CHARS]))
    return [m.start() for m in corpus.occurrences(pattern)]


def _any_in(positions: list[int], start: int, end: int) -> bool:
    i = bisect.bisect_left(positions, start)
    return i < len(positions) and positions[i] < end


def _phrase_pattern(words: list[str]) -> re.Pattern[str]:
    return re.compile(_SEP.join(map(re.escape, words)) + _NUMBER_GOES_ON)


def _starts_word(text: str, position: int) -> bool:
    """Whether a word (or a whole number, not the tail of "1,025") starts at `position`."""
    if position == 0:
        return True
    before = text[position - 1]
    if before.isalnum():
        return False
    return not (
        before in ".,"
        and position >= 2
        and text[position - 2].isdigit()
        and text[position].isdigit()
    )


def _anchors(needle: str) -> list[tuple[str, int]]:
    """The needle's longest distinct content words of four characters or more, each with the
    offset of its first occurrence as a word."""
    offsets: dict[str, int] = {}
    for m in _TOKEN.finditer(needle):
        word = m.group()
        if len(word) >= 4 and word not in STOP_WORDS:
            offsets.setdefault(word, m.start())
    longest = sorted(offsets, key=len, reverse=True)[:ANCHORS_PER_NEEDLE]
    return [(word, offsets[word]) for word in longest]


def _numbers_in(words: list[str], quote: str) -> bool:
    quoted = set(_TOKEN.findall(quote))
    return all(w in quoted for w in words if any(c.isdigit() for c in w))


def _best_disjoint(matches: list[_Match]) -> list[_Match]:
    """The best-scoring matches that do not overlap a better one, best first."""
    kept: list[_Match] = []
    for match in sorted(matches, key=lambda m: (-m.score, m.start)):
        if all(match.end <= k.start or match.start >= k.end for k in kept):
            kept.append(match)
    return kept
