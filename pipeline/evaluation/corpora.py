"""Reads the shared corpora (never copied into the repository): HotpotQA and long texts; CUAD's
contracts are in pipeline.corpora.cuad, shared with training."""

from __future__ import annotations

import json
from pathlib import Path

from pipeline.corpora import DEFAULT_CORPORA, check_root
from pipeline.evaluation.hotpotqa import HotpotExample, parse_hotpotqa

__all__ = ["DEFAULT_CORPORA", "load_hotpotqa", "load_texts"]

HOTPOTQA_FILE = "qa/hotpotqa_dev50/hotpotqa_dev_distractor_first50.json"
TEXTS_FOLDER = "text"


def load_hotpotqa(root: Path) -> list[HotpotExample]:
    records = json.loads((check_root(root) / HOTPOTQA_FILE).read_text(encoding="utf-8"))
    return parse_hotpotqa(records)


def load_texts(root: Path) -> dict[str, str]:
    """Every `.txt` of the texts folder by file stem, in name order, without a BOM."""
    paths = sorted((check_root(root) / TEXTS_FOLDER).glob("*.txt"))
    if not paths:
        raise FileNotFoundError(f"no .txt files in {root / TEXTS_FOLDER}")
    return {path.stem: path.read_text(encoding="utf-8-sig") for path in paths}
