"""PDF text that keeps a table's rows: pdfminer.six as memstream parsed PDFs before, its row
joining now, pdfplumber, another pdfminer layout setting and pypdfium2, on table rows, CUAD gold
clauses, prose reading order and time.

Candidates (each gives one text per page; every page then gets memstream's cleanup:
`normalize_newlines`, trailing spaces stripped, runs of blank lines collapsed, ends stripped):

- pdfminer: pdfminer.six `extract_pages(laparams=LAParams(all_texts=True))`, each text box's
  text followed by a blank line (what memstream's `parse_pdf` gave before this benchmark). The
  default char_margin, 2, cuts a line at a gap wider than two characters, so a row's label and
  its figures land in separate boxes, one per column.
- pdfminer-rows: memstream's `parse_pdf` now (operators/parsing/pdf_text.py,
  `_extract_pdf_text_with_pdfminer`, called directly): the same layout, with each figure line
  of a box that is mostly figures moved onto the line of its row's label (`_rows` there).
- pdfminer-wide: the old text with `LAParams(all_texts=True, char_margin=200)`: characters
  that follow each other in the content stream on one baseline stay on one text line however
  far apart.
- plumber-layout: pdfplumber `page.extract_text(layout=True)`; in each line the leading spaces
  are dropped and every run of 2+ spaces becomes one space.
- plumber-layout-bars: the same text with each inner run of 2+ spaces made " | ".
- plumber-plain: pdfplumber `page.extract_text()` (words grouped into lines by position).
- pdfium: pypdfium2 `page.get_textpage().get_text_bounded()` (PDFium's text, content order).
The two plumber-layout candidates share one extraction; each one's time is that extraction's
plus its own folding.

Metrics:

- Table rows kept, on the 15 SEC 10-Q filings of shared/corpora/qa/sec10q-dev: pdfplumber's
  `page.extract_words()` gives the words with positions; words whose `top` is within 2 pt of a
  line's first word form one visual line. A row is a visual line whose first word has a letter
  and no digit and whose last word is a figure (39,669, (1,234), 12.5%, $3.5; a footnote marker
  such as "(1)" is not a figure). Its label is its leading words without digits (at most 3),
  its figure the first figure after them. A row is kept when one line of the candidate's text of
  the same page has the label and, after it, the figure as a whole number (comparison on text
  under NFKC with (R), TM and (C) signs removed and whitespace collapsed). "Table rows" are the
  rows whose first figure (or the "$" before it) starts 12 pt or more after the word before it,
  i.e. sits in a column of its own, rather than ending a sentence.
- CUAD gold clauses found, whitespace-collapsed, on the CUAD contract PDFs: the comparison of
  bench/pdf_parsers.py (its `gold_spans` and `span_hits`, imported).
- Prose line pairs kept, on shared/corpora/pdfs/reports (a three-column Federal Register
  notice, two NIST guides, the IRS 1040NR instructions, a DMCA summary): two lines that follow
  each other in one pdfminer text box, both prose (40+ characters, 70%+ letters or spaces), are
  kept when "first second" is in the candidate's whitespace-collapsed page text. pdfminer's
  boxes are the reference (its share is 1 by construction): the check shows a candidate that
  reads across the columns of a multi-column page.
- Seconds per page: time.perf_counter around one document's extraction (open, every page,
  cleanup); not the pypdf open and the checks `parse_pdf` runs for every extractor alike. One
  untimed warm-up call of each extractor, then `--rounds` rounds over all documents (contracts,
  filings, reports), the extractors' order rotated per document and round. A document's time
  is its median over the rounds; seconds per page = sum of medians / sum of pages.
- Blocks per page: blank-line-separated blocks, for paragraph structure (diagnostic).

    .venv/bin/python bench/pdf_tables.py [--rounds N]
"""

from __future__ import annotations

import argparse
import io
import itertools
import logging
import re
import statistics
import time
import unicodedata
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import common
from pdf_parsers import LABELS, gold_spans, span_hits, versions

from operators.parsing.base import EXTRA_BLANK_LINES, TRAILING_SPACES, normalize_newlines
from operators.parsing.pdf_text import _extract_pdf_text_with_pdfminer

