"""operators.parsing on real documents from shared/corpora and on fixtures made here."""

from __future__ import annotations

import bz2
import gzip
import io
import lzma
import random
import re
import struct
import sys
import zipfile
import zlib
from collections.abc import Callable
from pathlib import Path

import pytest

from operators.core.evidence import page_of
from operators.parsing import ParsedText, ParseError, parse_document
from operators.parsing.base import DOCX_MIME

CORPORA = Path(__file__).resolve().parents[1].parent / "shared" / "corpora"
needs_corpora = pytest.mark.usefixtures("corpora")  # which fails when they are missing
PDFS = CORPORA / "pdfs"


def parse_corpus_file(relative_path: str) -> ParsedText:
    path = CORPORA / relative_path
    return parse_document(path.read_bytes(), path.name)


def corpus_parse_error(relative_path: str) -> str:
    with pytest.raises(ParseError) as raised:
        parse_corpus_file(relative_path)
    return raised.value.reason


def flattened(text: str) -> str:
    """Whitespace collapsed, so phrases match whether or not a parser keeps line breaks."""
    return " ".join(text.split())


# --- PDF ---------------------------------------------------------------------------------------


@needs_corpora
def test_pdf_encrypted_with_empty_user_password_opens_silently() -> None:
    parsed = parse_corpus_file("pdfs/reports/copyright-office-dmca-summary-1998.pdf")

    assert parsed.parser.startswith("pdf:")
    assert parsed.mime_type == "application/pdf"
    assert parsed.pages == 18
    assert len(parsed.page_starts) == 18 and list(parsed.page_starts) == sorted(parsed.page_starts)
    assert parsed.warnings == ()
    assert "The Digital Millennium Copyright Act (DMCA) was signed into law" in flattened(
        parsed.text
    )
    assert len(parsed.text) > 40_000


@needs_corpora
@pytest.mark.parametrize(
    "relative_path",
    ["pdfs/bad/encrypted-userpw-openpassword.pdf", "pdfs/bad/encrypted-aes256-userpw-baz.pdf"],
)
def test_pdf_with_user_password_needs_the_password(relative_path: str) -> None:
    assert corpus_parse_error(relative_path) == "password required"


@needs_corpora
def test_scanned_pdf_without_text_layer_needs_ocr() -> None:
    reason = corpus_parse_error("pdfs/bad/scanned-image-only-grumman-1974.pdf")

    assert reason == "no text layer (needs OCR)"


@needs_corpora
def test_damaged_but_recoverable_pdf_gives_text_and_a_warning() -> None:
    parsed = parse_corpus_file("pdfs/bad/corrupted-zen_of_python.pdf")

    assert 850 < len(parsed.text) < 1000
    assert "Beautiful is better than ugly." in parsed.text
    assert "Namespaces are one honking great idea" in parsed.text
    assert parsed.pages == 1
    assert any(
        warning.startswith(f"damaged PDF: recovered {len(parsed.text)} characters")
        for warning in parsed.warnings
    )


@needs_corpora
def test_pdf_with_broken_page_tree_fails_with_specific_reason() -> None:
    reason = corpus_parse_error("pdfs/bad/broken-invalid-pages-unreadablemetadata.pdf")

    assert reason == "damaged PDF: Invalid object in /Pages"


