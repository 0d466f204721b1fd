"""Writes a run: `results.json` (every prediction), `results.md` (tables) and
`accuracy_vs_length.png` (one line per method, one panel per task)."""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from pipeline.evaluation.results import (
    Configuration,
    ConfigurationRun,
    Prediction,
    SummaryRow,
    calls_in_sitting,
    predictions_of,
    summarize,
)
from pipeline.evaluation.suite import SuiteOutcome

RESULTS_JSON = "results.json"
RESULTS_MARKDOWN = "results.md"
ACCURACY_PLOT = "accuracy_vs_length.png"

HEADLINE = {
    "hotpotqa": "sub_em",
    "niah": "the share of values given (normalized, whole words)",
    "cuad": (
        "sub_em; parties: the share given (normalized, whole words); dates: the date stated, "
        "in any spelling"
    ),
    "sec10q": "the figure's value",
    "sec10q-tune": "the figure's value",
    "sec10q-across": "the figure's value",
}
METRIC_COLUMNS = (
    ("accuracy", "accuracy"),
    ("em", "EM"),
    ("sub_em", "sub_em"),
    ("f1", "F1"),
    ("string_match_any", "match any"),
    ("string_match_all", "match all"),
    ("token_recall", "token recall"),
    ("raw_match", "raw match"),
    ("answered", "answered"),
    ("grounded", "grounded"),
)


def results_document(metadata: dict[str, Any], outcome: SuiteOutcome) -> dict[str, Any]:
    return {
        **metadata,
        "summary": [asdict(row) for row in summarize(outcome.predictions)],
        "configurations": [asdict(run) for run in outcome.runs],
        "skipped": [asdict(skipped) for skipped in outcome.skipped],
        "predictions": [asdict(prediction) for prediction in outcome.predictions],
    }


def read_results(path: Path) -> tuple[dict[str, Any], SuiteOutcome]:
    """The inverse of `results_document`: a run's metadata, and its runs and predictions."""
    document = json.loads(path.read_text())
    runs = [
        ConfigurationRun(**{**run, "configuration": Configuration(**run["configuration"])})
        for run in document.pop("configurations")
    ]
    predictions = [Prediction(**prediction) for prediction in document.pop("predictions")]
    for derived in ("summary", "skipped"):
        document.pop(derived, None)
    return document, SuiteOutcome(predictions=predictions, runs=runs)


def render_markdown(metadata: dict[str, Any], outcome: SuiteOutcome) -> str:
    predictions = outcome.predictions
    methods = list(dict.fromkeys(p.method for p in predictions))
    lines = [f"# memstream eval: {metadata.get('model', '?')}", ""]
    settings = metadata.get("settings", {})
    if settings:
        lines.append(", ".join(f"{key} {value}" for key, value in settings.items()))
        lines.append("")
    headline = ", ".join(
        f"{task}: {HEADLINE[task]}" for task in dict.fromkeys(p.task for p in predictions)
    )
    lines += [f"Accuracy is {headline}. Cells: accuracy (samples).", ""]
    lines += _accuracy_table(predictions, methods)
    lines += ["", "## Grounding", ""]
    lines += _grounding_table(predictions)
    lines += ["", "## All metrics", ""]
    lines += _metrics_table(summarize(predictions))
    if outcome.runs:
        lines += ["", "## Cost", ""]
        lines += _cost_table(outcome.runs, predictions)
    for task, title in (("niah", "NIAH by variant and depth"), ("cuad", "CUAD by category")):
        rows = [p for p in predictions if p.task == task]
        if rows:
            lines += ["", f"## {title}", ""]
            lines += _breakdown_table(rows, methods, with_depth=task == "niah")
    if outcome.skipped:
        lines += ["", "## Skipped", ""]
        lines += [f"- {s.configuration.describe()}: {s.reason}" for s in outcome.skipped]
    return "\n".join(lines) + "\n"


def _accuracy_table(predictions: Sequence[Prediction], methods: Sequence[str]) -> list[str]:
    rows = summarize(predictions)
    cells = {(r.group["task"], r.group["length_label"], r.group["method"]): r for r in rows}
    groups = list(dict.fromkeys((r.group["task"], r.group["length_label"]) for r in rows))
    tokens = {
        group: _mean([p.document_tokens for p in predictions if (p.task, p.length_label) == group])
        for group in groups
    }
    lines = [
        "| task | length | tokens (mean) | " + " | ".join(methods) + " |",
        "|---|---|---:|" + "---:|" * len(methods),
    ]
    for task, length in groups:
        values = [_cell(cells.get((task, length, method))) for method in methods]
        lines.append(
            f"| {task} | {length} | {tokens[(task, length)]:,.0f} | {' | '.join(values)} |"
        )
    return lines


