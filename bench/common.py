"""Shared bits of the benchmarks: a mixed-length corpus of real text, and result writers."""

from __future__ import annotations

import json
import platform
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
CORPORA = REPO.parent / "shared" / "corpora"
RESULTS = REPO / "bench" / "results"


def real_text(min_chars: int) -> str:
    """Concatenated real long texts (RFC 2616 and two Gutenberg books), repeated if needed."""
    parts = [
        (CORPORA / "text" / name).read_text(encoding="utf-8-sig")
        for name in (
            "rfc2616-http-1.1.txt",
            "gutenberg-1661-adventures-of-sherlock-holmes.txt",
            "gutenberg-1342-pride-and-prejudice.txt",
        )
    ]
    text = "\n".join(parts)
    while len(text) < min_chars:
        text += "\n" + text
    return text


def documents_of_lengths(tokenizer: Any, lengths: list[int]) -> list[tuple[str, str]]:
    """(doc_id, text) pairs cut from real text at exact token lengths, from different offsets."""
    text = real_text(sum(lengths) * 6)
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    documents, offset = [], 0
    for index, length in enumerate(lengths):
        documents.append((f"doc{index}-{length}", tokenizer.decode(ids[offset : offset + length])))
        offset += length
    return documents


def write_results(name: str, payload: dict[str, Any], markdown: str) -> None:
    RESULTS.mkdir(parents=True, exist_ok=True)
    payload = {
        "benchmark": name,
        "date": time.strftime("%Y-%m-%dT%H:%M:%S"),
        "machine": f"{platform.machine()}, {platform.processor() or 'cpu'}",
        **payload,
    }
    (RESULTS / f"{name}.json").write_text(json.dumps(payload, indent=2) + "\n")
    (RESULTS / f"{name}.md").write_text(markdown + "\n")
    print(markdown)
