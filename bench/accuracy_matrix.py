"""The model x memory strategy table of docs/accuracy.md, built from `memstream
eval` result folders and `bench/demo_strategies.py` results rather than copied by hand.

    .venv/bin/python bench/accuracy_matrix.py \\
        bench/results/eval-niah-8k-strategies bench/results/eval-niah bench/results/eval-xeon/* \\
        --demo bench/results/demo_strategies-*.json

A cell is kept only when it was measured with the settings asked for (chunk, memory and answer
tokens, greedy) and with this version's wording of its strategy (the template digest its run
recorded). A cell found in several folders is taken from the last one given, so list the older
folders first. Cells from a CPU other than the one most cells came from are marked. Written to
bench/results/accuracy_matrix.{json,md}.
"""

from __future__ import annotations

import argparse
import json
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import common

from operators.core.templates import TEMPLATE_SETS
from pipeline.evaluation.report import RESULTS_JSON, GroundingStats, read_results
from pipeline.evaluation.results import (
    ConfigurationRun,
    Prediction,
    calls_in_sitting,
    predictions_of,
)
from pipeline.evaluation.resuming import recorded_template_digests

NIAH_LENGTHS = ("8k", "32k", "128k")
STRATEGIES = ("verified-quotes", "segment-first", "memagent-reference")
OTHER_CPU = "†"


@dataclass
class Cell:
    predictions: list[Prediction]
    run: ConfigurationRun
    folder: str
    machine: str

    @property
    def accuracy(self) -> float:
        return sum(p.scores["accuracy"] for p in self.predictions) / len(self.predictions)

    @property
    def seconds_per_call(self) -> float:
        return self.run.seconds / max(1, calls_in_sitting(self.predictions))


def current_digests() -> dict[str, str]:
    return {f"memstream:{name}": templates.digest for name, templates in TEMPLATE_SETS.items()}


def collect_cells(
    folders: list[Path], settings: dict[str, Any]
) -> dict[tuple[str, str, str, str], Cell]:
    """(model, method, task, length) -> the last folder's cell measured as asked."""
    digests = current_digests()
    cells: dict[tuple[str, str, str, str], Cell] = {}
    for folder in folders:
        metadata, outcome = read_results(folder / RESULTS_JSON)
        measured = metadata.get("settings", {})
        if any(measured.get(key) != value for key, value in settings.items()):
            continue
        recorded = recorded_template_digests(metadata)
        for run in outcome.runs:
            configuration = run.configuration
            if recorded.get(configuration.method) != digests.get(configuration.method):
                continue  # direct reading, or a strategy measured under other wording
            members = predictions_of(run, outcome.predictions)
            if not members:
                continue
            key = (
                metadata["model"],
                configuration.method.removeprefix("memstream:"),
                configuration.task,
                configuration.length_label,
            )
            machine = run.machine or f"a CPU not recorded, {metadata.get('dtype') or 'dtype?'}"
            cells[key] = Cell(members, run, str(folder), machine)
    return cells


def demo_cells(paths: list[Path], scale: float, chunk_size: int) -> dict[tuple[str, str], dict]:
    """(model, template) -> the demo_strategies row, with the run's CPU, seconds and calls."""
    found: dict[tuple[str, str], dict] = {}
    for path in paths:
        result = json.loads(path.read_text())
        if result["scale"] != scale or result["chunk_size"] != chunk_size:
            continue
        for row in result["rows"]:
            found[(result["model"], row["template"])] = {
                **row,
                "cpu": result["cpu"]["model"],
                "seconds_per_call": result["seconds"] / result["model_calls"],
                "file": str(path),
            }
    return found