@needs_corpora
@pytest.mark.parametrize(
    ("relative_path", "pages", "phrase"),
    [
        (
            "pdfs/contracts/PhotronicsInc_20171219_10-QA_EX-10.28_10982650_EX-10.28_"
            "Outsourcing Agreement.pdf",
            11,
            "OUTSOURCING AGREEMENT",
        ),
        (
            "pdfs/contracts/VitalibisInc_20180316_8-K_EX-10.2_11100168_EX-10.2_"
            "Hosting Agreement.pdf",
            14,
            "SERVICES AND HOSTING AGREEMENT",
        ),
        (
            "pdfs/reports/NIST-SP800-40r3-patch-management.pdf",
            26,
            "Guide to Enterprise Patch Management Technologies",
        ),
        (
            "pdfs/reports/NIST-SP800-61r2-incident-handling.pdf",
            79,
            "Computer Security Incident Handling Guide",
        ),
        ("pdfs/reports/federal-register-2020-17221.pdf", 15, "Airworthiness Directives"),
        ("pdfs/reports/irs-i1040nr-2007-instructions.pdf", 50, "Form 1040NR"),
    ],
)
def test_readable_pdfs_give_substantial_text_with_paragraphs(
    relative_path: str, pages: int, phrase: str
) -> None:
    parsed = parse_corpus_file(relative_path)

    assert parsed.pages == pages
    assert phrase in flattened(parsed.text)
    assert len(parsed.text) > 1_000 * pages
    assert parsed.text.count("\n\n") > pages  # paragraphs stay apart
    assert "\n\n\n" not in parsed.text
    assert not any(warning.startswith("damaged") for warning in parsed.warnings)


@needs_corpora
def test_pdf_table_rows_keep_label_and_figures_on_one_line_on_their_page() -> None:
    parsed = parse_corpus_file("qa/sec10q-dev/docs/2023 Q2 AAPL.pdf")

    # The revenue table of Note 2 (page 10) and of the management's discussion (page 19, the
    # page the sec10q question on it gives); pdfminer's text boxes alone put the labels
    # ("iPhone", "Mac", ...) in one block and each column of figures in a later one.
    rows = [" ".join(line.split()) for line in parsed.text.splitlines()]
    # each figure under its column's headers, which the page prints lines above the rows
    assert (
        "iPhone: Three Months Ended April 1, 2023 $ 51,334; Three Months Ended March 26, 2022 "
        "$ 50,570; Six Months Ended April 1, 2023 $ 117,109; Six Months Ended March 26, 2022 "
        "$ 122,198" in rows
    )
    assert (
        "Mac: Three Months Ended April 1, 2023 7,168; Three Months Ended March 26, 2022 10,435; "
        "Six Months Ended April 1, 2023 14,903; Six Months Ended March 26, 2022 21,287" in rows
    )
    assert parsed.parser == "pdf:pdfminer-headed-rows"
    assert parsed.pages == 28
    starts = parsed.page_starts
    iphone_rows = [match.start() for match in re.finditer(r"iPhone: .*\$ 51,334", parsed.text)]
    assert [page_of(offset, starts) for offset in iphone_rows] == [10, 19]
    assert "April 1, 2023 $ 51,334" in parsed.text[starts[9] : starts[10]]
    assert parsed.text[starts[9] :].startswith("Note 2 \u2013 Revenue")
    assert "April 1, 2023 $ 51,334" in parsed.text[starts[18] : starts[19]]
    assert parsed.text[starts[18] :].startswith("Products and Services Performance")


@needs_corpora
def test_a_filing_with_an_array_over_pypdfs_default_limit_is_read() -> None:
    """pypdf refuses arrays of over 100,000 elements by default; this 10-Q holds one."""
    parsed = parse_corpus_file("qa/sec10q-dev/docs/2023 Q1 MSFT.pdf")
    assert parsed.pages == 72 and not parsed.warnings
    assert len(parsed.text) > 100_000


@needs_corpora
def test_damaged_pdfs_print_nothing(capfd: pytest.CaptureFixture[str]) -> None:
    parse_corpus_file("pdfs/bad/corrupted-zen_of_python.pdf")
    corpus_parse_error("pdfs/bad/broken-invalid-pages-unreadablemetadata.pdf")

    assert capfd.readouterr() == ("", "")


