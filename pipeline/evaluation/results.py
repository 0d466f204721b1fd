"""Records of an evaluation run and their aggregation; plain data, ready for JSON."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from pipeline.core.scoring import METRICS


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