def grounding_cell(cells: list[Cell]) -> str:
    stats = GroundingStats.of([p for cell in cells for p in cell.predictions])
    if not stats.answered:
        return "no answer"
    grounded, ungrounded = stats.accuracies()
    return (
        f"{stats.grounded} of {stats.answered}; {grounded} vs {ungrounded}; "
        f"{stats.wrong_rate_ratio}"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("folders", nargs="+", type=Path, help="memstream eval --output folders")
    parser.add_argument("--demo", nargs="*", type=Path, default=[], help="demo_strategies json")
    parser.add_argument("--chunk-size", type=int, default=5000)
    parser.add_argument("--max-memory-tokens", type=int, default=256)
    parser.add_argument("--max-answer-tokens", type=int, default=64)
    parser.add_argument("--demo-scale", type=float, default=0.3)
    args = parser.parse_args()
    settings = {
        "chunk_size": args.chunk_size,
        "max_memory_tokens": args.max_memory_tokens,
        "max_answer_tokens": args.max_answer_tokens,
        "temperature": 0.0,
    }
    cells = collect_cells([f for f in args.folders if (f / RESULTS_JSON).exists()], settings)
    demos = demo_cells(args.demo, args.demo_scale, args.chunk_size)
    machines = Counter(cell.machine for cell in cells.values())
    usual = machines.most_common(1)[0][0] if machines else "?"
    models = list(dict.fromkeys(sorted({key[0] for key in cells} | {key[0] for key in demos})))

    def shown(cell: Cell | None) -> str:
        if cell is None:
            return "not run"
        mark = OTHER_CPU if cell.machine != usual else ""
        n = len(cell.predictions)
        return f"{cell.accuracy:.2f}{mark} ({n}), {cell.seconds_per_call:.1f} s"

    def demo_shown(row: dict | None) -> str:
        if row is None:
            return "not run"
        return (
            f"{row['found']}/{row['facts']} ({row['grounded']} grounded), "
            f"{row['seconds_per_call']:.1f} s"
        )

    rows, records = [], []
    for model in models:
        for strategy in STRATEGIES:
            niah = [cells.get((model, strategy, "niah", length)) for length in NIAH_LENGTHS]
            cuad = cells.get((model, strategy, "cuad", "native"))
            demo = demos.get((model, strategy))
            rows.append((
                model, f"`{strategy}`", *(shown(cell) for cell in niah), shown(cuad),
                demo_shown(demo),
                grounding_cell([cell for cell in niah if cell]),
                grounding_cell([cuad] if cuad else []),
            ))  # fmt: skip
            records.append({
                "model": model, "strategy": strategy,
                "cells": {f"niah-{length}": _record(cell)
                          for length, cell in zip(NIAH_LENGTHS, niah, strict=True)}
                | {"cuad": _record(cuad)},
                "demo": demo,
            })  # fmt: skip
    others = sorted({cell.machine for cell in cells.values()} - {usual})
    markdown = "\n".join([
        f"Accuracy (samples), seconds per model call. Settings: chunk {args.chunk_size}, memory "
        f"{args.max_memory_tokens}, answer {args.max_answer_tokens}, greedy; each strategy as "
        f"this version words it. Cells on {usual} unless marked {OTHER_CPU} "
        f"({'; '.join(others) or 'none'}). Grounding: grounded answers of those given; accuracy "
        "of grounded vs ungrounded ones; how many times more often an ungrounded one is wrong.",
        "",
        *common.table(
            ["model", "strategy", "NIAH 8K", "NIAH 32K", "NIAH 128K", "CUAD",
             f"demo facts (scale {args.demo_scale:g})", "grounding, NIAH", "grounding, CUAD"],
            rows,
        ),
    ])  # fmt: skip
    common.write_results(
        "accuracy_matrix", {"settings": settings, "rows": records}, markdown, measured_here=False
    )


def _record(cell: Cell | None) -> dict[str, Any] | None:
    if cell is None:
        return None
    return {
        "accuracy": cell.accuracy,
        "samples": len(cell.predictions),
        "seconds_per_call": cell.seconds_per_call,
        "machine": cell.machine,
        "folder": cell.folder,
    }


if __name__ == "__main__":
    main()