@dataclass(frozen=True)
class GroundingStats:
    """Over the answers given: how many are grounded, and how often a grounded and an
    ungrounded answer is right. The flag is worth something when ungrounded answers are wrong
    much more often than grounded ones (`wrong_rate_ratio`)."""

    answered: int
    grounded: int
    accuracy_grounded: float | None
    accuracy_ungrounded: float | None

    @classmethod
    def of(cls, predictions: Sequence[Prediction]) -> GroundingStats:
        members = [
            p
            for p in predictions
            if p.status == "ok" and p.scores.get("answered") and "grounded" in p.scores
        ]
        grounded = [p.scores["accuracy"] for p in members if p.scores["grounded"]]
        ungrounded = [p.scores["accuracy"] for p in members if not p.scores["grounded"]]
        return cls(
            len(members),
            len(grounded),
            _mean(grounded) if grounded else None,
            _mean(ungrounded) if ungrounded else None,
        )

    @property
    def wrong_rate_ratio(self) -> str:
        """How many times more often an ungrounded answer is wrong: "n/a" without both kinds,
        "inf" when every grounded answer is right."""
        if self.accuracy_grounded is None or self.accuracy_ungrounded is None:
            return "n/a"
        wrong_grounded = 1 - self.accuracy_grounded
        wrong_ungrounded = 1 - self.accuracy_ungrounded
        return f"{wrong_ungrounded / wrong_grounded:.1f}" if wrong_grounded else "inf"

    def accuracies(self) -> tuple[str, str]:
        """The accuracy of grounded and of ungrounded answers, as table cells."""
        grounded, ungrounded = self.accuracy_grounded, self.accuracy_ungrounded
        return (
            "n/a" if grounded is None else f"{grounded:.2f}",
            "n/a" if ungrounded is None else f"{ungrounded:.2f}",
        )


def _grounding_table(predictions: Sequence[Prediction]) -> list[str]:
    lines = [
        "Over answered samples. wrong-rate ratio: how many times more often an ungrounded "
        "answer is wrong than a grounded one.",
        "",
        "| task | method | answered | grounded | accuracy, grounded | accuracy, ungrounded "
        "| wrong-rate ratio |",
        "|---|---|---:|---:|---:|---:|---:|",
    ]
    groups: dict[tuple[str, str], list[Prediction]] = {}
    for prediction in predictions:
        groups.setdefault((prediction.task, prediction.method), []).append(prediction)
    for (task, method), members in groups.items():
        stats = GroundingStats.of(members)
        if not stats.answered:
            continue
        grounded, ungrounded = stats.accuracies()
        lines.append(
            f"| {task} | {method} | {stats.answered} | {stats.grounded} | {grounded} "
            f"| {ungrounded} | {stats.wrong_rate_ratio} |"
        )
    return lines


def _metrics_table(rows: Sequence[SummaryRow]) -> list[str]:
    header = ["task", "length", "method", "n", *(title for _, title in METRIC_COLUMNS)]
    header += ["errors", "s/sample"]
    lines = ["| " + " | ".join(header) + " |", "|---|---|---|" + "---:|" * (len(header) - 3)]
    for row in rows:
        values = [row.group["task"], row.group["length_label"], row.group["method"], str(row.n)]
        values += [f"{row.means[metric]:.2f}" for metric, _ in METRIC_COLUMNS]
        values += [str(row.errors), f"{row.mean_seconds:.1f}"]
        lines.append("| " + " | ".join(values) + " |")
    return lines


def _cost_table(runs: Sequence[ConfigurationRun], predictions: Sequence[Prediction]) -> list[str]:
    """Wall time of each configuration against the work it did. A configuration's samples run
    at once, so a sample's own seconds overlap; the wall time over the model calls made is
    what one more segment costs on this machine."""
    lines = [
        "Samples of a configuration run at once: s per model call is its wall time over its "
        "calls (one call a segment, plus the answer). A configuration stopped and resumed "
        "counts the calls of its last sitting only, which its wall time covers.",
        "",
        "| task | length | method | samples | wall s | model calls | s per model call | tokens/s "
        "| machine |",
        "|---|---|---|---:|---:|---:|---:|---:|---|",
    ]
    for run in runs:
        members = predictions_of(run, predictions)
        calls, in_sitting = sum(p.n_calls for p in members), calls_in_sitting(members)
        tokens = sum(p.prompt_tokens + p.completion_tokens for p in members)
        per_call = f"{run.seconds / in_sitting:.1f}" if in_sitting else "-"
        # tokens are counted over every sitting: a rate only where one sitting made them all
        rate = f"{tokens / run.seconds:.0f}" if run.seconds and in_sitting == calls else "-"
        shown_calls = (
            f"{calls}" if in_sitting == calls else f"{calls} ({calls - in_sitting} earlier)"
        )
        config = run.configuration
        lines.append(
            f"| {config.task} | {config.length_label} | {config.method} | {run.n_samples} "
            f"| {run.seconds:,.0f} | {shown_calls} | {per_call} | {rate} | {run.machine or '-'} |"
        )
    return lines


