"""HTML: the visible text, blocks on their own lines."""

from __future__ import annotations

import re
from typing import Any

from operators.parsing.base import (
    EXTRA_BLANK_LINES,
    HTML_MIME,
    ParsedText,
    checked_text,
)
from operators.parsing.plain_text import decode_text

_META_CHARSET = re.compile(rb"<meta[^>]+charset\s*=\s*[\"']?\s*([\w:.-]+)", re.IGNORECASE)


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


def parse_html(data: bytes, declared_charset: str | None) -> ParsedText:
    from bs4 import BeautifulSoup

    meta_charset = _META_CHARSET.search(data[:4096])
    charset = declared_charset or (
        meta_charset.group(1).decode("ascii").lower() if meta_charset else None
    )
    markup, warnings = decode_text(data, charset)
    rendered = _render_html_text(BeautifulSoup(markup, "lxml"))
    lines = (line.strip() for line in rendered.split("\n"))
    text = EXTRA_BLANK_LINES.sub("\n\n", "\n".join(lines)).strip()
    return ParsedText(checked_text(text), "html", HTML_MIME, None, tuple(warnings))


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
