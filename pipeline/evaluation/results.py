"""Records of an evaluation run and their aggregation; plain data, ready for JSON."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from operators.core.scoring import METRICS


@dataclass
class Prediction:
    task: str
    length_label: str
    target_tokens: int | None
    document_tokens: int
    depth: float | None
    variant: str | None
    method: str
    sample_id: str
    question: str
    gold: list[str]
    answer_mode: str
    prediction: str | None
    raw_response: str | None
    final_memory: str | None  # None for `direct`, which keeps no memory
    scores: dict[str, float]
    prompt_tokens: int
    completion_tokens: int
    n_calls: int
    seconds: float
    status: str  # "ok" or "error"
    error: str | None = None
    details: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class Configuration:
    """The unit of scheduling: all samples of one task at one length, read by one method."""

    task: str
    length_label: str
    method: str

    def describe(self) -> str:
        return f"{self.task} {self.length_label} {self.method}"


@dataclass
class ConfigurationRun:
    configuration: Configuration
    n_samples: int
    seconds: float
    machine: str = ""  # Hardware.describe() of where it ran; "" in runs before it was kept


# In a prediction's details: the model calls of its chain made in earlier sittings of the
# configuration (a run stopped and resumed), which its configuration's seconds do not cover.
EARLIER_SITTINGS_CALLS = "steps_from_earlier_sittings"


def predictions_of(run: ConfigurationRun, predictions: Iterable[Prediction]) -> list[Prediction]:
    """The predictions `run` made."""
    return [
        p
        for p in predictions
        if Configuration(p.task, p.length_label, p.method) == run.configuration
    ]


def calls_in_sitting(predictions: Iterable[Prediction]) -> int:
    """The model calls made in the sitting that finished the configuration: those its
    seconds cover."""
    return sum(p.n_calls - p.details.get(EARLIER_SITTINGS_CALLS, 0) for p in predictions)


@dataclass
class SkippedConfiguration:
    configuration: Configuration
    reason: str


@dataclass
class SummaryRow:
    group: dict[str, Any]
    n: int
    means: dict[str, float]
    mean_document_tokens: float
    mean_seconds: float
    errors: int


def summarize(
    predictions: Iterable[Prediction], by: Sequence[str] = ("task", "length_label", "method")
) -> list[SummaryRow]:
    """Mean of every metric per group, groups in order of first appearance."""
    groups: dict[tuple[Any, ...], list[Prediction]] = {}
    for prediction in predictions:
        groups.setdefault(tuple(getattr(prediction, key) for key in by), []).append(prediction)
    rows = []
    for key, members in groups.items():
        n = len(members)
        rows.append(
            SummaryRow(
                group=dict(zip(by, key, strict=True)),
                n=n,
                means={m: sum(p.scores.get(m, 0.0) for p in members) / n for m in METRICS},
                mean_document_tokens=sum(p.document_tokens for p in members) / n,
                mean_seconds=sum(p.seconds for p in members) / n,
                errors=sum(p.status != "ok" for p in members),
            )
        )
    return rows
