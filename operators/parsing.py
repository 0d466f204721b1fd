"""Turn the raw bytes of one untrusted input document into plain text.

`parse_document` is the only entry point. It either returns a `ParsedDocument` or raises
`ParseError` with a short reason meant for people (an error row, a CLI message); any other
exception would be a bug in this module, so unexpected library failures are turned into a
`ParseError` as well.

Formats: PDF (unstructured "fast" when it can run offline, else pdfminer.six; pypdf opens the
file first to tell encryption and a broken page tree apart from "no text"), DOCX (python-docx),
HTML (BeautifulSoup), Markdown, plain text in common encodings, and logs; any of them may come
gzip-, bzip2- or xz-compressed.
"""

from __future__ import annotations

import bz2
import codecs
import dataclasses
import functools
import gzip
import importlib.util
import io
import logging
import lzma
import os
import re
import threading
import zipfile
import zlib
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import PurePosixPath
from typing import IO, Any
from urllib.parse import unquote, urlsplit
from xml.etree import ElementTree

_logger = logging.getLogger(__name__)

# Decompressed archives and DOCX packages bigger than this are refused (decompression bombs).
MAX_EXPANDED_BYTES = 1 << 30

PDF_MIME = "application/pdf"
DOCX_MIME = "application/vnd.openxmlformats-officedocument.wordprocessingml.document"
HTML_MIME = "text/html"
MARKDOWN_MIME = "text/markdown"
TEXT_MIME = "text/plain"


@dataclass(frozen=True)
class ParsedDocument:
    text: str
    # "text", "markdown", "log", "html", "docx", "pdf:unstructured-fast" or "pdf:pdfminer"
    parser: str
    mime_type: str
    pages: int | None  # PDFs; DOCX when the authoring application recorded it; else None
    warnings: tuple[str, ...] = ()
    # PDFs: the character offset in `text` where page i + 1 starts (a page without text holds
    # only the blank line between its neighbours); empty for formats without pages.
    page_starts: tuple[int, ...] = ()


class ParseError(Exception):
    """The document cannot be turned into text; `reason` says why, short and specific.

    Examples: 'password required', 'no text layer (needs OCR)', 'damaged PDF: Invalid object in
    /Pages', 'empty document', 'not a text file (binary content)', 'unsupported format: .pptx'.
    """

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


def parse_document(data: bytes, name: str, mime_type: str | None = None) -> ParsedDocument:
    """Extract the text of one document.

    `name` is the file name or URI; its extension picks the format (`.gz`, `.bz2` and `.xz` are
    unpacked first and the inner extension counts, as in `app.log.1.gz`). Content sniffing wins
    over a missing, unknown or wrong extension. `mime_type` is an optional hint from the source
    (e.g. an HTTP Content-Type) used when name and content do not tell; its charset parameter
    decodes text that is not valid UTF-8.
    """
    try:
        return _parse(data, _file_name(name), mime_type)
    except ParseError:
        raise
    except Exception as exc:
        _logger.warning("unexpected failure while parsing %s", name, exc_info=True)
        raise ParseError(f"could not parse: {type(exc).__name__}: {_describe(exc)}") from exc


def _parse(data: bytes, file_name: str, mime_type: str | None) -> ParsedDocument:
    warnings: list[str] = []
    data, file_name = _decompress(data, file_name, warnings)
    if not data.strip():
        raise ParseError("empty document")
    extension = _format_extension(file_name)
    declared_type, declared_charset = _split_mime_type(mime_type)
    document_format = _detect_format(data, extension, declared_type, warnings)
    if document_format == "pdf":
        parsed = _parse_pdf(data)
    elif document_format == "docx":
        parsed = _parse_docx(data)
    elif document_format == "html":
        parsed = _parse_html(data, declared_charset)
    else:
        parsed = _parse_plain_text(data, document_format, declared_charset)
    if warnings:
        parsed = dataclasses.replace(parsed, warnings=(*warnings, *parsed.warnings))
    return parsed


