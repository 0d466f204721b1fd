"""The curated SEC 10-Q question list (pipeline/corpora/sec10q_questions.jsonl): its shape, its
split, and that the held-out questions share no gold figure with the tuning ones. Pure, no engine.
"""

from __future__ import annotations

import json
import re
from collections import Counter
from pathlib import Path
from typing import Any

import pytest

QUESTIONS_FILE = Path(__file__).resolve().parent.parent / "pipeline/corpora/sec10q_questions.jsonl"

FIELDS: dict[str, type] = {
    "id": str,
    "filing": str,
    "split": str,
    "question": str,
    "figure": str,
    "scale": str,
    "unit": str,
    "page": int,
    "source": str,
    "evidence": str,
}
SCALES = {"million", "billion", "thousand", ""}
UNITS = {"usd", "percent", "shares", "count", "usd_per_share"}
SOURCES = {"table", "prose"}
FIGURE = re.compile(r"-?\d{1,3}(,\d{3})*(\.\d+)?|-?\d+(\.\d+)?")
FILING = re.compile(r"20\d\d Q[1-4] [A-Z]+\.pdf")


def normalize(figure: str) -> str:
    """The figure's value for comparison: no commas, no sign, no trailing decimal zeros."""
    value = figure.replace(",", "").lstrip("-")
    if "." in value:
        value = value.rstrip("0").rstrip(".")
    return value


@pytest.fixture(scope="module")
def questions() -> list[dict[str, Any]]:
    lines = QUESTIONS_FILE.read_text(encoding="utf-8").splitlines()
    return [json.loads(line) for line in lines if line.strip()]


def test_every_line_has_exactly_the_fields_with_their_types(questions):
    assert questions
    for q in questions:
        assert set(q) == set(FIELDS), q.get("id")
        for key, kind in FIELDS.items():
            assert type(q[key]) is kind, (q["id"], key)
        assert q["id"] and q["question"].strip() and q["evidence"].strip(), q["id"]


def test_ids_are_unique(questions):
    counts = Counter(q["id"] for q in questions)
    assert [i for i, n in counts.items() if n > 1] == []


def test_split_is_heldout_exactly_for_2023_q2_filings(questions):
    for q in questions:
        assert FILING.fullmatch(q["filing"]), q["id"]
        expected = "heldout" if q["filing"].startswith("2023 Q2 ") else "tune"
        assert q["split"] == expected, q["id"]


def test_enough_heldout_questions(questions):
    heldout = [q for q in questions if q["split"] == "heldout"]
    assert len(heldout) >= 30
    per_filing = Counter(q["filing"] for q in heldout)
    assert per_filing, "no held-out filing"
    for filing, count in per_filing.items():
        assert count >= 5, filing


def test_heldout_figures_share_no_value_with_tune_figures(questions):
    tune = {normalize(q["figure"]) for q in questions if q["split"] == "tune"}
    shared = [
        (q["id"], q["figure"])
        for q in questions
        if q["split"] == "heldout" and normalize(q["figure"]) in tune
    ]
    assert shared == []


def test_figures_are_plain_numbers(questions):
    for q in questions:
        assert FIGURE.fullmatch(q["figure"]), (q["id"], q["figure"])


def test_scale_unit_source_and_page_are_allowed(questions):
    for q in questions:
        assert q["scale"] in SCALES, q["id"]
        assert q["unit"] in UNITS, q["id"]
        assert q["source"] in SOURCES, q["id"]
        assert q["page"] >= 1, q["id"]


def test_normalize():
    assert normalize("-2,345") == "2345"
    assert normalize("64.0") == "64"
    assert normalize("1.20") == "1.2"
    assert normalize("280.5") == "280.5"
    assert normalize("100") == "100"
