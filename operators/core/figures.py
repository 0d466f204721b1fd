"""Figures in text, and whether an answer states a gold figure.

A filing prints "$ 39,669" under a header that says "(In millions)"; a right answer may say
"39,669", "$39,669 million" or "$39.7 billion". `states_figure` reads the figures of an answer
with their scale words and compares values, allowing for the rounding of the less precise side,
while a figure too coarse to tell ("8" for 8.1) does not count. Dates ("July 1, 2023", a bare
year) are not figures. An answer that dumps a whole table row (many figures) does not state one.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable
from dataclasses import dataclass

SCALES = {
    "thousand": 1e3,
    "thousands": 1e3,
    "k": 1e3,
    "million": 1e6,
    "millions": 1e6,
    "mn": 1e6,
    "m": 1e6,
    "mm": 1e6,
    "billion": 1e9,
    "billions": 1e9,
    "bn": 1e9,
    "b": 1e9,
    "trillion": 1e12,
}
# An answer may name the figure and one other (a comparison, a total); more is a dumped row.
MAX_OTHER_FIGURES = 1
# A figure with fewer significant digits than this (or than the gold's, if fewer) is too coarse.
MIN_SIGNIFICANT_DIGITS = 3

_MONTH = (
    r"(?:jan(?:uary)?|feb(?:ruary)?|mar(?:ch)?|apr(?:il)?|may|june?|july?|aug(?:ust)?"
    r"|sep(?:t(?:ember)?)?|oct(?:ober)?|nov(?:ember)?|dec(?:ember)?)\.?"
)
_FIGURE = re.compile(
    r"(?<![\w.,])(?P<open>\()?(?P<minus>[-\u2212\u2013])?\s?(?P<currency>\$)?\s?"
    r"(?P<number>\d{1,3}(?:,\d{3})+(?:\.\d+)?|\d+(?:\.\d+)?)(?![\w,]\d|\.\d)"
    r"(?P<close>\))?"
    r"(?:\s?(?P<percent>%|percent\b|per cent\b)"
    r"|\s?(?P<scale>" + "|".join(sorted(SCALES, key=len, reverse=True)) + r")\b)?",
    re.IGNORECASE,
)
_AFTER_MONTH = re.compile(_MONTH + r"\s*$", re.IGNORECASE)
# How far before a day a month's name is looked for ("September.", then some spaces): searching
# all the text before each number would make a long document's figures quadratic.
_MONTH_REACH = 24


@dataclass(frozen=True)
class Figure:
    """A number as printed: its value in its own scale, the scale word's factor (1 when none was
    printed), how many decimals and significant digits it has, and its unit if one was printed."""

    value: float
    scale: float
    decimals: int
    significant: int
    percent: bool
    currency: bool
    start: int
    end: int

    @property
    def absolute(self) -> float:
        return abs(self.value) * self.scale

    @property
    def half_step(self) -> float:
        """Half the unit of its last printed digit, in absolute terms: its rounding."""
        return 0.5 * 10.0 ** (-self.decimals) * self.scale


def find_figures(text: str) -> list[Figure]:
    """The figures of `text`, in order; years and days of dates are left out."""
    figures = []
    for match in _FIGURE.finditer(text):
        number = match["number"]
        digits = number.replace(",", "")
        scale_word = (match["scale"] or "").lower()
        if _is_date_part(text, match, number, scale_word):
            continue
        integer, _, fraction = digits.partition(".")
        significant = len((integer + fraction).lstrip("0")) or 1
        if not fraction:
            significant = len(integer.lstrip("0").rstrip("0")) or 1
        value = float(digits)
        if match["minus"] or (match["open"] and match["close"]):
            value = -value
        figures.append(
            Figure(
                value=value,
                scale=SCALES.get(scale_word, 1.0),
                decimals=len(fraction),
                significant=significant,
                percent=bool(match["percent"]),
                currency=bool(match["currency"]),
                start=match.start("number"),
                end=match.end(),
            )
        )
    return figures


def _is_date_part(text: str, match: re.Match[str], printed: str, scale_word: str) -> bool:
    """A bare year ("2023", not "2,023") or a day after a month name ("July 1")."""
    if match["currency"] or match["percent"] or scale_word or not printed.isdigit():
        return False
    number = int(printed)
    if len(printed) == 4 and 1900 <= number <= 2100:
        return True
    start = match.start()
    return number <= 31 and bool(_AFTER_MONTH.search(text, max(0, start - _MONTH_REACH), start))


def parse_gold(text: str) -> Figure:
    """The one figure of a gold answer such as "$39,669 million" or "12.5%"."""
    figures = find_figures(text)
    if len(figures) != 1:
        raise ValueError(f"a gold figure must hold exactly one number: {text!r}")
    return figures[0]


def same_figure(answer: Figure, gold: Figure) -> bool:
    """Whether `answer` states `gold`'s value. An answer without a scale word may give the
    number in the gold's printed scale ("39,669") or in full ("39,669,000,000"); signs are
    ignored ("a loss of $2,345 million" states -2,345)."""
    if answer.significant < min(MIN_SIGNIFICANT_DIGITS, gold.significant):
        return False
    readings = [answer]
    if answer.scale == 1.0 and not answer.percent:
        readings.append(
            Figure(**{**answer.__dict__, "scale": gold.scale})  # in the gold's printed scale
        )
    for reading in readings:
        tolerance = max(reading.half_step, gold.half_step) * (1 + 1e-9)
        if math.isclose(reading.absolute, gold.absolute) or (
            abs(reading.absolute - gold.absolute) <= tolerance
        ):
            return True
    return False


def states_figure(answer: str | None, golds: Iterable[str]) -> bool:
    """Whether the answer states one of the gold figures (alternative spellings of one value)
    and at most `MAX_OTHER_FIGURES` other figures."""
    if not answer:
        return False
    figures = find_figures(answer)
    gold_figures = [parse_gold(gold) for gold in golds]
    matching = [f for f in figures if any(same_figure(f, gold) for gold in gold_figures)]
    if not matching:
        return False
    others = {f.absolute for f in figures} - {f.absolute for f in matching}
    return len(others) <= MAX_OTHER_FIGURES


# A table row is at most this long: a paragraph parsed onto one line is not a row.
ROW_MAX_CHARS = 240
# A PDF's row written with its column headers ("AWS, Net sales: Three Months Ended June 30,
# 2022 $ 19,739; Three Months Ended ... $ 22,140"; operators.parsing.pdf_headers) is longer.
HEADED_ROW_MAX_CHARS = 1200
_HEADED_ROW = re.compile(r"[^:;\n]{1,200}: [^;\n]+(?:; [^;\n]+)+")
# A sentence ends inside the line, or ends it: "... to $28.5 billion.", "... 14%." (not "n.m.").
_SENTENCE_END = re.compile(r"(?<=[.?!])\s|(?<=[^.\s]{2}[.?!])$")
_LOWER_START = re.compile(r"\s*[a-z]")


def is_table_row(line: str, next_line: str = "") -> bool:
    """Whether `line` is a row of a table ("iPhone $ 39,669 $ 40,665"): two figures or more, at
    most `ROW_MAX_CHARS` (`HEADED_ROW_MAX_CHARS` for a row written with its column headers), no
    sentence end in it, and not continued by a lower-case word on `next_line` (wrapped prose
    is: "... compared to $4.1" / "billion a year earlier.")."""
    limit = HEADED_ROW_MAX_CHARS if _HEADED_ROW.fullmatch(line) else ROW_MAX_CHARS
    return (
        len(line) <= limit
        and not _SENTENCE_END.search(line)
        and not _LOWER_START.match(next_line)
        and len(find_figures(line)) >= 2
    )


# A value cell of a row written with its column headers (operators.parsing.pdf_headers writes
# them): 39,669, (1,234), 12.5, or a dash for nothing; "$ " before it and "%" after it attach.
HEADED_VALUE = r"\(?-?\d[\d,]*(?:\.\d+)?\)?|[\u2014\u2013-]+"
_HEADED_CELL = re.compile(rf"(?:(.*?) )?((?:\$ )?(?:{HEADED_VALUE})%?)")


def cells_as_lines(text: str) -> str:
    """`text` with each table row written with its column headers ("AWS, Operating income: Three
    Months Ended June 30, 2022 $ 5,715; Three Months Ended June 30, 2023 $ 5,365") split into one
    line a cell, each after the row's label ("AWS, Operating income, Three Months Ended June 30,
    2023: $ 5,365"): a small model picks a cell by the words beside it, not by its place in a
    row. Other lines are kept as they are."""
    lines = []
    for line in text.split("\n"):
        row = headed_cells(line)
        if row is None:
            lines.append(line)
            continue
        label, cells = row
        lines.extend(
            f"{label}, {header}: {value}" if header else f"{label}: {value}"
            for header, value in cells
        )
    return "\n".join(lines)


def headed_cells(line: str) -> tuple[str, list[tuple[str, str]]] | None:
    """A row written with its column headers, as its label and its (header, value) cells (the
    header is empty where the parser found none); None for any other line."""
    label, _, cells = line.partition(": ")
    parsed = [_HEADED_CELL.fullmatch(cell) for cell in cells.split("; ")]
    if not _HEADED_ROW.fullmatch(line) or not all(parsed):
        return None
    return label, [(cell[1] or "", cell[2]) for cell in parsed if cell]


# What tells a table's period columns apart: a year, or the span of months.
_PERIOD_KEYS = re.compile(r"\b(?:19|20)\d\d\b|\b(?:three|six|nine|twelve|q[1-4]|ytd|quarter)\b")
# What a period's words mean: a filing heads a quarter's column "Three Months Ended Jul 1, 2023"
# or "Q2 2023", and the year so far "Six Months Ended ..." or "YTD 2023".
_PERIOD_SPANS = {
    **dict.fromkeys(("three", "q1", "q2", "q3", "q4"), "quarter"),
    **dict.fromkeys(("six", "nine"), "ytd"),
}


def other_period(cell: str, cells: str, asked: set[str]) -> bool:
    """Whether a cell sits under another period than the question asks for: a year or a span
    ("three months" or "Q2", "six months" or "YTD") that the question names and that tells the
    row's columns apart is missing from the cell's header."""
    told_apart = asked & period_keys(cells)
    return bool(told_apart - period_keys(cell))


def period_keys(text: str) -> set[str]:
    """The years and spans (a quarter, the year to date, twelve months) that `text` names."""
    return {_PERIOD_SPANS.get(key, key) for key in _PERIOD_KEYS.findall(text)}
