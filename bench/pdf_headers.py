"""What writing PDF table rows with their column headers costs: tokens of the default model's
tokenizer and parse time, on the 15 SEC 10-Q filings of shared/corpora/qa/sec10q-dev, with the
headers (memstream's `parse_document`) and without them (`headed_rows` replaced by one that
heads no row), in one process, the order alternated per filing and round.

    .venv/bin/python bench/pdf_headers.py [--rounds N]

Writes bench/results/pdf_headers.json.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any

from pdf_parsers import CORPORA, RESULTS, cpu

import operators.parsing.pdf_text as pdf_text
from connectors.engines.factory import DEFAULT_MODEL, EngineSpec, load_tokenizer
from operators.parsing import parse_document

FILINGS = CORPORA / "qa" / "sec10q-dev" / "docs"


def _no_headers(lines: Any, joined: Any) -> dict[int, str]:
    return {}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    headed_rows = pdf_text.headed_rows
    variants = {"headed": headed_rows, "rows": _no_headers}
    filings = sorted(FILINGS.glob("*.pdf"))
    data = [path.read_bytes() for path in filings]
    seconds = dict.fromkeys(variants, 0.0)
    texts: dict[str, list[str]] = {name: [] for name in variants}
    for round_ in range(args.rounds):
        for index, content in enumerate(data):
            order = list(variants) if (index + round_) % 2 else list(reversed(variants))
            for name in order:
                pdf_text.headed_rows = variants[name]
                started = time.perf_counter()
                text = parse_document(content, filings[index].name).text
                seconds[name] += time.perf_counter() - started
                if round_ == 0:
                    texts[name].append(text)
    pdf_text.headed_rows = headed_rows
    tokenizer = load_tokenizer(EngineSpec(model=DEFAULT_MODEL))
    tokens = {name: sum(len(tokenizer(t).input_ids) for t in texts[name]) for name in variants}
    result = {
        "command": "python bench/pdf_headers.py --rounds " + str(args.rounds),
        "cpu": cpu(),
        "filings": len(filings),
        "tokenizer": DEFAULT_MODEL,
        "tokens": tokens,
        "token_ratio": round(tokens["headed"] / tokens["rows"], 3),
        "parse_seconds": {name: round(value, 1) for name, value in seconds.items()},
        "parse_time_ratio": round(seconds["headed"] / seconds["rows"], 3),
    }
    out = Path(RESULTS) / "pdf_headers.json"
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
