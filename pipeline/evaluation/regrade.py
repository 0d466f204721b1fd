"""Re-grading: a finished run's answers scored again by today's scoring and grounding rules.

A run keeps each answer, raw reply and final memory, and its samples are rebuilt exactly from its
metadata (same corpora, tokenizer, seed and sizes), so a change of the grounding rule or of the
scorer can be measured on every run made so far without calling a model again. Only the scores
change; the answers, token counts and timings stay as the run recorded them.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, replace

from operators.config import ConfigError
from pipeline.evaluation.execution import grade
from pipeline.evaluation.results import Prediction
from pipeline.evaluation.samples import EvalSample

SampleKey = tuple[str, str, str]  # task, length label, sample id


@dataclass(frozen=True)
class Regraded:
    predictions: list[Prediction]
    grounded_changed: int  # answers whose grounded flag differs from the run's (or was missing)
    accuracy_changed: int


def sample_key(item: Prediction | EvalSample) -> SampleKey:
    return item.task, item.length_label, item.sample_id


def asked(prediction: Prediction) -> tuple[str, list[str]]:
    return prediction.question, prediction.gold


def regrade(
    predictions: Sequence[Prediction], build: Callable[[str, str], Iterable[EvalSample]]
) -> Regraded:
    """Scores each answered prediction again against its sample, which `build(task,
    length_label)` rebuilds; failed predictions are kept as they are. Raises ValueError when a
    rebuilt sample is missing or asks another question than the run's."""
    samples: dict[SampleKey, EvalSample] = {}
    for task, length_label in dict.fromkeys((p.task, p.length_label) for p in predictions):
        samples.update((sample_key(sample), sample) for sample in build(task, length_label))
    regraded, grounded_changed, accuracy_changed = [], 0, 0
    for prediction in predictions:
        if prediction.status != "ok":
            regraded.append(prediction)
            continue
        sample = samples.get(sample_key(prediction))
        if sample is None or (sample.question, list(sample.answers)) != asked(prediction):
            raise ConfigError(
                f"sample {prediction.sample_id} ({prediction.task}, {prediction.length_label}) "
                "does not rebuild as the run had it: other corpora or another tokenizer?"
            )
        scores = grade(sample, prediction.prediction, prediction.raw_response,
                       prediction.final_memory)  # fmt: skip
        grounded_changed += scores["grounded"] != prediction.scores.get("grounded")
        accuracy_changed += scores["accuracy"] != prediction.scores.get("accuracy")
        regraded.append(replace(prediction, scores=scores))
    return Regraded(regraded, grounded_changed, accuracy_changed)
