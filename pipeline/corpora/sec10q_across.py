"""SEC 10-Q questions over a collection: each needs figures printed in two or three filings of
one company (a change between quarters, a total over quarters, the higher of two quarters).

The questions are memstream's own (`sec10q_across_questions.jsonl` beside this module), written
from Apple's 2022 Q3, 2023 Q1 and 2023 Q2 filings in the shared corpora before any run. Each
names its filings in reading order (oldest first), its answer as one figure with its scale and
unit, the operation that makes it from its figures, the spellings accepted for it, and each
figure with its filing, the 1-based PDF page it is printed on and the row it is read from.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from decimal import Decimal
from pathlib import Path

from pipeline.corpora import check_root
from pipeline.corpora.sec10q import FILINGS_FOLDER, parse_filing

QUESTIONS_FILE = Path(__file__).with_name("sec10q_across_questions.jsonl")
OPERATIONS = ("difference", "sum", "max")


@dataclass(frozen=True)
class PrintedFigure:
    filing: str
    figure: str  # as printed: "40,665", "1.20"
    page: int  # 1-based page of the PDF
    evidence: str  # the row it is read from, as the parsed text prints it

    @property
    def value(self) -> Decimal:
        return Decimal(self.figure.replace(",", ""))


@dataclass(frozen=True)
class AcrossQuestion:
    id: str
    company: str
    filings: tuple[str, ...]  # the collection, in reading order
    question: str
    answer: str  # as one would print it: "10,669"
    scale: str  # "", "thousand", "million" or "billion"
    unit: str  # "usd" or "usd_per_share"
    operation: str  # how `answer` is made from `figures`: "difference", "sum" or "max"
    accepted: tuple[str, ...]  # the answer's spellings, scored by value (answer mode "figure")
    figures: tuple[PrintedFigure, ...]

    def computed(self) -> Decimal:
        """The answer recomputed from the printed figures."""
        values = [figure.value for figure in self.figures]
        if self.operation == "difference":
            return abs(values[-1] - values[0])
        if self.operation == "sum":
            return sum(values, Decimal(0))
        return max(values)


def load_across_questions(path: Path = QUESTIONS_FILE) -> list[AcrossQuestion]:
    questions = []
    for line in path.read_text(encoding="utf-8").splitlines():
        if not line.strip():
            continue
        row = json.loads(line)
        row["filings"] = tuple(row["filings"])
        row["accepted"] = tuple(row["accepted"])
        row["figures"] = tuple(PrintedFigure(**figure) for figure in row["figures"])
        questions.append(AcrossQuestion(**row))
    return questions


@dataclass(frozen=True)
class ParsedFiling:
    name: str
    text: str
    page_starts: tuple[int, ...]


def load_parsed_filings(root: Path, names: set[str]) -> dict[str, ParsedFiling]:
    """Each named filing parsed as `memstream ask` parses a PDF, with its page starts; a
    filing is parsed once per process."""
    folder = check_root(root) / FILINGS_FOLDER
    return {name: _parsed(folder / name) for name in sorted(names)}


def _parsed(path: Path) -> ParsedFiling:
    parsed = parse_filing(path)
    return ParsedFiling(path.name, parsed.text, tuple(parsed.page_starts))