# --- names, compression and format detection ---------------------------------------------------

_COMPRESSED_SUFFIXES = {".gz": "gzip", ".bz2": "bzip2", ".xz": "xz"}
_COMPRESSION_OPENERS: dict[str, Callable[[IO[bytes]], IO[bytes]]] = {
    "gzip": gzip.open,
    "bzip2": bz2.open,
    "xz": lzma.open,
}
_EXTENSION_FORMATS = {
    ".pdf": "pdf",
    ".docx": "docx",
    ".html": "html",
    ".htm": "html",
    ".xhtml": "html",
    ".md": "markdown",
    ".markdown": "markdown",
    ".txt": "text",
    ".text": "text",
    ".log": "log",
    ".out": "log",
    ".err": "log",
}
# Document formats recognised by name that this module cannot read; anything else unknown is
# sniffed and read as text when it is text.
# fmt: off
_UNSUPPORTED_EXTENSIONS = frozenset({
    ".doc", ".dot", ".docm", ".dotx", ".xls", ".xlsx", ".xlsm", ".ppt", ".pptx", ".odt", ".ods",
    ".odp", ".rtf", ".epub", ".zip", ".tar", ".tgz", ".7z", ".rar",
})
# fmt: on
_MIME_FORMATS = {
    PDF_MIME: "pdf",
    DOCX_MIME: "docx",
    HTML_MIME: "html",
    "application/xhtml+xml": "html",
    MARKDOWN_MIME: "markdown",
    "text/x-markdown": "markdown",
    TEXT_MIME: "text",
}
_HTML_START = re.compile(
    rb"^(\xef\xbb\xbf)?\s*(<\?xml[^>]*>\s*)?(<!--.*?-->\s*)*<(!doctype\s+html|html[\s>])",
    re.IGNORECASE | re.DOTALL,
)
_HTML_META_CHARSET = re.compile(rb"<meta[^>]+charset\s*=\s*[\"']?\s*([\w:.-]+)", re.IGNORECASE)


def _file_name(name: str) -> str:
    """The last path component of a file name or URI, lower-cased."""
    path = unquote(urlsplit(name).path) if "://" in name else name
    return PurePosixPath(path.replace("\\", "/")).name.lower()


def _format_extension(file_name: str) -> str:
    """The extension that names the format: '.log' for 'app.log.1', '' when there is none."""
    suffixes = PurePosixPath(file_name).suffixes
    if len(suffixes) >= 2 and suffixes[-1][1:].isdigit():
        return suffixes[-2]
    return suffixes[-1] if suffixes else ""


def _compression_of(data: bytes) -> str | None:
    if data.startswith(b"\x1f\x8b"):
        return "gzip"
    if data.startswith(b"BZh") and data[4:10] == b"1AY&SY":
        return "bzip2"
    if data.startswith(b"\xfd7zXZ\x00"):
        return "xz"
    return None


def _decompress(data: bytes, file_name: str, warnings: list[str]) -> tuple[bytes, str]:
    """Unpack one level of gzip/bzip2/xz, found by content; returns data and the inner name."""
    suffix = PurePosixPath(file_name).suffix
    inner_name = file_name.removesuffix(suffix) if suffix in _COMPRESSED_SUFFIXES else file_name
    compression = _compression_of(data)
    if compression is None:
        if suffix in _COMPRESSED_SUFFIXES:
            warnings.append(f"named {suffix} but not {_COMPRESSED_SUFFIXES[suffix]}-compressed")
        return data, inner_name
    try:
        with _COMPRESSION_OPENERS[compression](io.BytesIO(data)) as stream:
            expanded = stream.read(MAX_EXPANDED_BYTES + 1)
    except (OSError, EOFError, lzma.LZMAError, zlib.error) as exc:
        raise ParseError(f"damaged {compression} file: {exc}") from exc
    if len(expanded) > MAX_EXPANDED_BYTES:
        raise ParseError(f"{compression} content too large (over {MAX_EXPANDED_BYTES >> 20} MiB)")
    return expanded, inner_name


