"""DOCX: paragraphs, tables and text boxes in reading order."""

from __future__ import annotations

import io
import zipfile
from collections.abc import Iterator
from typing import Any
from xml.etree import ElementTree

from operators.parsing.base import (
    DOCX_MIME,
    MAX_DOCX_PARTS,
    ParsedText,
    ParseError,
    checked_text,
    normalize_newlines,
    size_in_mib,
)

_WORD_NS = "http://schemas.openxmlformats.org/wordprocessingml/2006/main"
_MARKUP_COMPATIBILITY_NS = "http://schemas.openxmlformats.org/markup-compatibility/2006"
_EXTENDED_PROPERTIES_NS = (
    "http://schemas.openxmlformats.org/officeDocument/2006/extended-properties"
)


def parse_docx(data: bytes, max_expanded_bytes: int) -> ParsedText:
    try:
        import docx
    except ImportError as exc:
        raise ParseError("DOCX support is not installed (python-docx)") from exc
    from lxml.etree import LxmlError

    try:
        with zipfile.ZipFile(io.BytesIO(data)) as archive:
            # The sizes a zip declares bound what reading it can expand to: zipfile stops
            # at a part's declared size (and fails its CRC) if the data would go on.
            members = archive.infolist()
            if len(members) > MAX_DOCX_PARTS:
                raise ParseError(f"too large: DOCX with over {MAX_DOCX_PARTS:,} parts")
            if sum(member.file_size for member in members) > max_expanded_bytes:
                raise ParseError(
                    f"too large: DOCX content over the limit of {size_in_mib(max_expanded_bytes)} "
                    "decompressed"
                )
            pages = _docx_recorded_page_count(archive)
        document = docx.Document(io.BytesIO(data))
        blocks = [block for block in _docx_blocks(document) if block.strip()]
    except (zipfile.BadZipFile, KeyError, ValueError, LxmlError, OSError) as exc:
        raise ParseError(f"damaged DOCX: {exc}") from exc
    text = normalize_newlines("\n\n".join(blocks))
    return ParsedText(checked_text(text), "docx", DOCX_MIME, pages)


def _docx_recorded_page_count(archive: zipfile.ZipFile) -> int | None:
    """The page count Word saved in docProps/app.xml (absent from generated files)."""
    try:
        properties = ElementTree.fromstring(archive.read("docProps/app.xml"))
    except (KeyError, ElementTree.ParseError):
        return None
    pages = properties.findtext(f"{{{_EXTENDED_PROPERTIES_NS}}}Pages")
    return int(pages) if pages and pages.strip().isdigit() and int(pages) > 0 else None


def _docx_blocks(container: Any) -> Iterator[str]:
    """Paragraphs and tables of a document or table cell, in reading order."""
    from docx.table import Table

    for block in container.iter_inner_content():
        if isinstance(block, Table):
            yield "\n".join(_docx_table_rows(block))
        else:
            yield block.text
            yield from _docx_text_boxes(block)


def _docx_table_rows(table: Any) -> Iterator[str]:
    for row in table.rows:
        cells = []
        for cell in row.cells:
            # python-docx repeats a horizontally merged cell once per grid column.
            if not cells or cell._tc is not cells[-1]._tc:
                cells.append(cell)
        yield " | ".join(" ".join(filter(None, _docx_blocks(cell))) for cell in cells)


def _docx_text_boxes(paragraph: Any) -> Iterator[str]:
    """Text of the text boxes anchored in a paragraph, which python-docx does not read."""
    from docx.text.paragraph import Paragraph

    for text_box in paragraph._p.iter(f"{{{_WORD_NS}}}txbxContent"):
        # Word stores each text box twice: as DrawingML and as a VML fallback.
        if any(
            ancestor.tag == f"{{{_MARKUP_COMPATIBILITY_NS}}}Fallback"
            for ancestor in text_box.iterancestors()
        ):
            continue
        for box_paragraph in text_box.iter(f"{{{_WORD_NS}}}p"):
            yield Paragraph(box_paragraph, paragraph).text
