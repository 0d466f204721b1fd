"""PDF: text per page with pdfminer.six, damage and encryption told apart.

unstructured's `partition_pdf(strategy="fast")` was measured against it on the CUAD contracts
(bench/pdf_parsers.py): it joins the words at line breaks ("choice oflaw"), so 0.391 of the gold
clause spans were found in its text against 0.935 in pdfminer's, at 2.1x pdfminer's time on the
longer reports; memstream does not use it."""

from __future__ import annotations

import functools
import io
import logging
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
    from pypdf import PasswordType, PdfReader
    from pypdf.errors import DependencyError

    try:
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
        return _PdfExtraction(page_texts, "pdf:pdfminer", failure=exc)
    return _PdfExtraction(page_texts, "pdf:pdfminer")


def _layout_text(layout_item: Any) -> str:
    """Text of a pdfminer layout tree, one blank line after each text box (as pdf2txt does)."""
    from pdfminer.layout import LTContainer, LTText, LTTextBox

    parts: list[str] = []

    def collect(item: Any) -> None:
        if isinstance(item, LTContainer):
            for child in item:
                collect(child)
        elif isinstance(item, LTText):
            parts.append(item.get_text())
        if isinstance(item, LTTextBox):
            parts.append("\n")

    collect(layout_item)
    return "".join(parts)


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