def _split_mime_type(mime_type: str | None) -> tuple[str | None, str | None]:
    """('text/html', 'iso-8859-1') from 'text/html; charset="ISO-8859-1"'."""
    if not mime_type:
        return None, None
    main_type, _, parameters = mime_type.partition(";")
    charset_match = re.search(r"charset\s*=\s*\"?([\w:.-]+)", parameters, re.IGNORECASE)
    return main_type.strip().lower(), charset_match.group(1).lower() if charset_match else None


def _sniff_container(data: bytes, named_format: str | None) -> str | None:
    """'pdf', 'docx' or 'zip' from the first bytes, None for anything else."""
    pdf_header_at = data.find(b"%PDF-", 0, 1024)
    # Readers accept a PDF header after some junk, but in a file named as text it is just text.
    if pdf_header_at == 0 or (pdf_header_at > 0 and named_format in (None, "pdf")):
        return "pdf"
    if data.startswith(b"PK\x03\x04"):
        try:
            with zipfile.ZipFile(io.BytesIO(data)) as archive:
                return "docx" if "word/document.xml" in archive.namelist() else "zip"
        except (zipfile.BadZipFile, OSError):
            return "zip"
    return None


def _detect_format(
    data: bytes, extension: str, declared_type: str | None, warnings: list[str]
) -> str:
    named_format = _EXTENSION_FORMATS.get(extension)
    sniffed_format = _sniff_container(data, named_format)
    if sniffed_format == "zip" and named_format != "docx":
        raise ParseError(f"unsupported format: {extension or 'ZIP archive'}")
    if sniffed_format == "zip":
        return "docx"  # a damaged one; the DOCX parser says what is wrong
    if sniffed_format is not None:
        if named_format is not None and named_format != sniffed_format:
            warnings.append(
                f"content is {sniffed_format.upper()} although the name ends in {extension}"
            )
        return sniffed_format
    if extension in _UNSUPPORTED_EXTENSIONS:
        raise ParseError(f"unsupported format: {extension}")
    looks_like_html = _HTML_START.match(data[:4096]) is not None
    if named_format in ("pdf", "docx") and looks_like_html:
        # Typically a web server's error page saved under the document's name.
        warnings.append(f"named {extension} but the content is HTML")
        return "html"
    if named_format is not None:
        return named_format
    if declared_type in _MIME_FORMATS:
        return _MIME_FORMATS[declared_type]
    return "html" if looks_like_html else "text"


# --- plain text --------------------------------------------------------------------------------

_BOMS = (
    (codecs.BOM_UTF32_LE, "utf-32-le"),  # before UTF-16 LE: its BOM starts the same way
    (codecs.BOM_UTF32_BE, "utf-32-be"),
    (codecs.BOM_UTF8, "utf-8"),
    (codecs.BOM_UTF16_LE, "utf-16-le"),
    (codecs.BOM_UTF16_BE, "utf-16-be"),
)
# C0 control bytes other than tab, line feed, vertical tab, form feed, carriage return and escape
# (ANSI colours in logs), plus DEL. Text has almost none; random bytes have about 11 %.
_CONTROL_BYTES = bytes([*range(0x00, 0x09), *range(0x0E, 0x1B), *range(0x1C, 0x20), 0x7F])
_MAX_CONTROL_SHARE = 0.05
_ENCODING_DETECTION_SAMPLE_BYTES = 1 << 20
_STRAY_BYTES_HANDLER = "memstream-cp1252-for-stray-bytes"
# What bytes that are not UTF-8 become when decoded with errors="surrogateescape".
_STRAY_BYTE_CHARS = re.compile("[\udc80-\udcff]")
_VALID_NON_ASCII_CHARS = re.compile("[^\x00-\x7f\udc80-\udcff]")