def _breakdown_table(
    predictions: Sequence[Prediction], methods: Sequence[str], *, with_depth: bool
) -> list[str]:
    keys = ("length_label", "variant", "depth", "method") if with_depth else ("variant", "method")
    rows = summarize(predictions, by=keys)
    cells = {tuple(row.group[key] for key in keys): row for row in rows}
    groups = list(dict.fromkeys(tuple(row.group[key] for key in keys[:-1]) for row in rows))
    first = ["length", "variant", "depth"] if with_depth else ["category"]
    lines = [
        "| " + " | ".join(first + list(methods)) + " |",
        "|" + "---|" * len(first) + "---:|" * len(methods),
    ]
    for group in groups:
        values = [_cell(cells.get((*group, method))) for method in methods]
        lines.append("| " + " | ".join([*map(_text, group), *values]) + " |")
    return lines


def _cell(row: SummaryRow | None) -> str:
    return "-" if row is None else f"{row.means['accuracy']:.2f} ({row.n})"


def _text(value: object) -> str:
    return "-" if value is None else str(value)


def _mean(values: Sequence[float]) -> float:
    return sum(values) / len(values) if values else 0.0


def write_accuracy_plot(predictions: Sequence[Prediction], path: Path) -> None:
    """Accuracy against document length, one panel per task and one line per method. Lengths
    are the targets (the mean measured length for native-length tasks), on a log scale."""
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib import pyplot

    tasks = list(dict.fromkeys(p.task for p in predictions))
    colors = {
        method: f"C{i}" for i, method in enumerate(dict.fromkeys(p.method for p in predictions))
    }
    figure, axes = pyplot.subplots(
        1, max(len(tasks), 1), figsize=(5 * max(len(tasks), 1), 4), squeeze=False
    )
    for axis, task in zip(axes[0], tasks, strict=False):
        rows = summarize([p for p in predictions if p.task == task])
        for method in dict.fromkeys(row.group["method"] for row in rows):
            points = sorted(
                (_x_position(row, predictions), row.means["accuracy"], row.group["length_label"])
                for row in rows
                if row.group["method"] == method
            )
            axis.plot(
                [x for x, _, _ in points],
                [y for _, y, _ in points],
                marker="o",
                label=method,
                color=colors[method],
            )
        axis.set_xscale("log", base=2)
        ticks = {_x_position(row, predictions): row.group["length_label"] for row in rows}
        axis.set_xticks(list(ticks), labels=list(ticks.values()))
        axis.minorticks_off()
        axis.set_ylim(-0.05, 1.05)
        axis.set_title(f"{task} ({HEADLINE.get(task, 'accuracy')})")
        axis.set_xlabel("document tokens")
        axis.set_ylabel("accuracy")
        axis.grid(True, alpha=0.3)
        axis.legend(fontsize="small")
    if not tasks:
        axes[0][0].set_title("no predictions")
    figure.tight_layout()
    figure.savefig(path, format="png", dpi=120)
    pyplot.close(figure)


def _x_position(row: SummaryRow, predictions: Sequence[Prediction]) -> float:
    targets = [
        p.target_tokens
        for p in predictions
        if p.task == row.group["task"] and p.length_label == row.group["length_label"]
    ]
    if targets and targets[0] is not None:
        return float(targets[0])
    return max(row.mean_document_tokens, 1.0)


def write_outputs(
    output: Path, metadata: dict[str, Any], outcome: SuiteOutcome, *, plot: bool = True
) -> list[Path]:
    """Writes the JSON and Markdown, and the plot when asked; returns the files written."""
    output.mkdir(parents=True, exist_ok=True)
    written = [output / RESULTS_JSON, output / RESULTS_MARKDOWN]
    written[0].write_text(
        json.dumps(results_document(metadata, outcome), indent=2, ensure_ascii=False) + "\n"
    )
    written[1].write_text(render_markdown(metadata, outcome))
    if plot:
        write_accuracy_plot(outcome.predictions, output / ACCURACY_PLOT)
        written.append(output / ACCURACY_PLOT)
    return written