FILINGS = common.CORPORA / "qa" / "sec10q-dev" / "docs"
REPORTS = common.CORPORA / "pdfs" / "reports"
VERSIONED = ("pdfminer.six", "pdfplumber", "pypdfium2", "pypdf")


# --- candidates --------------------------------------------------------------------------------


def pdfminer_pages(data: bytes, **laparams: Any) -> list[str]:
    from pdfminer.high_level import extract_pages
    from pdfminer.layout import LAParams, LTContainer, LTText, LTTextBox

    def collect(item: Any, parts: list[str]) -> None:
        if isinstance(item, LTContainer):
            for child in item:
                collect(child, parts)
        elif isinstance(item, LTText):
            parts.append(item.get_text())
        if isinstance(item, LTTextBox):
            parts.append("\n")

    pages = []
    for layout in extract_pages(io.BytesIO(data), laparams=LAParams(all_texts=True, **laparams)):
        parts: list[str] = []
        collect(layout, parts)
        pages.append("".join(parts))
    return pages


def memstream_pages(data: bytes) -> list[str]:
    extraction = _extract_pdf_text_with_pdfminer(data)
    if extraction.failure is not None:
        raise extraction.failure
    return [extraction.page_texts[number] for number in sorted(extraction.page_texts)]


def plumber_pages(data: bytes, **options: Any) -> list[str]:
    import pdfplumber

    pages = []
    with pdfplumber.open(io.BytesIO(data)) as pdf:
        for page in pdf.pages:
            pages.append(page.extract_text(**options))
            page.close()
    return pages


def pdfium_pages(data: bytes) -> list[str]:
    import pypdfium2

    pages = []
    document = pypdfium2.PdfDocument(data)
    try:
        for index in range(len(document)):
            page = document[index]
            textpage = page.get_textpage()
            pages.append(textpage.get_text_bounded())
            textpage.close()
            page.close()
    finally:
        document.close()
    return pages


def cleanup(page_text: str) -> str:
    """memstream's per-page cleanup, as parse_pdf does it."""
    page_text = TRAILING_SPACES.sub("\n", normalize_newlines(page_text))
    return EXTRA_BLANK_LINES.sub("\n\n", page_text).strip()


INNER_SPACES = re.compile(r"(?<=\S) {2,}(?=\S)")
LEADING_SPACES = re.compile(r"^ +", re.MULTILINE)


def fold_spaces(page_text: str, separator: str = " ") -> str:
    return INNER_SPACES.sub(separator, LEADING_SPACES.sub("", page_text))


EXTRACTORS: dict[str, Callable[[bytes], list[str]]] = {
    "pdfminer": pdfminer_pages,
    "pdfminer-rows": memstream_pages,
    "pdfminer-wide": lambda data: pdfminer_pages(data, char_margin=200),
    "plumber-layout": lambda data: plumber_pages(data, layout=True),
    "plumber-plain": plumber_pages,
    "pdfium": pdfium_pages,
}
# candidate -> (extractor, folding applied to each page before the cleanup)
CANDIDATES: dict[str, tuple[str, Callable[[str], str] | None]] = {
    "pdfminer": ("pdfminer", None),
    "pdfminer-rows": ("pdfminer-rows", None),
    "pdfminer-wide": ("pdfminer-wide", None),
    "plumber-layout": ("plumber-layout", fold_spaces),
    "plumber-layout-bars": ("plumber-layout", lambda text: fold_spaces(text, " | ")),
    "plumber-plain": ("plumber-plain", None),
    "pdfium": ("pdfium", None),
}


# --- table rows --------------------------------------------------------------------------------

FIGURE = re.compile(r"\(?-?\$?-?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?\)?%?")
FOOTNOTE = re.compile(r"\(\d\)")
MARKS = str.maketrans("", "", "®™©")
COLUMN_GAP = 12.0  # pt between a figure's column and the word before it
SAME_LINE = 2.0  # pt between the tops of words on one visual line


@dataclass(frozen=True)
class Row:
    page: int  # 0-based
    label: str
    figure: str  # the figure's digits, commas and point: "1,234"
    in_column: bool