def make_pdf(page_contents: list[bytes], image_on_pages: set[int] = frozenset()) -> bytes:
    """A small PDF written by hand: one page per content stream, Helvetica for text, and a
    2x2 grey image on the pages (0-based) in image_on_pages."""
    objects = [
        b"<< /Type /Catalog /Pages 2 0 R >>",
        b"",  # the page tree, once the page numbers are known
        b"<< /Type /Font /Subtype /Type1 /BaseFont /Helvetica >>",
        b"<< /Type /XObject /Subtype /Image /Width 2 /Height 2 /ColorSpace /DeviceGray "
        b"/BitsPerComponent 8 /Length 4 >>\nstream\n\x10\x80\x80\xf0\nendstream",
    ]
    page_numbers = []
    for index, content in enumerate(page_contents):
        resources = b"/Font << /F1 3 0 R >>"
        if index in image_on_pages:
            content += b" q 100 0 0 100 50 50 cm /Im1 Do Q"
            resources += b" /XObject << /Im1 4 0 R >>"
        objects.append(b"<< /Length %d >>\nstream\n%s\nendstream" % (len(content), content))
        objects.append(
            b"<< /Type /Page /Parent 2 0 R /MediaBox [0 0 300 300] /Contents %d 0 R "
            b"/Resources << %s >> >>" % (len(objects), resources)
        )
        page_numbers.append(len(objects))
    kids = b" ".join(b"%d 0 R" % number for number in page_numbers)
    objects[1] = b"<< /Type /Pages /Kids [%s] /Count %d >>" % (kids, len(page_numbers))
    pdf = bytearray(b"%PDF-1.4\n")
    offsets = []
    for number, body in enumerate(objects, start=1):
        offsets.append(len(pdf))
        pdf += b"%d 0 obj\n%s\nendobj\n" % (number, body)
    xref_at = len(pdf)
    pdf += b"xref\n0 %d\n0000000000 65535 f \n" % (len(objects) + 1)
    pdf += b"".join(b"%010d 00000 n \n" % offset for offset in offsets)
    pdf += b"trailer\n<< /Size %d /Root 1 0 R >>\nstartxref\n%d\n%%%%EOF\n" % (
        len(objects) + 1,
        xref_at,
    )
    return bytes(pdf)


def text_page(text: str) -> bytes:
    return b"BT /F1 12 Tf 20 250 Td (%s) Tj ET" % text.encode("latin-1")


def test_pdf_pages_without_text_layer_are_reported() -> None:
    pdf = make_pdf([text_page("Chapter one"), b"", text_page("Chapter three")], {1})

    parsed = parse_document(pdf, "mixed.pdf")

    assert parsed.text == "Chapter one\n\nChapter three"
    assert parsed.pages == 3
    assert parsed.warnings == ("1 of 3 pages have no text layer (need OCR): pages 2",)
    # the page without text holds only the blank line between its neighbours
    assert parsed.page_starts == (0, 11, 13)
    assert page_of(parsed.text.index("three"), parsed.page_starts) == 3
    assert page_of(parsed.text.index("one"), parsed.page_starts) == 1


def test_pdf_table_figures_join_the_line_of_their_row_label() -> None:
    def cells(size: int, placed: list[tuple[int, int, str]]) -> bytes:
        return b" ".join(
            b"BT /F1 %d Tf %d %d Td (%s) Tj ET" % (size, x, y, text.encode())
            for x, y, text in placed
        )

    table = [(20, 250, "Revenue"), (200, 250, "1,234"), (20, 232, "Costs"), (200, 232, "(567)")]
    prose = [(20, 200, "Some prose under the table, 2024")]
    pdf = make_pdf([cells(10, table + prose), cells(0, [(20, 250, "Nil"), (200, 250, "12")])])

    parsed = parse_document(pdf, "table.pdf")

    # a column of figures 180 pt to the right of its labels: without the join, pdfminer's text
    # has "Revenue" and "1,234" in different blocks; the zero-size text must not break it
    first_page = parsed.text[: parsed.page_starts[1]]
    assert first_page.split("\n\n")[:3] == [
        "Revenue 1,234",
        "Costs (567)",
        "Some prose under the table, 2024",
    ]
    assert parsed.parser == "pdf:pdfminer-headed-rows" and parsed.warnings == ()