def _decode_stray_bytes_as_cp1252(error: UnicodeError) -> tuple[str, int]:
    if not isinstance(error, UnicodeDecodeError):
        raise error
    stray = error.object[error.start : error.end]
    # cp1252 leaves five bytes undefined; Latin-1 maps every byte.
    return "".join(bytes([b]).decode("cp1252", errors="ignore") or chr(b) for b in stray), error.end


codecs.register_error(_STRAY_BYTES_HANDLER, _decode_stray_bytes_as_cp1252)


def _parse_plain_text(
    data: bytes, text_format: str, declared_charset: str | None
) -> ParsedDocument:
    text, warnings = _decode_text(data, declared_charset)
    mime_type = MARKDOWN_MIME if text_format == "markdown" else TEXT_MIME
    return ParsedDocument(
        _checked_text(_normalize_newlines(text)), text_format, mime_type, None, tuple(warnings)
    )


def _decode_text(data: bytes, declared_charset: str | None) -> tuple[str, list[str]]:
    """Decode text bytes: BOM, UTF-8, declared charset, then charset detection.

    Valid UTF-8 wins over a declared charset: web servers and <meta> tags often name Latin-1
    for pages that are UTF-8, and the opposite mistake would not decode.
    """
    for bom, encoding in _BOMS:
        if data.startswith(bom):
            try:
                return data[len(bom) :].decode(encoding), []
            except UnicodeDecodeError:
                return data[len(bom) :].decode(encoding, errors="replace"), [
                    f"invalid {encoding} sequences replaced by U+FFFD"
                ]
    if _control_share(data) > _MAX_CONTROL_SHARE:
        raise ParseError("not a text file (binary content)")
    try:
        return data.decode("utf-8"), []
    except UnicodeDecodeError:
        pass
    if declared_charset:
        try:
            return data.decode(declared_charset), []
        except (LookupError, UnicodeDecodeError):
            pass
    utf8_text = data.decode("utf-8", errors="surrogateescape")
    stray_bytes = len(_STRAY_BYTE_CHARS.findall(utf8_text))
    valid_non_ascii = len(_VALID_NON_ASCII_CHARS.findall(utf8_text))
    if valid_non_ascii > stray_bytes:
        # Mostly UTF-8 with a few bytes from another encoding, as in appended-to logs.
        text = data.decode("utf-8", errors=_STRAY_BYTES_HANDLER)
        return text, [f"{stray_bytes} bytes were not valid UTF-8; decoded them as cp1252"]
    encoding = _detect_single_encoding(data[:_ENCODING_DETECTION_SAMPLE_BYTES])
    if encoding is None:
        return data.decode("latin-1"), ["encoding not recognised; decoded as Latin-1"]
    text = data.decode(encoding, errors="replace")
    # The guess comes from a sample; say so if the rest did not fit it.
    undecodable = text.count("\ufffd")
    if undecodable:
        return text, [f"{undecodable} byte sequences not valid in {encoding} replaced by U+FFFD"]
    return text, []


def _control_share(data: bytes) -> float:
    return (len(data) - len(data.translate(None, _CONTROL_BYTES))) / len(data)


def _detect_single_encoding(data: bytes) -> str | None:
    from charset_normalizer import from_bytes

    matches = from_bytes(data)
    best = matches.best()
    if best is None:
        return None
    # charset-normalizer often names cp1250 for Western text where cp1252 reads equally well
    # and is far more likely (e.g. 'crème' would come out as 'crčme').
    for match in matches:
        if match.chaos <= best.chaos and "cp1252" in match.could_be_from_charset:
            return "cp1252"
    return best.encoding


_TRAILING_SPACES = re.compile(r"[ \t]+\n")
_EXTRA_BLANK_LINES = re.compile(r"\n{3,}")


def _normalize_newlines(text: str) -> str:
    return text.replace("\r\n", "\n").replace("\r", "\n")


def _checked_text(text: str) -> str:
    if not text.strip():
        raise ParseError("empty document")
    return text


# --- HTML --------------------------------------------------------------------------------------

