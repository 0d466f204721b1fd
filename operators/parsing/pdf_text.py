"""PDF: text per page with pdfminer.six, a table's rows kept on one line each, damage and
encryption told apart.

pdfminer's layout puts a table's labels in one text box and each column of figures in another,
so its text read "iPhone", "Mac", ... and many lines later "51,334", "7,168", ...; `_rows` moves
each figure-only line onto its row's label line ("iPhone $ 51,334 $ 50,570 ..."), written with
its column headers where the table prints them (`pdf_headers`: "iPhone: Three Months Ended
April 1, 2023 $ 51,334; Three Months Ended March 26, 2022 $ 50,570; ..."), and every other box
keeps pdfminer's reading order. bench/pdf_tables.py (bench/results/pdf_tables.md)
measured this against pdfplumber's text (with and without layout), pypdfium2's and a wider
pdfminer char_margin on 10-Q filings, the CUAD contracts and multi-column reports: the others
read lines across the columns of multi-column pages, lose paragraph breaks or cost more time.

unstructured's `partition_pdf(strategy="fast")` joins the words at line breaks ("choice oflaw"),
so fewer of the CUAD gold clause spans are found in its text: memstream does not use it
(bench/results/pdf_parsers.md)."""

from __future__ import annotations

import bisect
import functools
import io
import logging
import re
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

from operators.parsing.base import (
    EXTRA_BLANK_LINES,
    PDF_MIME,
    TRAILING_SPACES,
    ParsedText,
    ParseError,
    describe_error,
    normalize_newlines,
)
from operators.parsing.pdf_headers import headed_rows

_logger = logging.getLogger(__name__)


# pdfminer loggers whose warnings mean lost content (corrupt streams, broken cross-references),
# as opposed to harmless quirks such as invalid colour values.
_PDF_DAMAGE_LOGGERS = (
    "pdfminer.pdftypes",
    "pdfminer.pdfparser",
    "pdfminer.pdfdocument",
    "pdfminer.psparser",
)
_MAX_LISTED_PAGES = 10
_MAX_PDF_ARRAY_ELEMENTS = 2_000_000
# pdfminer's layout, a table's figures on their row's line, written with their column headers
_PARSER = "pdf:pdfminer-headed-rows"


