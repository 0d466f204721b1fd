"""Turn the raw bytes of one untrusted input document into plain text.

`parse_document` is the only entry point. It either returns a `ParsedText` or raises
`ParseError` with a short reason meant for people (an error row, a CLI message); any other
exception would be a bug in this module, so unexpected library failures are turned into a
`ParseError` as well.

Formats: PDF (pdfminer.six; pypdf opens the file first to tell encryption and a broken page tree
apart from "no text"), DOCX (python-docx), HTML (BeautifulSoup), Markdown, plain text in common
encodings, and logs; any of them may come gzip-, bzip2- or xz-compressed.
"""

from __future__ import annotations

import dataclasses
import logging

from operators.config import DocumentLimits
from operators.parsing.base import ParsedText, ParseError, check_char_limit, describe_error
from operators.parsing.docx_text import parse_docx
from operators.parsing.formats import (
    decompress,
    detect_format,
    file_name_of,
    format_extension,
    split_mime_type,
)
from operators.parsing.html_text import parse_html
from operators.parsing.pdf_text import parse_pdf
from operators.parsing.plain_text import parse_plain_text

__all__ = ["ParseError", "ParsedText", "parse_document"]
_logger = logging.getLogger(__name__)


def parse_document(
    data: bytes, name: str, mime_type: str | None = None, limits: DocumentLimits | None = None
) -> ParsedText:
    """Extract the text of one document.

    `name` is the file name or URI; its extension picks the format (`.gz`, `.bz2` and `.xz` are
    unpacked first and the inner extension counts, as in `app.log.1.gz`). Content sniffing wins
    over a missing, unknown or wrong extension. `mime_type` is an optional hint from the source
    (e.g. an HTTP Content-Type) used when name and content do not tell; its charset parameter
    decodes text that is not valid UTF-8. A document over one of `limits` (defaults:
    `DocumentLimits()`) raises `ParseError` naming the limit.
    """
    try:
        return _parse(data, file_name_of(name), mime_type, limits or DocumentLimits())
    except ParseError:
        raise
    except Exception as exc:
        _logger.warning("unexpected failure while parsing %s", name, exc_info=True)
        raise ParseError(f"could not parse: {type(exc).__name__}: {describe_error(exc)}") from exc


def _parse(
    data: bytes, file_name: str, mime_type: str | None, limits: DocumentLimits
) -> ParsedText:
    warnings: list[str] = []
    data, file_name = decompress(data, file_name, warnings, limits.max_expanded_bytes)
    if not data.strip():
        raise ParseError("empty document")
    extension = format_extension(file_name)
    declared_type, declared_charset = split_mime_type(mime_type)
    document_format = detect_format(data, extension, declared_type, warnings)
    if document_format == "pdf":
        parsed = parse_pdf(data, limits.max_pdf_pages)
    elif document_format == "docx":
        parsed = parse_docx(data, limits.max_expanded_bytes)
    elif document_format == "html":
        parsed = parse_html(data, declared_charset)
    else:
        # Every character takes at most 4 bytes: more bytes than that are over the limit
        # without decoding them.
        check_char_limit(len(data) // 4, limits.max_chars)
        parsed = parse_plain_text(data, document_format, declared_charset)
    check_char_limit(len(parsed.text), limits.max_chars)
    if warnings:
        parsed = dataclasses.replace(parsed, warnings=(*warnings, *parsed.warnings))
    return parsed