def test_pdf_table_rows_are_written_with_their_column_headers_and_section() -> None:
    def cells(placed: list[tuple[int, int, str]]) -> bytes:
        return b" ".join(
            b"BT /F1 8 Tf %d %d Td (%s) Tj ET" % (x, y, text.encode()) for x, y, text in placed
        )

    page = [
        (20, 280, "Segment results were as follows, in millions of dollars:"),
        (165, 264, "Three Months Ended"),
        (170, 254, "2023"), (240, 254, "2022"),
        (20, 240, "North America"),
        (30, 230, "Net sales"), (155, 230, "$ 82,546"), (225, 230, "$ 74,430"),
        (163, 220, "85,757"), (233, 220, "73,803"),  # a subtotal without a label
        (30, 210, "Operating income"), (168, 210, "3,211"), (238, 210, "(627)"),
        (20, 180, "Some prose between the tables, written in 2024."),
        (30, 160, "Headcount"), (168, 160, "1,200"), (238, 160, "1,100"),
    ]  # fmt: skip

    lines = parse_document(make_pdf([cells(page)]), "segments.pdf").text.splitlines()

    # each figure under its column's headers, top line first; the row under its section label
    assert (
        "North America, Net sales: Three Months Ended 2023 $ 82,546; Three Months Ended 2022 "
        "$ 74,430" in lines
    )
    assert (
        "North America, Operating income: Three Months Ended 2023 3,211; Three Months Ended "
        "2022 (627)" in lines
    )
    # under prose, with no headers of its own, a row keeps its figures as printed
    assert "Headcount 1,200 1,100" in lines


def test_pdf_with_blank_pages_only_is_empty() -> None:
    with pytest.raises(ParseError) as raised:
        parse_document(make_pdf([b"", b""]), "blank.pdf")

    assert raised.value.reason == "empty document"


def test_pdf_named_after_content_is_found_without_extension() -> None:
    with pytest.raises(ParseError) as raised:
        parse_document(b"%PDF-1.7\n%broken beyond repair\n", "download")

    assert raised.value.reason.startswith("damaged PDF: ")


def test_web_error_page_saved_as_pdf_is_read_as_html_with_a_warning() -> None:
    page = b"<!DOCTYPE html><html><body><h1>404 Not Found</h1></body></html>"

    parsed = parse_document(page, "https://example.org/files/report.pdf?download=1")

    assert parsed.parser == "html"
    assert parsed.text == "404 Not Found"
    assert parsed.warnings == ("named .pdf but the content is HTML",)


# --- DOCX --------------------------------------------------------------------------------------


def make_docx_with_python_docx() -> bytes:
    docx = pytest.importorskip("docx", reason="python-docx is not installed")
    document = docx.Document()
    document.add_heading("Quarterly Report", level=1)
    document.add_paragraph("Revenue grew by 12 percent in the third quarter.")
    table = document.add_table(rows=2, cols=3)
    table.cell(0, 0).text = "Region"
    table.cell(0, 1).merge(table.cell(0, 2)).text = "Revenue, both halves"
    for column, value in enumerate(["North", "4.2", "5.1"]):
        table.cell(1, column).text = value
    document.add_paragraph("Closing remarks follow.")
    buffer = io.BytesIO()
    document.save(buffer)
    return buffer.getvalue()


def test_docx_keeps_paragraphs_and_tables_in_reading_order() -> None:
    parsed = parse_document(make_docx_with_python_docx(), "report.docx")

    assert parsed.parser == "docx"
    assert parsed.mime_type == DOCX_MIME
    assert parsed.text == (
        "Quarterly Report\n\n"
        "Revenue grew by 12 percent in the third quarter.\n\n"
        "Region | Revenue, both halves\n"
        "North | 4.2 | 5.1\n\n"
        "Closing remarks follow."
    )


def test_docx_is_recognised_by_content_under_another_name() -> None:
    parsed = parse_document(make_docx_with_python_docx(), "attachment-17")

    assert parsed.parser == "docx"
    assert "Quarterly Report" in parsed.text


WORD_NAMESPACES = (
    'xmlns:w="http://schemas.openxmlformats.org/wordprocessingml/2006/main" '
    'xmlns:mc="http://schemas.openxmlformats.org/markup-compatibility/2006" '
    'xmlns:wps="http://schemas.microsoft.com/office/word/2010/wordprocessingShape" '
    'xmlns:v="urn:schemas-microsoft-com:vml"'
)


