"""How should the answer step show a table row, and in what order its passages? Saved `sec10q`
runs' answer steps replayed on the real engine, paired: each question's final memory and the
passages a re-read chooses, with rows as the parser writes them ("AWS, Operating income: Three
Months Ended June 30, 2022 $ 5,715; Three Months Ended June 30, 2023 $ 5,365; ...") and with
each cell on a line of its own after its row's label and column header ("AWS, Operating income,
Three Months Ended June 30, 2023: $ 5,365"), each chosen within the budget by what it shows; and
the cells with the passages best last, nearest the memory and the question, instead of in
document order; and each row narrowed to the cells of the period the question asks for
("... three months ended June 30, 2023?" keeps that quarter's cell), in the passages alone or
in the memory too. The memory is otherwise shown as the model wrote it. Only the answer step runs:
the memories come from each run's results.json, so a cell costs one model call a question.

    .venv/bin/python bench/reread_rendering.py --runs bench/results/eval-sec10q/headed-0.5b \
        [--method memstream:verified-quotes+reread6000] [--split tune] [--samples N]

Results: bench/results/reread_rendering-[VARIANT-]SPLIT.json and .md, with the CPU and the dtype.
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import json
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import common
from reread_recall import question_of

from connectors.engines.factory import EngineSpec, load_tokenizer
from operators.config import MethodConfig
from operators.core.extraction import extract_answer
from operators.core.figures import (
    cells_as_lines,
    headed_cells,
    other_period,
    period_keys,
    states_figure,
)
from operators.core.retrieval import as_printed, render_passages, select_passages, split_passages
from operators.core.segmentation import SegmentationConfig, segment, tokenize
from operators.core.templates import INITIAL_MEMORY, get_template_set
from pipeline.corpora.sec10q import load_filings, load_questions


def _as_printed(text: str, question: str) -> str:
    return as_printed(text)


def _all_cells(text: str, question: str) -> str:
    return cells_as_lines(text)


def _cells_of_the_asked_period(text: str, question: str) -> str:
    """Each cell on a line, a row showing only the cells of the period the question asks for
    where its headers tell periods apart (`figures.other_period`, the grounding check's rule): a
    cell under no period ("% Change") stays, and a row with no cell of that period keeps all."""
    asked = period_keys(question.lower())
    lines = []
    for line in text.split("\n"):
        row = headed_cells(line)
        if row is None:
            lines.append(line)
            continue
        label, cells = row
        headers = "; ".join(header for header, _ in cells).lower()
        kept = [
            (header, value)
            for header, value in cells
            if not period_keys(header.lower()) or not other_period(header.lower(), headers, asked)
        ]
        if not any(period_keys(header.lower()) for header, _ in kept):
            kept = cells
        lines.extend(
            f"{label}, {header}: {value}" if header else f"{label}: {value}"
            for header, value in kept
        )
    return "\n".join(lines)


def _as_written(memory: str, question: str) -> str:
    return memory


@dataclass(frozen=True)
class Rendering:
    show: Callable[[str, str], str]  # a passage's text, given the question
    best_last: bool  # the passages best last (nearest the memory and the question), or in order
    memory: Callable[[str, str], str] = _as_written  # the final memory, given the question


RENDERINGS = {
    "rows": Rendering(_as_printed, best_last=False),
    "cells": Rendering(_all_cells, best_last=False),
    "cells-best-last": Rendering(_all_cells, best_last=True),
    # A row shows only the cells of the period the question asks for: tried, and it lost.
    "asked-cells": Rendering(_cells_of_the_asked_period, best_last=True),
    "asked-cells-memory": Rendering(
        _cells_of_the_asked_period, best_last=True, memory=_cells_of_the_asked_period
    ),
}
SPLITS = {"tune": "sec10q-tune-", "heldout": "sec10q-2023q2-"}


def report(payload: dict[str, Any]) -> str:
    rows, names = payload["rows"], payload["renderings"]
    n = len(rows)

    def mark(answer: str | None, right: bool) -> str:
        return f"{answer} ({'right' if right else 'wrong'})"

    return "\n".join([
        f"# Table rows in the answer step: {payload['split']} `sec10q` questions",
        "",
        f"{n} questions, the answer step of `{payload['method']}` replayed on "
        f"{payload['model']} ({payload['dtype']}) with the final memories of "
        f"{', '.join(payload['runs'])}; {payload['seconds']:.0f} s for "
        f"{payload['calls']} calls, one at a time. Saved: that run's answers "
        f"({sum(r['saved_right'] for r in rows)} right).",
        "",
        *common.table(
            ["rendering", "right", "right where the saved answer is wrong",
             "wrong where the saved answer is right", "prompt tokens (mean)"],
            [(name, f"{sum(r[f'{name}_right'] for r in rows)}/{n}",
              sum(r[f"{name}_right"] and not r["saved_right"] for r in rows),
              sum(r["saved_right"] and not r[f"{name}_right"] for r in rows),
              f"{sum(r[f'{name}_prompt_tokens'] for r in rows) / n:,.0f}") for name in names],
        ),
        "",
        *common.table(
            ["question", "gold", "saved", *names],
            [(r["question"], r["gold"], mark(r["saved"], r["saved_right"]),
              *(mark(r[name], r[f"{name}_right"]) for name in names)) for r in rows],
        ),
        "",
        f"Command: `{payload['command']}`",
    ])  # fmt: skip


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=Path, nargs="+", required=True)
    parser.add_argument("--method", default="memstream:verified-quotes+reread6000")
    parser.add_argument("--split", choices=sorted(SPLITS), default="tune")
    parser.add_argument("--samples", type=int, default=None, help="the first N questions")
    parser.add_argument(
        "--variant", default="", help="results in reread_rendering-VARIANT-SPLIT.json and .md"
    )
    parser.add_argument(
        "--renderings", type=lambda text: text.split(","), default=list(RENDERINGS),
        help=f"of {', '.join(RENDERINGS)}; the saved run's answers are the rows' where "
        "the replay reproduces them",
    )  # fmt: skip
    args = parser.parse_args()
    questions = {question.id: question for question in load_questions()}
    asked: dict[str, tuple[dict[str, Any], Any]] = {}
    for run in args.runs:
        results = json.loads((run / "results.json").read_text())
        for prediction in results["predictions"]:
            sample = prediction["sample_id"]
            if prediction["method"] == args.method and sample.startswith(SPLITS[args.split]):
                asked.setdefault(sample, (prediction, question_of(sample, questions)))
    chosen = list(asked.values())[: args.samples]
    if not chosen:
        raise SystemExit(f"no {args.split} predictions of {args.method} in {args.runs}")
    budget = int(args.method.rsplit("+reread", 1)[1])
    template = args.method.split(":", 1)[1].split("+", 1)[0]
    spec = EngineSpec(model=results["model"], max_model_len=16384, enforce_eager=True).resolved()
    tokenizer = load_tokenizer(spec)
    texts = load_filings(common.CORPORA, {question.filing for _, question in chosen})
    config = SegmentationConfig(chunk_size=results["settings"]["chunk_size"])
    segments = {
        filing: segment(tokenize(filing, text, tokenizer), tokenizer, config)
        for filing, text in texts.items()
    }
    templates = get_template_set(template)
    prompts = {}
    for prediction, question in chosen:
        memory = prediction["final_memory"] or ""
        hints = "" if memory.strip() == INITIAL_MEMORY else memory
        asked = prediction["question"]
        for name in args.renderings:
            rendering = RENDERINGS[name]
            show = functools.partial(rendering.show, question=asked)
            passages = split_passages(segments[question.filing], show=show)
            reread = select_passages(passages, asked, budget, hints, rendering.best_last)
            prompts[question.id, name] = templates.render_reread(
                asked, rendering.memory(memory, asked), render_passages(reread)
            )
    started = time.perf_counter()
    replies = asyncio.run(
        common.replay_prompts(
            spec, prompts, results["settings"]["max_answer_tokens"], MethodConfig().sampling()
        )
    )
    elapsed = time.perf_counter() - started
    rows = []
    for prediction, question in chosen:
        row: dict[str, Any] = {"question": question.id, "gold": prediction["gold"][0]}
        row["saved"] = prediction["prediction"]
        row["saved_right"] = prediction["scores"]["accuracy"] >= 1
        for name in args.renderings:
            reply = replies[question.id, name]
            row[name] = extract_answer(reply.text)
            row[f"{name}_right"] = states_figure(row[name], prediction["gold"])
            row[f"{name}_prompt_tokens"] = reply.prompt_tokens
        rows.append(row)
    payload = {
        "command": " ".join([".venv/bin/python bench/reread_rendering.py", *sys.argv[1:]]),
        "runs": [str(run) for run in args.runs], "method": args.method, "split": args.split,
        "model": results["model"], "dtype": spec.dtype, "seconds": elapsed,
        "calls": len(prompts), "renderings": args.renderings, "rows": rows,
    }  # fmt: skip
    markdown = report(payload)
    name = "-".join(["reread_rendering", *filter(None, [args.variant]), args.split])
    common.write_results(name, payload, markdown)
    print(markdown)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