def canon(text: str) -> str:
    return " ".join(unicodedata.normalize("NFKC", text).translate(MARKS).split())


def is_figure(word: str) -> bool:
    return bool(FIGURE.fullmatch(word)) and not FOOTNOTE.fullmatch(word)


def visual_lines(words: list[dict[str, Any]]) -> list[list[dict[str, Any]]]:
    lines: list[list[dict[str, Any]]] = []
    for word in sorted(words, key=lambda word: (word["top"], word["x0"])):
        if lines and word["top"] - lines[-1][0]["top"] <= SAME_LINE:
            lines[-1].append(word)
        else:
            lines.append([word])
    return [sorted(line, key=lambda word: word["x0"]) for line in lines]


def row_of(page: int, line: list[dict[str, Any]]) -> Row | None:
    texts = [word["text"] for word in line]
    first, last = texts[0], texts[-1]
    if not re.search(r"[^\W\d_]", first) or re.search(r"\d", first) or not is_figure(last):
        return None
    label_end = 0
    while label_end < len(texts) and not re.search(r"[\d$]", texts[label_end]):
        label_end += 1
    at = next(i for i in range(label_end, len(texts)) if is_figure(texts[i]))
    label = canon(" ".join(texts[: min(label_end, 3)]))
    if not label:
        return None
    column_start = at - 1 if at > 0 and texts[at - 1] == "$" else at
    in_column = column_start > 0 and (
        line[column_start]["x0"] - line[column_start - 1]["x1"] >= COLUMN_GAP
    )
    figure = texts[at].strip("()$-%")
    return Row(page, label, figure, in_column)


def filing_rows(data: bytes) -> list[Row]:
    import pdfplumber

    rows = []
    with pdfplumber.open(io.BytesIO(data)) as pdf:
        for index, page in enumerate(pdf.pages):
            for line in visual_lines(page.extract_words()):
                row = row_of(index, line)
                if row is not None:
                    rows.append(row)
            page.close()
    return rows


def row_kept(row: Row, page_lines: list[str]) -> bool:
    figure = re.compile(r"(?<![\d,.])" + re.escape(row.figure) + r"(?!\d|[,.]\d)")
    for line in page_lines:
        start = line.find(row.label)
        while start >= 0:
            if figure.search(line, start + len(row.label)):
                return True
            start = line.find(row.label, start + 1)
    return False


def rows_kept(rows: list[Row], pages: list[str]) -> list[bool]:
    lines = [[canon(line) for line in page.splitlines()] for page in pages]
    return [row.page < len(lines) and row_kept(row, lines[row.page]) for row in rows]


# --- prose reading order -----------------------------------------------------------------------


def is_prose(line: str) -> bool:
    return len(line) >= 40 and sum(c.isalpha() or c == " " for c in line) >= 0.7 * len(line)


def prose_pairs(reference_pages: list[str]) -> list[tuple[int, str]]:
    pairs = []
    for index, page in enumerate(reference_pages):
        for block in page.split("\n\n"):
            lines = [line.strip() for line in block.splitlines()]
            for first, second in itertools.pairwise(lines):
                if is_prose(first) and is_prose(second):
                    pairs.append((index, " ".join(f"{first} {second}".split())))
    return pairs


def pairs_kept(pairs: list[tuple[int, str]], pages: list[str]) -> list[bool]:
    flat = [" ".join(page.split()) for page in pages]
    return [index < len(flat) and pair in flat[index] for index, pair in pairs]


# --- runs --------------------------------------------------------------------------------------


@dataclass
class Run:
    pages: list[str] = field(default_factory=list)
    seconds: list[float] = field(default_factory=list)
    error: str | None = None

    @property
    def median_seconds(self) -> float:
        return statistics.median(self.seconds) if self.seconds else float("nan")


