"""A table row written as a sentence with its column headers.

A filing's row reads "Net sales $ 74,430 $ 82,546 $ 143,674 $ 159,427" under headers printed
above it in two or three lines ("Three Months Ended" / "June 30," / "2022  2023"), and perhaps
under a section label ("North America"). A small model picks the wrong column of such a row;
it reads "North America, Net sales: Three Months Ended June 30, 2022 $ 74,430; Three Months
Ended June 30, 2023 $ 82,546; ..." far better. `headed_rows` finds each row's headers by their
position on the page: the lines above the table's first row, over its figures' columns, each
column taking the nearest cell of every header line.
"""

from __future__ import annotations

import itertools
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from operators.core.figures import HEADED_VALUE

_VALUE = re.compile(HEADED_VALUE)
_YEAR = re.compile(r"(?:19|20)\d\d")
# Header lines above a table: at most this many a column, each at most this long (a longer line
# is prose).
MAX_HEADER_LINES = 5
MAX_HEADER_CHARS = 40
# A gap above the last line walked of more than this many line heights ends the headers.
MAX_HEADER_GAP = 4.0


@dataclass(frozen=True)
class _Cell:
    text: str
    x0: float
    x1: float

    @property
    def center(self) -> float:
        return (self.x0 + self.x1) / 2


def headed_rows(lines: Sequence[Any], joined: dict[int, list[Any]]) -> dict[int, str]:
    """The text of each row of `joined` (a label line's id: its figure lines, left to right) that
    has column headers, as "section, label: header value; header value; ...". `lines` are every
    horizontal text line of the page. Rows without headers (a table continued from the page
    before) are left out."""
    moved = {id(figure) for figures in joined.values() for figure in figures}
    bottom_first = sorted(lines, key=lambda line: line.y0)
    headed: dict[int, str] = {}
    for label in bottom_first:
        figures = joined.get(id(label))
        if not figures:
            continue
        values = _values(figures)
        if not values or _all_years(values):
            continue  # a header row of years beside "(In millions)", not a row of figures
        headers = _header_lines(label, values, bottom_first, joined, moved)
        if not headers:
            continue
        columns = _column_headers(values, headers)
        if not any(columns):
            continue
        section = _section(label, bottom_first, joined, moved, headers)
        name = label.get_text().strip()
        cells = "; ".join(
            f"{header} {value.text}" if header else value.text
            for header, value in zip(columns, values, strict=True)
        )
        headed[id(label)] = f"{section + ', ' if section else ''}{name}: {cells}"
    return headed


def _values(figures: Sequence[Any]) -> list[_Cell]:
    """The value cells of a row's figure lines with their positions, "$" and "%" attached."""
    values: list[_Cell] = []
    dollar = False
    for line in figures:
        chars = [(c.get_text(), getattr(c, "x0", None), getattr(c, "x1", None)) for c in line]
        text = "".join(char for char, _, _ in chars)
        for match in re.finditer(r"\$|%|" + _VALUE.pattern, text):
            token = match.group()
            if token == "$":
                dollar = True
                continue
            if token == "%":
                if values:
                    last = values[-1]
                    values[-1] = _Cell(last.text + "%", last.x0, last.x1)
                continue
            placed = [
                (x0, x1) for _, x0, x1 in chars[match.start() : match.end()] if x0 is not None
            ]
            if not placed:
                continue
            text_of_cell = f"$ {token}" if dollar else token
            values.append(_Cell(text_of_cell, placed[0][0], placed[-1][1]))
            dollar = False
    return values


