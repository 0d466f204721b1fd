"""CUAD contract labels, read from the shared corpora: one natural question per labelled category
of a contract and its gold answers with how they combine (every party named; a date in any usual
spelling, compared as dates). `memstream eval` asks them over whole contracts
(pipeline.evaluation.cuad); `memstream train --task cuad` trains on them
(pipeline.training.contract_fields).

Categories whose answer is only "Yes" or "No" (clause present or not) are left out: they test
classification, not reading. Dates, given by CUAD as m/d/yyyy, also accept the usual spellings.
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from operators.config import ConfigError
from operators.core.scoring import AnswerMode
from operators.parsing import ParseError, parse_document
from pipeline.corpora import check_root

CUAD_LABELS_FILE = "qa/cuad/cuad_labels_for_pdfs_contracts.json"

PRIORITY_CATEGORIES = ("Parties", "Governing Law", "Agreement Date", "Expiration Date")

QUESTIONS = {
    "Document Name": "What is the title of this agreement?",
    "Parties": "Who are the parties to this agreement?",
    "Agreement Date": "On what date was this agreement made?",
    "Effective Date": "On what date does this agreement take effect?",
    "Expiration Date": "When does this agreement expire, or how long does its initial term last?",
    "Renewal Term": "For how long does this agreement renew after its initial term ends?",
    "Notice Period To Terminate Renewal": (
        "How much notice must a party give to prevent this agreement from renewing?"
    ),
    "Governing Law": "The laws of which state or country govern this agreement?",
}

_MONTHS = (
    "January", "February", "March", "April", "May", "June", "July", "August", "September",
    "October", "November", "December",
)  # fmt: skip
_DATE = re.compile(r"(\d{1,2})/(\d{1,2})/(\d{4})")
# A defined-term alias after a party's name: (“Photronics”), ("Licensee").
_ALIAS = re.compile(r"\s*\([^)]*\)")


@dataclass(frozen=True)
class ContractLabel:
    category: str
    answer: str
    context_spans: tuple[str, ...]


@dataclass(frozen=True)
class Contract:
    name: str
    pdf: str  # path relative to the corpora folder
    labels: tuple[ContractLabel, ...]


def parse_cuad_labels(data: dict[str, Any]) -> list[Contract]:
    contracts = []
    for entry in data["contracts"]:
        pdf = entry["pdf"]
        labels = tuple(
            ContractLabel(
                category=label["category"],
                answer=(label.get("answer") or "").strip(),
                context_spans=tuple(label.get("context_spans") or ()),
            )
            for label in entry["labels"]
        )
        contracts.append(Contract(name=_contract_name(pdf), pdf=pdf, labels=labels))
    return contracts


def is_extractive(label: ContractLabel) -> bool:
    return bool(label.answer) and label.answer.lower() not in ("yes", "no")


def question_for(category: str) -> str:
    return QUESTIONS.get(category, f"What does this agreement say about {category.lower()}?")


def answers_for(label: ContractLabel) -> tuple[tuple[str, ...], AnswerMode]:
    """The reference answers and how they combine: the parties all count, dates any spelling."""
    if label.category == "Parties":
        return party_names(label), "all"
    date = _DATE.fullmatch(label.answer)
    if date:
        return date_spellings(int(date[1]), int(date[2]), int(date[3])), "date"
    return (label.answer,), "any"


def party_names(label: ContractLabel) -> tuple[str, ...]:
    """The parties CUAD lists, without their defined-term aliases; entries that only group
    parties under a role ("Photronics and DNP ("Shareholders")") are dropped by keeping the
    names CUAD also marks in the text, when it marks any."""
    entries = [_ALIAS.sub("", entry).strip(" ;,") for entry in label.answer.split(";")]
    entries = [entry for entry in entries if entry]
    marked = [entry for entry in entries if entry in label.context_spans]
    return tuple(marked or entries)


def date_spellings(month: int, day: int, year: int) -> tuple[str, ...]:
    name = _MONTHS[month - 1]
    return (
        f"{month}/{day}/{year}",
        f"{name} {day}, {year}",
        f"{day} {name} {year}",
        f"{_ordinal(day)} day of {name}, {year}",
        f"{year}-{month:02d}-{day:02d}",
    )


def _ordinal(day: int) -> str:
    suffix = "th" if 10 <= day % 100 <= 20 else {1: "st", 2: "nd", 3: "rd"}.get(day % 10, "th")
    return f"{day}{suffix}"


def ordered_labels(contracts: Sequence[Contract]) -> list[tuple[Contract, ContractLabel]]:
    """The four headline categories of every contract first, then the other extractive ones."""
    pairs = [(c, label) for c in contracts for label in c.labels if is_extractive(label)]

    def rank(pair: tuple[Contract, ContractLabel]) -> tuple[int, int]:
        category = pair[1].category
        if category in PRIORITY_CATEGORIES:
            return 0, PRIORITY_CATEGORIES.index(category)
        return 1, 0

    return sorted(pairs, key=rank)


def load_cuad(root: Path) -> list[tuple[Contract, str]]:
    """Each labelled contract with the text of its PDF, parsed as `memstream ask` parses it."""
    data = json.loads((check_root(root) / CUAD_LABELS_FILE).read_text(encoding="utf-8"))
    contracts = []
    for contract in parse_cuad_labels(data):
        path = root / contract.pdf
        try:
            parsed = parse_document(path.read_bytes(), path.name)
        except ParseError as error:
            raise ConfigError(f"{path}: {error.reason}") from None
        contracts.append((contract, parsed.text))
    return contracts


def _contract_name(pdf: str) -> str:
    return pdf.rsplit("/", 1)[-1].split("_", 1)[0]