def measure(documents: list[tuple[str, bytes]], rounds: int) -> dict[str, dict[str, Run]]:
    """document -> candidate -> Run; texts from the first round."""
    runs = {name: {candidate: Run() for candidate in CANDIDATES} for name, _ in documents}
    order = list(EXTRACTORS)
    for round_index in range(rounds):
        for doc_index, (name, data) in enumerate(documents):
            shift = (round_index + doc_index) % len(order)
            for extractor in order[shift:] + order[:shift]:
                started = time.perf_counter()
                try:
                    raw, error = EXTRACTORS[extractor](data), None
                except Exception as exc:
                    raw, error = [], f"{type(exc).__name__}: {exc}"[:200]
                raw_seconds = time.perf_counter() - started
                for candidate, (source, fold) in CANDIDATES.items():
                    if source != extractor:
                        continue
                    started = time.perf_counter()
                    pages = [cleanup(fold(page) if fold else page) for page in raw]
                    run = runs[name][candidate]
                    run.seconds.append(raw_seconds + time.perf_counter() - started)
                    if round_index == 0:
                        run.pages, run.error = pages, error
        print(f"round {round_index + 1} of {rounds} done", flush=True)
    return runs


def share(flags: list[bool]) -> float:
    return sum(flags) / len(flags) if flags else float("nan")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--filings", type=int, default=0, help="only the first N (0: all 15)")
    args = parser.parse_args()
    # pdfminer logs a line per odd colour or font; not what is measured here.
    logging.getLogger("pdfminer").setLevel(logging.ERROR)

    gold = json_labels()
    contracts = []
    for contract in gold["contracts"]:
        path = LABELS.parents[2] / contract["pdf"]
        spans = gold_spans(contract["labels"])
        if path.exists() and spans:
            contracts.append((path.name, path.read_bytes(), spans))
    filing_paths = sorted(FILINGS.glob("*.pdf"))[: args.filings or None]
    filings = [(path.name, path.read_bytes()) for path in filing_paths]
    reports = [(path.name, path.read_bytes()) for path in sorted(REPORTS.glob("*.pdf"))]
    documents = [(name, data) for name, data, _ in contracts] + filings + reports

    for extractor in EXTRACTORS.values():  # imports and first-call set-up, untimed
        extractor(documents[0][1])
    started = time.perf_counter()
    runs = measure(documents, args.rounds)
    wall = time.perf_counter() - started
    rows = {name: filing_rows(data) for name, data in filings}

    page_counts = {name: len(runs[name]["pdfminer"].pages) for name, _ in documents}
    groups = {
        "contracts": [name for name, _, _ in contracts],
        "filings": [name for name, _ in filings],
        "reports": [name for name, _ in reports],
    }
    pairs = {name: prose_pairs(runs[name]["pdfminer"].pages) for name in groups["reports"]}
    summary: dict[str, dict[str, Any]] = {}
    per_document: dict[str, dict[str, Any]] = {name: {} for name, _ in documents}
    for candidate in CANDIDATES:
        found_spans = total_spans = 0
        for name, _, spans in contracts:
            hits = span_hits(spans, "\n\n".join(runs[name][candidate].pages))["ws_collapsed"]
            found_spans += sum(hits)
            total_spans += len(spans)
            per_document[name][candidate] = {"spans_found": sum(hits), "spans": len(spans)}
        all_rows: list[bool] = []
        column_rows: list[bool] = []
        for name in groups["filings"]:
            kept = rows_kept(rows[name], runs[name][candidate].pages)
            all_rows += kept
            column_rows += [k for k, row in zip(kept, rows[name], strict=True) if row.in_column]
            per_document[name][candidate] = {
                "rows": len(kept),
                "rows_kept": sum(kept),
                "table_rows": sum(row.in_column for row in rows[name]),
                "table_rows_kept": sum(
                    k for k, row in zip(kept, rows[name], strict=True) if row.in_column
                ),
            }
        prose: list[bool] = []
        for name in groups["reports"]:
            kept = pairs_kept(pairs[name], runs[name][candidate].pages)
            prose += kept
            per_document[name][candidate] = {"prose_pairs": len(kept), "kept": sum(kept)}
        for name, _ in documents:
            run = runs[name][candidate]
            per_document[name][candidate] |= {
                "pages": len(run.pages),
                "chars": sum(map(len, run.pages)),
                "blocks": sum(
                    len([b for b in page.split("\n\n") if b.strip()]) for page in run.pages
                ),
                "median_seconds": run.median_seconds,
                "seconds": run.seconds,
                "error": run.error,
            }
        seconds = {
            group: sum(runs[name][candidate].median_seconds for name in names)
            / max(1, sum(page_counts[name] for name in names))
            for group, names in groups.items()
        }
        all_names = [name for names in groups.values() for name in names]
        summary[candidate] = {
            "cuad_spans_found": found_spans,
            "cuad_spans": total_spans,
            "cuad_share": found_spans / total_spans if total_spans else float("nan"),
            "rows": len(all_rows),
            "rows_share": share(all_rows),
            "table_rows": len(column_rows),
            "table_rows_share": share(column_rows),
            "prose_pairs": len(prose),
            "prose_pairs_share": share(prose),
            "s_per_page": sum(runs[name][candidate].median_seconds for name in all_names)
            / sum(page_counts[name] for name in all_names),
            "s_per_page_by_group": seconds,
            "blocks_per_page": sum(per_document[name][candidate]["blocks"] for name in all_names)
            / sum(page_counts[name] for name in all_names),
            "errors": [name for name in all_names if runs[name][candidate].error],
        }
    baseline = summary["pdfminer"]["s_per_page"]
    for candidate in CANDIDATES:
        summary[candidate]["time_vs_pdfminer"] = summary[candidate]["s_per_page"] / baseline

    pages_by_group = {group: sum(page_counts[n] for n in names) for group, names in groups.items()}
    markdown = render(summary, pages_by_group, args.rounds)
    common.write_results(
        "pdf_tables",
        {
            "rounds": args.rounds,
            "measure_wall_seconds": wall,
            "versions": versions(VERSIONED),
            "pages": pages_by_group,
            "summary": summary,
            "documents": per_document,
            "method": __doc__,
        },
        markdown,
    )