def make_minimal_docx(body_xml: str, recorded_pages: int) -> bytes:
    """A DOCX written by hand, as Word lays out a text box (DrawingML plus a VML fallback)."""
    parts = {
        "[Content_Types].xml": (
            '<Types xmlns="http://schemas.openxmlformats.org/package/2006/content-types">'
            '<Default Extension="rels" '
            'ContentType="application/vnd.openxmlformats-package.relationships+xml"/>'
            '<Default Extension="xml" ContentType="application/xml"/>'
            '<Override PartName="/word/document.xml" ContentType="application/'
            'vnd.openxmlformats-officedocument.wordprocessingml.document.main+xml"/>'
            "</Types>"
        ),
        "_rels/.rels": (
            '<Relationships xmlns="http://schemas.openxmlformats.org/package/2006/relationships">'
            '<Relationship Id="rId1" Target="word/document.xml" Type="http://schemas.'
            'openxmlformats.org/officeDocument/2006/relationships/officeDocument"/>'
            "</Relationships>"
        ),
        "word/document.xml": f"<w:document {WORD_NAMESPACES}><w:body>{body_xml}</w:body>"
        "</w:document>",
        "docProps/app.xml": (
            '<Properties xmlns="http://schemas.openxmlformats.org/officeDocument/2006/'
            f'extended-properties"><Pages>{recorded_pages}</Pages></Properties>'
        ),
    }
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w") as archive:
        for part_name, xml in parts.items():
            archive.writestr(part_name, xml)
    return buffer.getvalue()


def test_docx_text_boxes_are_read_once_in_place_and_recorded_pages_kept() -> None:
    pytest.importorskip("docx", reason="python-docx is not installed")
    text_box = "<w:txbxContent><w:p><w:r><w:t>Boxed note</w:t></w:r></w:p></w:txbxContent>"
    body = (
        "<w:p><w:r><w:t>Before the box.</w:t></w:r>"
        "<w:r><mc:AlternateContent>"
        f'<mc:Choice Requires="wps"><wps:txbx>{text_box}</wps:txbx></mc:Choice>'
        f"<mc:Fallback><v:textbox>{text_box}</v:textbox></mc:Fallback>"
        "</mc:AlternateContent></w:r></w:p>"
        "<w:p><w:r><w:t>After the box.</w:t></w:r></w:p>"
    )

    parsed = parse_document(make_minimal_docx(body, recorded_pages=3), "memo.docx")

    assert parsed.text == "Before the box.\n\nBoxed note\n\nAfter the box."
    assert parsed.pages == 3


def test_damaged_docx_gives_a_reason() -> None:
    truncated = make_minimal_docx("<w:p/>", recorded_pages=1)[:-40]

    with pytest.raises(ParseError) as raised:
        parse_document(truncated, "memo.docx")

    assert raised.value.reason.startswith("damaged DOCX: ")


# --- HTML and Markdown -------------------------------------------------------------------------

HTML_PAGE = """<!DOCTYPE html>
<html><head><meta charset="iso-8859-1"><title>Caf\xe9 menu</title>
<style>p { color: red; }</style><script>var tracking = "do not show";</script></head>
<body>
  <!-- a comment that is not content -->
  <h1>Today's   specials</h1>
  <p>Fresh
     bread&nbsp;and <b>butter</b>.<br>Served all day.</p>
  <ul><li>Soup</li><li>Cr\xe8me br\xfbl\xe9e</li></ul>
  <table><tr><th>Dish</th><th>Price</th></tr><tr><td>Soup</td><td>4</td></tr></table>
  <noscript>Enable JavaScript</noscript>
</body></html>
""".encode("latin-1")


def test_html_gives_text_by_blocks_without_scripts_styles_or_comments() -> None:
    parsed = parse_document(HTML_PAGE, "menu.html")

    assert parsed.parser == "html"
    assert parsed.mime_type == "text/html"
    assert parsed.text == (
        "Café menu\n\n"
        "Today's specials\n\n"
        "Fresh bread and butter.\nServed all day.\n\n"
        "Soup\n\nCrème brûlée\n\n"
        "Dish | Price\n\nSoup | 4"
    )


