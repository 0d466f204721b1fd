"""Plain text, Markdown and logs: decoding bytes in whatever encoding they came in."""

from __future__ import annotations

import codecs
import re

from operators.parsing.base import (
    MARKDOWN_MIME,
    TEXT_MIME,
    ParsedText,
    ParseError,
    checked_text,
    normalize_newlines,
)

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


def parse_plain_text(data: bytes, text_format: str, declared_charset: str | None) -> ParsedText:
    text, warnings = decode_text(data, declared_charset)
    mime_type = MARKDOWN_MIME if text_format == "markdown" else TEXT_MIME
    return ParsedText(
        checked_text(normalize_newlines(text)), text_format, mime_type, None, tuple(warnings)
    )


def decode_text(data: bytes, declared_charset: str | None) -> tuple[str, list[str]]:
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
