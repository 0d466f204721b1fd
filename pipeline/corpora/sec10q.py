"""SEC 10-Q questions whose answer is one printed figure, over the filings of the shared corpora.

The questions are memstream's own (`sec10q_questions.jsonl` beside this module), read off the
filings' tables and prose, each with the figure as printed, its scale and unit, and the page it
is printed on. The 2023 Q2 filings are the held-out part (`split` "heldout"): no held-out figure
is a figure of the tuning part (tests/test_sec10q_questions.py checks it by value).
"""

from __future__ import annotations

import json
import multiprocessing
import os
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from operators.config import ConfigError
from operators.parsing import ParsedText, ParseError, parse_document
from pipeline.corpora import check_root

QUESTIONS_FILE = Path(__file__).with_name("sec10q_questions.jsonl")
FILINGS_FOLDER = "qa/sec10q-dev/docs"
SPLITS = ("tune", "heldout")
_SCALE_WORDS = {"": "", "thousand": " thousand", "million": " million", "billion": " billion"}


@dataclass(frozen=True)
class FigureQuestion:
    id: str
    filing: str  # the PDF's file name in the filings folder
    split: str  # "tune" or "heldout"
    question: str
    figure: str  # as printed: "39,669", "-2,345", "12.5"
    scale: str  # "", "thousand", "million" or "billion"
    unit: str  # "usd", "percent", "shares", "count" or "usd_per_share"
    page: int  # 1-based page of the PDF where the figure is printed
    source: str  # "table" or "prose"
    evidence: str  # the row label or sentence it is read from

    @property
    def gold(self) -> str:
        """The figure as one answer would state it: "$39,669 million", "12.5%"."""
        sign, digits = ("-", self.figure[1:]) if self.figure.startswith("-") else ("", self.figure)
        currency = "$" if self.unit in ("usd", "usd_per_share") else ""
        percent = "%" if self.unit == "percent" else ""
        return f"{sign}{currency}{digits}{percent}{_SCALE_WORDS[self.scale]}"


def load_questions(path: Path = QUESTIONS_FILE) -> list[FigureQuestion]:
    lines = path.read_text(encoding="utf-8").splitlines()
    return [FigureQuestion(**json.loads(line)) for line in lines if line.strip()]


def load_filings(root: Path, names: set[str]) -> dict[str, str]:
    """The parsed text of each named filing, parsed as `memstream ask` parses a PDF."""
    folder = check_root(root) / FILINGS_FOLDER
    parsed = parse_filings([folder / name for name in sorted(names)])
    return {path.name: text.text for path, text in parsed.items()}


# Eval's tasks and the training tasks read the same 15 filings, each slow to parse: once a
# process, by path.
_PARSED: dict[Path, ParsedText] = {}


def parse_filings(paths: list[Path]) -> dict[Path, ParsedText]:
    """The filings parsed, those not parsed yet in this process side by side, one process a
    core (pdfminer holds the GIL: threads would not overlap)."""
    missing = [path for path in dict.fromkeys(paths) if path not in _PARSED]
    workers = min(len(missing), len(os.sched_getaffinity(0)))
    if workers > 1:
        spawn = multiprocessing.get_context("spawn")  # no fork of a process holding threads
        with ProcessPoolExecutor(workers, mp_context=spawn) as pool:
            _PARSED.update(zip(missing, pool.map(_parse, missing), strict=True))
    return {path: parse_filing(path) for path in paths}


def parse_filing(path: Path) -> ParsedText:
    """A filing parsed once a process."""
    if path not in _PARSED:
        _PARSED[path] = _parse(path)
    return _PARSED[path]


def _parse(path: Path) -> ParsedText:
    try:
        return parse_document(path.read_bytes(), path.name)
    except ParseError as error:
        raise ConfigError(f"{path}: {error.reason}") from None