def test_html_is_sniffed_and_mime_type_charset_is_used() -> None:
    sniffed = parse_document(HTML_PAGE, "index")
    declared = parse_document(
        "<p>Caf\xe9</p>".encode("latin-1"), "blob", "text/html; charset=ISO-8859-1"
    )

    assert sniffed.parser == "html"
    assert "Crème brûlée" in sniffed.text
    assert (declared.parser, declared.text) == ("html", "Café")


def test_markdown_is_kept_as_written() -> None:
    markdown = "# Notes\r\n\r\n- first *point*\r\n- second point\r\n"

    parsed = parse_document(markdown.encode(), "README.md")

    assert parsed.parser == "markdown"
    assert parsed.mime_type == "text/markdown"
    assert parsed.text == "# Notes\n\n- first *point*\n- second point\n"


# --- plain text and encodings ------------------------------------------------------------------


@needs_corpora
def test_utf8_text_with_bom_loses_the_bom_and_carriage_returns() -> None:
    path = CORPORA / "text" / "gutenberg-1661-adventures-of-sherlock-holmes.txt"
    raw = path.read_bytes()
    assert raw.startswith(b"\xef\xbb\xbf")

    parsed = parse_document(raw, path.name)

    assert parsed.parser == "text"
    assert parsed.text.lstrip().startswith("The Adventures of Sherlock Holmes")
    assert "\ufeff" not in parsed.text
    assert "\r" not in parsed.text
    assert "“It is not cold which makes me shiver,” said the woman" in parsed.text
    assert parsed.text == raw[3:].decode("utf-8").replace("\r\n", "\n")


def test_utf16_with_bom_is_decoded() -> None:
    data = "Grüße aus Köln\r\nzweite Zeile\r\n".encode("utf-16")

    parsed = parse_document(data, "gruss.txt")

    assert parsed.text == "Grüße aus Köln\nzweite Zeile\n"
    assert parsed.warnings == ()


@pytest.mark.parametrize(
    ("text", "encoding"),
    [
        ("Café crème à la française, déjà vu.\nÇa va.\n", "latin-1"),
        ("“Smart quotes” and an em dash — cost 5 €.\n", "cp1252"),
    ],
)
def test_western_single_byte_text_falls_back_to_cp1252(text: str, encoding: str) -> None:
    parsed = parse_document(text.encode(encoding), "notes.txt")

    assert parsed.text == text
    assert parsed.warnings == ()


def test_mostly_utf8_log_with_stray_latin1_bytes_keeps_every_character() -> None:
    data = "2024-05-01 INFO user=Zoë logged in ✓\n".encode() + "2024-05-01 WARN user=Zoë\n".encode(
        "latin-1"
    )

    parsed = parse_document(data, "auth.log")

    assert parsed.text == "2024-05-01 INFO user=Zoë logged in ✓\n2024-05-01 WARN user=Zoë\n"
    assert parsed.warnings == ("1 bytes were not valid UTF-8; decoded them as cp1252",)


def test_line_endings_are_normalised() -> None:
    parsed = parse_document(b"one\r\ntwo\rthree\n", "lines.txt")

    assert parsed.text == "one\ntwo\nthree\n"


def test_unknown_extension_with_text_content_is_read_as_text() -> None:
    parsed = parse_document(b"key = value\n", "settings.conf")

    assert (parsed.parser, parsed.text) == ("text", "key = value\n")


# --- logs and compression ----------------------------------------------------------------------


@needs_corpora
def test_log_is_kept_as_is() -> None:
    path = CORPORA / "logs" / "Apache" / "Apache_2k.log"

    parsed = parse_document(path.read_bytes(), path.name)

    assert parsed.parser == "log"
    assert parsed.mime_type == "text/plain"
    assert parsed.text == path.read_bytes().decode("utf-8").replace("\r\n", "\n")
    assert parsed.text.startswith("[Sun Dec 04 04:47:44 2005] [notice] workerEnv.init() ok")
    assert len(parsed.text.splitlines()) == 2000