class _LibraryWarningCollector(logging.Handler):
    """Keeps what the PDF libraries log while this thread parses, instead of printing it."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self._current = threading.local()

    @contextmanager
    def collecting(self) -> Iterator[list[logging.LogRecord]]:
        records: list[logging.LogRecord] = []
        self._current.records = records
        try:
            yield records
        finally:
            self._current.records = None

    def emit(self, record: logging.LogRecord) -> None:
        records = getattr(self._current, "records", None)
        if records is not None and len(records) < 1000:
            records.append(record)


@functools.cache
def _pdf_warning_collector() -> _LibraryWarningCollector:
    """Route pdfminer's and pypdf's warnings to the collector; from then on what they log
    outside `collecting()` is dropped rather than printed."""
    collector = _LibraryWarningCollector()
    for library in ("pdfminer", "pypdf"):
        library_logger = logging.getLogger(library)
        library_logger.setLevel(logging.WARNING)
        library_logger.propagate = False
        library_logger.addHandler(collector)
    return collector


@dataclass(frozen=True)
class _PdfExtraction:
    page_texts: dict[int, str]  # 1-based page number -> text
    parser: str
    failure: Exception | None = None  # extraction stopped early


def parse_pdf(data: bytes, max_pages: int) -> ParsedText:
    with _pdf_warning_collector().collecting() as logged:
        reader, page_count = _open_pdf(data)
        # Counted from the page tree, before pdfminer lays out any page.
        if page_count > max_pages:
            raise ParseError(f"too large: {page_count:,} pages, over the limit of {max_pages:,}")
        extraction = _extract_pdf_text_with_pdfminer(data)
    page_starts, offset, pieces = [], 0, []
    for _, page_text in sorted(extraction.page_texts.items()):
        if page_text and pieces:
            offset += 2  # the "\n\n" between pages
        page_starts.append(offset)
        if page_text:
            pieces.append(page_text)
            offset += len(page_text)
    text = "\n\n".join(pieces)
    if not text.strip():
        if extraction.failure is not None:
            raise ParseError(f"damaged PDF: {describe_error(extraction.failure)}")
        if any(_pdf_page_has_images(page) for page in reader.pages):
            raise ParseError("no text layer (needs OCR)")
        raise ParseError("empty document")
    warnings = _pdf_damage_warnings(extraction, logged, page_count, len(text))
    image_only_pages = [
        number
        for number, page_text in extraction.page_texts.items()
        if not page_text and number <= page_count and _pdf_page_has_images(reader.pages[number - 1])
    ]
    if image_only_pages:
        listed = ", ".join(map(str, image_only_pages[:_MAX_LISTED_PAGES]))
        more = ", ..." if len(image_only_pages) > _MAX_LISTED_PAGES else ""
        warnings.append(
            f"{len(image_only_pages)} of {page_count} pages have no text layer "
            f"(need OCR): pages {listed}{more}"
        )
    unmapped_glyphs = text.count("(cid:")
    if unmapped_glyphs:
        warnings.append(f"{unmapped_glyphs} glyphs have no Unicode mapping and appear as (cid:N)")
    return ParsedText(
        text, extraction.parser, PDF_MIME, page_count, tuple(warnings), tuple(page_starts)
    )


def _open_pdf(data: bytes) -> tuple[Any, int]:
    """Open with pypdf to classify the file: encrypted, broken, or readable with N pages."""
    from pypdf import PasswordType, PdfReader, apply_configuration
    from pypdf.errors import DependencyError

    try:
        # A 10-Q of the shared corpora holds an array of over 100,000 elements, pypdf's default
        # limit; a larger bound still stops a hostile one.
        with apply_configuration(array_maximum_element_count=_MAX_PDF_ARRAY_ELEMENTS):
            reader = PdfReader(io.BytesIO(data), strict=False)
            # An empty user password is common ("owner password only") and opens silently.
            if reader.is_encrypted and reader.decrypt("") == PasswordType.NOT_DECRYPTED:
                raise ParseError("password required")
            return reader, len(reader.pages)
    except ParseError:
        raise
    except DependencyError as exc:
        raise ParseError(f"encrypted PDF needs an extra library: {exc}") from exc
    except NotImplementedError as exc:
        raise ParseError(f"unsupported PDF encryption: {exc}") from exc
    except Exception as exc:
        raise ParseError(f"damaged PDF: {describe_error(exc)}") from exc


def _extract_pdf_text_with_pdfminer(data: bytes) -> _PdfExtraction:
    from pdfminer.high_level import extract_pages
    from pdfminer.layout import LAParams

    page_texts: dict[int, str] = {}
    try:
        # all_texts: also lay out text inside figures (form XObjects), where some PDF writers
        # put every page's whole content.
        for layout in extract_pages(io.BytesIO(data), laparams=LAParams(all_texts=True)):
            page_text = normalize_newlines(_layout_text(layout))
            page_text = TRAILING_SPACES.sub("\n", page_text)
            page_texts[len(page_texts) + 1] = EXTRA_BLANK_LINES.sub("\n\n", page_text).strip()
    except Exception as exc:
        return _PdfExtraction(page_texts, _PARSER, failure=exc)
    return _PdfExtraction(page_texts, _PARSER)


def _layout_text(layout_item: Any) -> str:
    """Text of a pdfminer layout tree, one blank line after each text box (as pdf2txt does),
    with a table's figures on the line of their row's label (`_rows`), under their column
    headers where the table has them (`headed_rows`)."""
    from pdfminer.layout import LTContainer, LTText, LTTextBox, LTTextLineHorizontal

    joined, moved = _rows(layout_item)
    headed = headed_rows(_text_lines(layout_item), joined)
    parts: list[str] = []

    def collect(item: Any) -> None:
        if isinstance(item, LTTextLineHorizontal) and (id(item) in moved or id(item) in joined):
            if id(item) in headed:
                parts.append(headed[id(item)] + "\n")
            elif id(item) in joined:
                figures = " ".join(line.get_text().strip() for line in joined[id(item)])
                parts.append(f"{item.get_text().rstrip()} {figures}\n")
        elif isinstance(item, LTContainer):
            for child in item:
                collect(child)
        elif isinstance(item, LTText):
            parts.append(item.get_text())
        if isinstance(item, LTTextBox):
            parts.append("\n")

    collect(layout_item)
    return "".join(parts)


def _text_lines(layout_item: Any) -> list[Any]:
    from pdfminer.layout import LTContainer, LTTextLineHorizontal

    if isinstance(layout_item, LTTextLineHorizontal):
        return [layout_item]
    if isinstance(layout_item, LTContainer):
        return [line for child in layout_item for line in _text_lines(child)]
    return []


# A table cell: a figure such as 39,669, (1,234), 12.5% or $3.5, or a lone "$" or dash.
_FIGURE_CELL = re.compile(r"[\d\s$€£¥%().,+\-\u2013\u2014]+")  # \u2013, \u2014: en, em dash
_SHORT_CELL = 2  # characters, for a cell without a digit ("$", "—")


def _is_figure_cell(text: str) -> bool:
    text = text.strip()
    return bool(_FIGURE_CELL.fullmatch(text)) and (
        any(c.isdigit() for c in text) or len(text.replace(" ", "")) <= _SHORT_CELL
    )


def _rows(layout_item: Any) -> tuple[dict[int, list[Any]], set[int]]:
    """Where a table's figures go. pdfminer cuts a text line at a gap wider than two characters,
    so a row's label and its figures land in different text boxes, one per column, and the
    labels come out many lines before their figures. Each figure line of a box that is mostly
    figures (a column of them, perhaps under a heading) is moved onto the line of another box
    that ends to its left on the same row (the one that shares the most of its height, then the
    nearest). Returns the label lines' ids with their figure lines in left-to-right order, and
    the ids of the lines moved."""
    from pdfminer.layout import LTContainer, LTTextBox, LTTextLineHorizontal

    boxes: list[Any] = []

    def find_boxes(item: Any) -> None:
        if isinstance(item, LTTextBox):
            boxes.append(item)
        elif isinstance(item, LTContainer):
            for child in item:
                find_boxes(child)

    find_boxes(layout_item)
    figures, others = [], []
    for box in boxes:
        lines = [line for line in box if isinstance(line, LTTextLineHorizontal)]
        cells = {id(line) for line in lines if _is_figure_cell(line.get_text())}
        if 2 * len(cells) > len(lines):
            figures.extend(line for line in lines if id(line) in cells)
            others.extend(line for line in lines if id(line) not in cells)
        else:
            others.extend(lines)
    if not figures or not others:
        return {}, set()
    others.sort(key=lambda line: line.y0)
    bottoms = [line.y0 for line in others]
    tallest = max(line.height for line in others)
    joined: dict[int, list[Any]] = {}
    for figure in figures:
        best, best_key = None, (0.0, 0.0)
        low = bisect.bisect_left(bottoms, figure.y0 - tallest)
        high = bisect.bisect_right(bottoms, figure.y1)
        for line in others[low:high]:
            overlap = min(line.y1, figure.y1) - max(line.y0, figure.y0)
            if (
                line.x1 > figure.x0 + 1
                or overlap <= 0
                or overlap < 0.5 * min(line.height, figure.height)
            ):
                continue
            key = (overlap / max(line.height, figure.height), line.x1)
            if key > best_key:
                best, best_key = line, key
        if best is not None:
            joined.setdefault(id(best), []).append(figure)
    for row in joined.values():
        row.sort(key=lambda line: line.x0)
    return joined, {id(line) for row in joined.values() for line in row}


def _pdf_damage_warnings(
    extraction: _PdfExtraction, logged: list[logging.LogRecord], page_count: int, recovered: int
) -> list[str]:
    warnings: list[str] = []
    if extraction.failure is not None:
        warnings.append(
            f"damaged PDF: text extraction stopped after page "
            f"{len(extraction.page_texts)} of {page_count} "
            f"({describe_error(extraction.failure)}); recovered {recovered} characters"
        )
    elif 0 < len(extraction.page_texts) < page_count:
        warnings.append(
            f"damaged PDF: only {len(extraction.page_texts)} of {page_count} pages "
            f"could be read; recovered {recovered} characters"
        )
    damage_messages = dict.fromkeys(
        record.getMessage() for record in logged if record.name.startswith(_PDF_DAMAGE_LOGGERS)
    )
    if damage_messages:
        warnings.append(
            f"damaged PDF: recovered {recovered} characters "
            f"({'; '.join(list(damage_messages)[:3])})"
        )
    return warnings


def _pdf_page_has_images(page: Any) -> bool:
    try:
        return len(page.images) > 0
    except Exception:
        return False