def _header_lines(
    label: Any,
    values: list[_Cell],
    lines: Sequence[Any],
    joined: dict[int, list[Any]],
    moved: set[int],
) -> list[Any]:
    """The lines printed over the row's columns above its table (`lines` bottom first): walking
    up from the row past the table's other rows, the run of short lines right of the labels, up
    to the first line that is prose, another table's row, or far above."""
    left = min(value.x0 for value in values)
    right = max(value.x1 for value in values)
    pitch = _pitch(values)
    headers: list[Any] = []
    last_bottom = label.y0
    height = label.height
    for line in lines:
        if line.y0 < label.y1 - 0.5 * height or line is label:
            continue  # below or beside the row
        text = line.get_text().strip()
        if not text:
            continue
        if line.y0 - last_bottom > MAX_HEADER_GAP * height:
            break
        in_row = (
            id(line) in moved
            or (id(line) in joined and not _all_years(_values(joined[id(line)])))
            or _is_unlabelled_row(line)
        )
        if in_row:
            if headers:
                break  # a row of the table above
            last_bottom = line.y1
            continue
        if line.x1 <= left - 0.5 * pitch:  # a label, section label or "(In millions)"
            if not headers:
                last_bottom = line.y1
            continue
        if line.x0 < label.x1 or line.x1 > right + pitch or len(text) > MAX_HEADER_CHARS:
            break  # prose across the page
        headers.append(line)
        for year_line in joined.get(id(line), []):
            headers.append(year_line)
        last_bottom = line.y1
        if len(headers) >= MAX_HEADER_LINES * len(values):
            break
    return headers


def _is_unlabelled_row(line: Any) -> bool:
    """A line of figures only, not years: a subtotal printed without a label."""
    text = line.get_text()
    values = _values([line])
    rest = re.sub(r"\$|%|" + _VALUE.pattern, "", text).strip()
    return bool(values) and not rest and not _all_years(values)


def _all_years(values: list[_Cell]) -> bool:
    """Whether a row's values are all years: a header row ("2023  2022"), not figures."""
    return bool(values) and all(_YEAR.fullmatch(value.text) for value in values)


def _pitch(values: list[_Cell]) -> float:
    """The distance between neighbouring columns; a lone column's own width."""
    centers = [value.center for value in values]
    gaps = [b - a for a, b in itertools.pairwise(centers) if b > a]
    return min(gaps) if gaps else values[0].x1 - values[0].x0


def _column_headers(values: list[_Cell], headers: list[Any]) -> list[str]:
    """Each value's header, top line first: on every header line, the cell nearest the value's
    column, if the column lies within the cell's reach (a cell may span several columns)."""
    pitch = _pitch(values)
    header_rows: list[tuple[float, list[_Cell]]] = []  # (middle height, cells), top first
    for line in sorted(headers, key=lambda line: -line.y1):
        cell = _Cell(line.get_text().strip(), line.x0, line.x1)
        middle = (line.y0 + line.y1) / 2
        if header_rows and abs(header_rows[-1][0] - middle) < 0.5 * line.height:
            header_rows[-1][1].append(cell)
        else:
            header_rows.append((middle, [cell]))
    columns: list[str] = []
    for value in values:
        words = []
        for _, row in header_rows:
            nearest = min(row, key=lambda cell: abs(cell.center - value.center))
            reach = (nearest.x1 - nearest.x0) / 2 + pitch
            if abs(nearest.center - value.center) <= reach:
                words.append(nearest.text)
        columns.append(" ".join(words).rstrip(","))
    return columns


def _section(
    label: Any,
    lines: Sequence[Any],
    joined: dict[int, list[Any]],
    moved: set[int],
    headers: list[Any],
) -> str:
    """The label of the row's section: the nearest line above it, below the headers, in the
    labels' column, less indented, with no figures of its own ("North America")."""
    top = min((header.y0 for header in headers), default=float("inf"))
    candidates = [
        line
        for line in lines
        if label.y1 <= line.y0 < top
        and id(line) not in moved
        and id(line) not in joined
        and line.x0 < label.x0 - 2
        and line.get_text().strip()
    ]
    if not candidates:
        return ""
    nearest = min(candidates, key=lambda line: line.y0)
    return nearest.get_text().strip().rstrip(":")