@needs_corpora
@pytest.mark.parametrize(
    ("compress", "name"),
    [(gzip.compress, "hdfs.log.1.gz"), (bz2.compress, "hdfs.log.2.bz2"), (lzma.compress, "x.xz")],
)
def test_compressed_rotated_log_is_unpacked(compress: Callable[[bytes], bytes], name: str) -> None:
    original = (CORPORA / "logs" / "HDFS" / "HDFS_2k.log").read_bytes()

    parsed = parse_document(compress(original), name)

    assert parsed.parser == ("log" if ".log" in name else "text")
    assert parsed.text == original.decode("utf-8").replace("\r\n", "\n")


def test_gzip_uses_the_inner_extension_and_is_sniffed_without_one() -> None:
    markdown = gzip.compress(b"# Title\n")

    assert parse_document(markdown, "notes.md.gz").parser == "markdown"
    assert parse_document(gzip.compress(b"plain words\n"), "x.txt.gz").text == "plain words\n"
    assert parse_document(gzip.compress(b"plain words\n"), "blob").parser == "text"


def test_damaged_gzip_gives_a_reason() -> None:
    truncated = gzip.compress(b"log line\n" * 1000)[:-20]

    with pytest.raises(ParseError) as raised:
        parse_document(truncated, "app.log.gz")

    assert raised.value.reason.startswith("damaged gzip file: ")


# --- binary, empty and unsupported input -------------------------------------------------------


def make_png() -> bytes:
    rows = random.Random(1).randbytes(64 * (1 + 64 * 3))

    def chunk(kind: bytes, payload: bytes) -> bytes:
        checksum = zlib.crc32(kind + payload)
        return struct.pack(">I", len(payload)) + kind + payload + struct.pack(">I", checksum)

    header = struct.pack(">IIBBBBB", 64, 64, 8, 2, 0, 0, 0)
    return (
        b"\x89PNG\r\n\x1a\n"
        + chunk(b"IHDR", header)
        + chunk(b"IDAT", zlib.compress(rows))
        + chunk(b"IEND", b"")
    )


@pytest.mark.parametrize(
    ("data", "name"),
    [
        (random.Random(0).randbytes(8192), "junk.bin"),
        (random.Random(0).randbytes(8192), "notes.txt"),
        (make_png(), "picture.png"),
        (Path(sys.executable).resolve().read_bytes()[:65536], "python"),
    ],
)
def test_binary_content_is_not_read_as_text(data: bytes, name: str) -> None:
    with pytest.raises(ParseError) as raised:
        parse_document(data, name)

    assert raised.value.reason == "not a text file (binary content)"


@pytest.mark.parametrize(
    ("data", "name"),
    [
        (b"", "empty.txt"),
        (b"  \n\t\r\n ", "blank.log"),
        (" \n".encode("utf-16"), "blank-utf16.txt"),
        (b"<html><body>  <script>x()</script> </body></html>", "blank.html"),
        (gzip.compress(b""), "empty.log.gz"),
    ],
)
def test_empty_or_whitespace_only_documents_are_refused(data: bytes, name: str) -> None:
    with pytest.raises(ParseError) as raised:
        parse_document(data, name)

    assert raised.value.reason == "empty document"


def test_known_but_unsupported_formats_are_named() -> None:
    slides = io.BytesIO()
    with zipfile.ZipFile(slides, "w") as archive:
        archive.writestr("ppt/presentation.xml", "<p:presentation/>")

    with pytest.raises(ParseError) as zipped:
        parse_document(slides.getvalue(), "deck.pptx")
    with pytest.raises(ParseError) as legacy:
        parse_document(b"\xd0\xcf\x11\xe0\xa1\xb1\x1a\xe1" + bytes(504), "letter.doc")

    assert zipped.value.reason == "unsupported format: .pptx"
    assert legacy.value.reason == "unsupported format: .doc"
