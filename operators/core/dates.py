"""Calendar dates stated in text, in the spellings contracts and filings use.

"3/14/2018", "3-14-18", "March 14, 2018", "Mar. 14, 2018", "14 March 2018", "the 14th day of
March, 2018" and "2018-03-14" all state the same date. Numeric dates are read month first, as
US contracts and filings print them; a two-digit year is of this century below 70. A PDF's
text may split an ordinal ("16t h day of May"), which is read as well. Impossible dates
("2/30/2018") are not dates.
"""

from __future__ import annotations

import datetime
import re
from collections.abc import Iterable, Iterator

_MONTH_NAMES = [
    "january", "february", "march", "april", "may", "june",
    "july", "august", "september", "october", "november", "december",
]  # fmt: skip
_MONTH_ALIASES = {name[:3]: number for number, name in enumerate(_MONTH_NAMES, 1)} | {"sept": 9}
_MONTH = r"(?P<month>" + "|".join(_MONTH_NAMES + sorted(_MONTH_ALIASES)) + r")\.?"
_DAY = r"(?P<day>\d{1,2})"
_YEAR = r"(?P<year>\d{4})"
_ORDINAL = r"(?:\s?(?:s\s?t|n\s?d|r\s?d|t\s?h))?"

_PATTERNS = (
    re.compile(r"\b(?P<month>\d{1,2})([/.-])" + _DAY + r"\2(?P<year>\d{4}|\d{2})(?![\d/.-]\d)"),
    re.compile(r"\b" + _YEAR + r"-(?P<month>\d{1,2})-" + _DAY + r"\b"),
    re.compile(r"\b" + _MONTH + r"\s+" + _DAY + _ORDINAL + r",?\s+" + _YEAR + r"\b", re.I),
    re.compile(
        r"\b" + _DAY + _ORDINAL + r"\s+(?:day\s+of\s+)?" + _MONTH + r",?\s+" + _YEAR + r"\b", re.I
    ),
)
# The question asks for a date when it names one ("On what date ...", "the effective date").
_ASKS_FOR_DATE = re.compile(r"\bdates?\b", re.I)
_CENTURY_SPLIT = 70


def find_dates(text: str) -> list[datetime.date]:
    """The dates `text` states, in order of their first mention, each once."""
    found: dict[datetime.date, int] = {}
    for start, _, date in sorted(date_sites(text)):
        found.setdefault(date, start)
    return list(found)


def date_sites(text: str) -> Iterator[tuple[int, int, datetime.date]]:
    """Where `text` states a date: (start, end, date) of each spelling, by spelling."""
    for pattern in _PATTERNS:
        for match in pattern.finditer(text):
            date = _date(match)
            if date is not None:
                yield match.start(), match.end(), date


def states_date(answer: str | None, golds: Iterable[str]) -> bool:
    """Whether the answer states the gold date (the golds are spellings of one date) and no
    other date."""
    stated = set(find_dates(answer or ""))
    gold = {date for spelling in golds for date in find_dates(spelling)}
    return bool(stated) and stated <= gold


def asks_for_date(question: str) -> bool:
    return bool(_ASKS_FOR_DATE.search(question))


def _date(match: re.Match[str]) -> datetime.date | None:
    month_text = match["month"].lower().rstrip(".")
    month = int(month_text) if month_text.isdigit() else _month_number(month_text)
    year = int(match["year"])
    if len(match["year"]) == 2:
        year += 2000 if year < _CENTURY_SPLIT else 1900
    try:
        return datetime.date(year, month, int(match["day"]))
    except ValueError:
        return None


def _month_number(name: str) -> int:
    if name in _MONTH_NAMES:
        return _MONTH_NAMES.index(name) + 1
    return _MONTH_ALIASES[name]
