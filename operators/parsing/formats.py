"""File names, compression and format detection: which parser a document needs."""

from __future__ import annotations

import bz2
import gzip
import io
import lzma
import re
import zipfile
import zlib
from collections.abc import Callable
from pathlib import PurePosixPath
from typing import IO
from urllib.parse import unquote, urlsplit

from operators.parsing.base import (
    DOCX_MIME,
    HTML_MIME,
    MARKDOWN_MIME,
    PDF_MIME,
    TEXT_MIME,
    ParseError,
    size_in_mib,
)

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


def file_name_of(name: str) -> str:
    """The last path component of a file name or URI, lower-cased."""
    path = unquote(urlsplit(name).path) if "://" in name else name
    return PurePosixPath(path.replace("\\", "/")).name.lower()


def format_extension(file_name: str) -> str:
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


def decompress(
    data: bytes, file_name: str, warnings: list[str], max_bytes: int
) -> tuple[bytes, str]:
    """Unpack one level of gzip/bzip2/xz, found by content; returns data and the inner name.
    Streams: at most `max_bytes` + 1 bytes are ever expanded, so a bomb costs no more."""
    suffix = PurePosixPath(file_name).suffix
    inner_name = file_name.removesuffix(suffix) if suffix in _COMPRESSED_SUFFIXES else file_name
    compression = _compression_of(data)
    if compression is None:
        if suffix in _COMPRESSED_SUFFIXES:
            warnings.append(f"named {suffix} but not {_COMPRESSED_SUFFIXES[suffix]}-compressed")
        return data, inner_name
    try:
        with _COMPRESSION_OPENERS[compression](io.BytesIO(data)) as stream:
            expanded = stream.read(max_bytes + 1)
    except (OSError, EOFError, lzma.LZMAError, zlib.error) as exc:
        raise ParseError(f"damaged {compression} file: {exc}") from exc
    if len(expanded) > max_bytes:
        raise ParseError(
            f"too large: {compression} content over the limit of {size_in_mib(max_bytes)} "
            "decompressed"
        )
    return expanded, inner_name


def split_mime_type(mime_type: str | None) -> tuple[str | None, str | None]:
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


def detect_format(
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