_HTML_DROPPED_TAGS = ("script", "style", "noscript", "template")
# fmt: off
_HTML_BLOCK_TAGS = (
    "address", "article", "aside", "blockquote", "caption", "dd", "details", "dialog", "div",
    "dl", "dt", "fieldset", "figcaption", "figure", "footer", "form", "h1", "h2", "h3", "h4",
    "h5", "h6", "header", "hgroup", "hr", "li", "main", "nav", "ol", "p", "pre", "section",
    "summary", "table", "title", "tr", "ul",
)
# fmt: on
_HTML_PREFORMATTED_TAGS = ("pre", "textarea")
_WHITESPACE_RUN = re.compile(r"\s+")


def _parse_html(data: bytes, declared_charset: str | None) -> ParsedDocument:
    from bs4 import BeautifulSoup

    meta_charset = _HTML_META_CHARSET.search(data[:4096])
    charset = declared_charset or (
        meta_charset.group(1).decode("ascii").lower() if meta_charset else None
    )
    markup, warnings = _decode_text(data, charset)
    rendered = _render_html_text(BeautifulSoup(markup, "lxml"))
    lines = (line.strip() for line in rendered.split("\n"))
    text = _EXTRA_BLANK_LINES.sub("\n\n", "\n".join(lines)).strip()
    return ParsedDocument(_checked_text(text), "html", HTML_MIME, None, tuple(warnings))


def _render_html_text(root: Any) -> str:
    """Visible text with a blank line around blocks, " | " between table cells.

    Source line breaks and indentation are not content in HTML, except in preformatted text.
    Walks the tree with its own stack: deeply nested markup must not hit the recursion limit.
    """
    from bs4 import NavigableString, Tag

    parts: list[str] = []
    preformatted_depth = 0
    cells_in_open_rows: list[int] = []
    stack: list[tuple[Any, bool]] = [(root, False)]  # (node, whether this is its closing)
    while stack:
        node, closing = stack.pop()
        if closing:
            if node.name in _HTML_PREFORMATTED_TAGS:
                preformatted_depth -= 1
            if node.name == "tr":
                cells_in_open_rows.pop()
            if node.name in _HTML_BLOCK_TAGS:
                parts.append("\n\n")
            continue
        if not isinstance(node, Tag):
            # Comments, doctypes and the like are NavigableString subclasses, not content.
            if type(node) is NavigableString:
                parts.append(node if preformatted_depth else _WHITESPACE_RUN.sub(" ", node))
            continue
        if node.name in _HTML_DROPPED_TAGS:
            continue
        if node.name == "br":
            parts.append("\n")
            continue
        if node.name in _HTML_PREFORMATTED_TAGS:
            preformatted_depth += 1
        if node.name == "tr":
            cells_in_open_rows.append(0)
        if node.name in ("td", "th") and cells_in_open_rows:
            if cells_in_open_rows[-1]:
                parts.append(" | ")
            cells_in_open_rows[-1] += 1
        if node.name in _HTML_BLOCK_TAGS:
            parts.append("\n\n")
        stack.append((node, True))
        stack.extend((child, False) for child in reversed(node.contents))
    return "".join(parts)


# --- DOCX --------------------------------------------------------------------------------------

_WORD_NS = "http://schemas.openxmlformats.org/wordprocessingml/2006/main"
_MARKUP_COMPATIBILITY_NS = "http://schemas.openxmlformats.org/markup-compatibility/2006"
_EXTENDED_PROPERTIES_NS = (
    "http://schemas.openxmlformats.org/officeDocument/2006/extended-properties"
)