def json_labels() -> dict[str, Any]:
    import json

    return json.loads(LABELS.read_text(encoding="utf-8"))


def render(summary: dict[str, dict[str, Any]], pages: dict[str, int], rounds: int) -> str:
    header = (
        "candidate", "table rows kept", "rows kept", "CUAD spans (ws-collapsed)",
        "prose pairs kept", "s/page", "x pdfminer", "blocks/page",
    )  # fmt: skip
    body = [
        (
            candidate,
            f"{s['table_rows_share']:.3f} of {s['table_rows']}",
            f"{s['rows_share']:.3f} of {s['rows']}",
            f"{s['cuad_share']:.3f} ({s['cuad_spans_found']}/{s['cuad_spans']})",
            f"{s['prose_pairs_share']:.3f} of {s['prose_pairs']}",
            f"{s['s_per_page']:.4f}",
            f"{s['time_vs_pdfminer']:.2f}",
            f"{s['blocks_per_page']:.1f}",
        )
        for candidate, s in summary.items()
    ]
    by_group = [
        (candidate, *(f"{s['s_per_page_by_group'][group]:.4f}" for group in pages))
        for candidate, s in summary.items()
    ]
    errors = [f"{c}: {', '.join(s['errors'])}" for c, s in summary.items() if s["errors"]]
    lines = [
        "# PDF text that keeps table rows",
        "",
        f"Pages: {', '.join(f'{n} {group}' for group, n in pages.items())}; {rounds} timed "
        "rounds, median per document. Versions: "
        + ", ".join(f"{k} {v}" for k, v in versions(VERSIONED).items() if v)
        + ".",
        "",
        *common.table(header, body),
        "",
        "Seconds per page by group:",
        "",
        *common.table(("candidate", *pages), by_group),
        "",
        "Errors: " + ("; ".join(errors) if errors else "none") + ".",
        "",
        "Table rows: rows whose first figure sits in a column of its own; rows: every visual "
        "line from a label to a figure (filings). Prose pairs: pdfminer's is 1 by "
        "construction. Method: the docstring of bench/pdf_tables.py (also in the JSON).",
    ]
    return "\n".join(lines)


if __name__ == "__main__":
    main()
