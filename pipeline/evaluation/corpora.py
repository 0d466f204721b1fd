"""Reads the shared corpora (never copied into the repository): HotpotQA, CUAD, long texts."""

from __future__ import annotations

import json
from pathlib import Path

from operators.parsing import ParseError, parse_document
from pipeline.evaluation.cuad import Contract, parse_cuad_labels
from pipeline.evaluation.hotpotqa import HotpotExample, parse_hotpotqa

REPOSITORY = Path(__file__).resolve().parents[2]
DEFAULT_CORPORA = REPOSITORY.parent / "shared" / "corpora"
HOTPOTQA_FILE = "qa/hotpotqa_dev50/hotpotqa_dev_distractor_first50.json"
CUAD_LABELS_FILE = "qa/cuad/cuad_labels_for_pdfs_contracts.json"
TEXTS_FOLDER = "text"


def check_root(root: Path) -> Path:
    if not root.is_dir():
        raise FileNotFoundError(f"shared corpora not found at {root}; pass --corpora DIR")
    return root


def load_hotpotqa(root: Path) -> list[HotpotExample]:
    records = json.loads((check_root(root) / HOTPOTQA_FILE).read_text(encoding="utf-8"))
    return parse_hotpotqa(records)


def load_texts(root: Path) -> dict[str, str]:
    """Every `.txt` of the texts folder by file stem, in name order, without a BOM."""
    paths = sorted((check_root(root) / TEXTS_FOLDER).glob("*.txt"))
    if not paths:
        raise FileNotFoundError(f"no .txt files in {root / TEXTS_FOLDER}")
    return {path.stem: path.read_text(encoding="utf-8-sig") for path in paths}


def load_cuad(root: Path) -> list[tuple[Contract, str]]:
    """Each labelled contract with the text of its PDF, parsed as `memstream ask` parses it."""
    data = json.loads((check_root(root) / CUAD_LABELS_FILE).read_text(encoding="utf-8"))
    contracts = []
    for contract in parse_cuad_labels(data):
        path = root / contract.pdf
        try:
            parsed = parse_document(path.read_bytes(), path.name)
        except ParseError as error:
            raise ValueError(f"{path}: {error.reason}") from None
        contracts.append((contract, parsed.text))
    return contracts