def _parse_docx(data: bytes) -> ParsedDocument:
    try:
        import docx
    except ImportError as exc:
        raise ParseError("DOCX support is not installed (python-docx)") from exc
    from lxml.etree import LxmlError

    try:
        with zipfile.ZipFile(io.BytesIO(data)) as archive:
            if sum(member.file_size for member in archive.infolist()) > MAX_EXPANDED_BYTES:
                raise ParseError(f"DOCX content too large (over {MAX_EXPANDED_BYTES >> 20} MiB)")
            pages = _docx_recorded_page_count(archive)
        document = docx.Document(io.BytesIO(data))
        blocks = [block for block in _docx_blocks(document) if block.strip()]
    except (zipfile.BadZipFile, KeyError, ValueError, LxmlError, OSError) as exc:
        raise ParseError(f"damaged DOCX: {exc}") from exc
    text = _normalize_newlines("\n\n".join(blocks))
    return ParsedDocument(_checked_text(text), "docx", DOCX_MIME, pages)


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


# --- PDF ---------------------------------------------------------------------------------------

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


def _parse_pdf(data: bytes) -> ParsedDocument:
    with _pdf_warning_collector().collecting() as logged:
        reader, page_count = _open_pdf(data)
        extraction = _extract_pdf_text_with_unstructured(data, page_count)
        if extraction is None or not any(extraction.page_texts.values()):
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
            raise ParseError(f"damaged PDF: {_describe(extraction.failure)}")
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
    return ParsedDocument(
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
        raise ParseError(f"damaged PDF: {_describe(exc)}") from exc


def _extract_pdf_text_with_pdfminer(data: bytes) -> _PdfExtraction:
    from pdfminer.high_level import extract_pages
    from pdfminer.layout import LAParams

    page_texts: dict[int, str] = {}
    try:
        # all_texts: also lay out text inside figures (form XObjects), where some PDF writers
        # put every page's whole content.
        for layout in extract_pages(io.BytesIO(data), laparams=LAParams(all_texts=True)):
            page_text = _normalize_newlines(_layout_text(layout))
            page_text = _TRAILING_SPACES.sub("\n", page_text)
            page_texts[len(page_texts) + 1] = _EXTRA_BLANK_LINES.sub("\n\n", page_text).strip()
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


@functools.cache
def _unstructured_pdf_partitioner() -> Callable[..., list[Any]] | None:
    """unstructured's partition_pdf, or None where it cannot run offline.

    It needs the `unstructured[pdf]` extras and spaCy's en_core_web_sm model, which unstructured
    otherwise tries to download from GitHub into site-packages on first use.
    """
    if importlib.util.find_spec("en_core_web_sm") is None:
        return None
    os.environ.setdefault("DO_NOT_TRACK", "true")  # no usage ping from a document worker
    os.environ.setdefault("UNSTRUCTURED_DISABLE_NOTICE", "1")
    try:
        from unstructured.partition.pdf import partition_pdf
    except ImportError:
        return None
    return partition_pdf


def _extract_pdf_text_with_unstructured(data: bytes, page_count: int) -> _PdfExtraction | None:
    partition_pdf = _unstructured_pdf_partitioner()
    if partition_pdf is None:
        return None
    try:
        elements = partition_pdf(file=io.BytesIO(data), strategy="fast", languages=["eng"])
    except Exception:
        _logger.debug("unstructured could not partition a PDF; using pdfminer", exc_info=True)
        return None
    texts_by_page: dict[int, list[str]] = {number: [] for number in range(1, page_count + 1)}
    for element in elements:
        if element.text and element.text.strip():
            page_number = element.metadata.page_number or 1
            texts_by_page.setdefault(page_number, []).append(_normalize_newlines(element.text))
    page_texts = {number: "\n\n".join(texts) for number, texts in texts_by_page.items()}
    return _PdfExtraction(page_texts, "pdf:unstructured-fast")


def _pdf_damage_warnings(
    extraction: _PdfExtraction, logged: list[logging.LogRecord], page_count: int, recovered: int
) -> list[str]:
    warnings: list[str] = []
    if extraction.failure is not None:
        warnings.append(
            f"damaged PDF: text extraction stopped after page "
            f"{len(extraction.page_texts)} of {page_count} "
            f"({_describe(extraction.failure)}); recovered {recovered} characters"
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


def _describe(exc: Exception) -> str:
    return (str(exc).strip() or type(exc).__name__)[:200]
