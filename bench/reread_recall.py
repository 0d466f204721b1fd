"""Does the re-read put the answer in front of the model? For each `sec10q` question of a saved
`memstream eval` run, the passages a re-read of each budget chooses (the question and that run's
final memory, as the answer step ranks them) and whether the question's figure is printed in
them, beside whether the run's answer was right. No engine: the final memories come from the
run's results.json.

    .venv/bin/python bench/reread_recall.py [--run bench/results/eval-sec10q/heldout30-0.5b]
        [--method memstream:verified-quotes+reread6000] [--budgets 1000,2000,3000,6000]

Results: bench/results/reread_recall.json and .md.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import common

from connectors.engines import models
from operators.core.retrieval import select_passages, split_passages
from operators.core.segmentation import SegmentationConfig, segment, tokenize
from operators.core.templates import INITIAL_MEMORY
from pipeline.corpora.sec10q import FigureQuestion, load_filings, load_questions
from pipeline.training.rollout import load_tokenizer

TASK_PREFIXES = ("sec10q-tune-", "sec10q-")  # sample ids are the task and the question's id


def printed_in(figure: str, text: str) -> bool:
    """Whether `figure`'s digits ("5,365", "22.6") are printed in `text` as a whole number."""
    digits = figure.lstrip("-")
    return re.search(rf"(?<![\d.,]){re.escape(digits)}(?!\d|[.,]\d)", text) is not None


def question_of(sample_id: str, questions: dict[str, FigureQuestion]) -> FigureQuestion:
    for prefix in TASK_PREFIXES:
        if sample_id.startswith(prefix) and sample_id[len(prefix) :] in questions:
            return questions[sample_id[len(prefix) :]]
    raise KeyError(f"{sample_id}: no such sec10q question")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--run", type=Path, default=common.RESULTS / "eval-sec10q/heldout30-0.5b")
    parser.add_argument("--method", default="memstream:verified-quotes+reread6000")
    parser.add_argument("--budgets", default="1000,2000,3000,6000")
    args = parser.parse_args()
    budgets = [int(budget) for budget in args.budgets.split(",")]
    results = json.loads((args.run / "results.json").read_text())
    settings = results["settings"]
    questions = {question.id: question for question in load_questions()}
    predictions = [p for p in results["predictions"] if p["method"] == args.method]
    if not predictions:
        raise SystemExit(f"{args.run}: no predictions of {args.method}")
    asked = [(p, question_of(p["sample_id"], questions)) for p in predictions]
    texts = load_filings(common.CORPORA, {question.filing for _, question in asked})
    tokenizer = load_tokenizer(models.resolve(results["model"]))
    config = SegmentationConfig(chunk_size=settings["chunk_size"])
    passages = {
        filing: split_passages(segment(tokenize(filing, text, tokenizer), tokenizer, config))
        for filing, text in texts.items()
    }
    rows = []
    for prediction, question in asked:
        memory = prediction["final_memory"] or ""
        hints = "" if memory.strip() == INITIAL_MEMORY else memory
        found = {
            budget: printed_in(
                question.figure,
                " ".join(
                    p.text
                    for p in select_passages(
                        passages[question.filing], prediction["question"], budget, hints=hints
                    )
                ),
            )
            for budget in budgets
        }
        right = prediction["scores"]["accuracy"] >= 1
        rows.append({"question": question.id, "right": right, "found": found})
    n = len(rows)
    summary = [
        {
            "budget": budget,
            "found": sum(row["found"][budget] for row in rows),
            "wrong_though_found": sum(not row["right"] and row["found"][budget] for row in rows),
            "right_though_not_found": sum(
                row["right"] and not row["found"][budget] for row in rows
            ),
        }
        for budget in budgets
    ]
    right = sum(row["right"] for row in rows)
    markdown = "\n".join([
        f"Whether the re-read shows the model the figure a `sec10q` question asks for: the "
        f"passages each budget chooses (question + {args.run.name}'s final memories of "
        f"`{args.method}`, model {results['model']}, chunk {settings['chunk_size']}), "
        f"{n} questions, {right} answered right by that run.",
        "",
        *common.table(
            ["re-read budget (tokens)", "figure in the passages", "wrong though shown",
             "right though not shown"],
            [(s["budget"], f"{s['found']}/{n}", s["wrong_though_found"],
              s["right_though_not_found"]) for s in summary],
        ),
        "",
        f"Command: `{' '.join(['.venv/bin/python bench/reread_recall.py', *sys.argv[1:]])}`",
    ])  # fmt: skip
    payload = {
        "command": " ".join([".venv/bin/python bench/reread_recall.py", *sys.argv[1:]]),
        "run": str(args.run.relative_to(common.REPO)) if args.run.is_absolute() else str(args.run),
        "method": args.method, "model": results["model"], "questions": n, "right": right,
        "budgets": summary, "rows": rows,
    }  # fmt: skip
    common.write_results("reread_recall", payload, markdown)
    print(markdown)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
