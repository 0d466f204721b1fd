"""Schedules configurations: shortest lengths first, every method on a group's samples before
the next group, so a time budget cuts the longest (most expensive) runs first.

Samples of a (task, length) group are built when the group starts and shared by its methods.
Once the budget is used up no new configuration starts; a running one finishes. Given the
outcome of an earlier run, the configurations it ran are kept and not run again.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from connectors.engines.hardware import detect
from operators.config import ConfigError
from operators.engine import Engine
from pipeline.evaluation.checkpoints import EvalCheckpoints
from pipeline.evaluation.execution import EvalMethod, EvalSettings, ProgressHook, run_configuration
from pipeline.evaluation.results import (
    Configuration,
    ConfigurationRun,
    Prediction,
    SkippedConfiguration,
)
from pipeline.evaluation.samples import EvalSample, LengthSpec

TASKS = ("hotpotqa", "niah", "cuad", "sec10q", "sec10q-tune", "sec10q-across")
# What `memstream eval` runs when no task is named: the real-document tasks take an hour or more.
DEFAULT_TASKS = ("hotpotqa", "niah", "cuad")
# Tasks whose documents keep their own length: run once, with the first length's group.
NATIVE_LENGTH_TASKS = frozenset({"cuad", "sec10q", "sec10q-tune", "sec10q-across"})
NATIVE_LENGTH_LABEL = "native"


def parse_tasks(text: str) -> list[str]:
    tasks = [part.strip().lower() for part in text.split(",") if part.strip()]
    unknown = [task for task in tasks if task not in TASKS]
    if unknown or not tasks:
        raise ConfigError(
            f"unknown task(s) {', '.join(unknown) or '(none)'}; known: {', '.join(TASKS)}"
        )
    return list(dict.fromkeys(tasks))


@dataclass(frozen=True)
class SampleGroup:
    task: str
    length_label: str
    build: Callable[[], list[EvalSample]] = field(compare=False)


def plan_groups(
    tasks: Sequence[str],
    lengths: Sequence[LengthSpec],
    builders: Mapping[str, Callable[[LengthSpec | None], list[EvalSample]]],
) -> list[SampleGroup]:
    """One group per (length, task), lengths ascending; native-length tasks once, first."""
    groups = [
        SampleGroup(task, NATIVE_LENGTH_LABEL, _bind(builders[task], None))
        for task in tasks
        if task in NATIVE_LENGTH_TASKS
    ]
    for length in sorted(lengths, key=lambda length: length.tokens):
        groups += [
            SampleGroup(task, length.label, _bind(builders[task], length))
            for task in tasks
            if task not in NATIVE_LENGTH_TASKS
        ]
    return groups


def _bind(
    builder: Callable[[LengthSpec | None], list[EvalSample]], length: LengthSpec | None
) -> Callable[[], list[EvalSample]]:
    return lambda: builder(length)


class SuiteListener(Protocol):
    def started(self, configuration: Configuration, n_samples: int) -> ProgressHook | None: ...

    def finished(self, run: ConfigurationRun, predictions: Sequence[Prediction]) -> None: ...

    def skipped(self, skipped: SkippedConfiguration) -> None: ...


@dataclass
class SuiteOutcome:
    predictions: list[Prediction] = field(default_factory=list)
    runs: list[ConfigurationRun] = field(default_factory=list)
    skipped: list[SkippedConfiguration] = field(default_factory=list)

    @classmethod
    def continuing(cls, previous: SuiteOutcome | None) -> SuiteOutcome:
        """A new outcome that starts with the runs and predictions of `previous`."""
        if previous is None:
            return cls()
        return cls(predictions=list(previous.predictions), runs=list(previous.runs))


async def run_suite(
    engine: Engine,
    tokenizer: Any,
    groups: Sequence[SampleGroup],
    methods: Sequence[EvalMethod],
    settings: EvalSettings,
    *,
    time_budget_s: float | None = None,
    listener: SuiteListener | None = None,
    clock: Callable[[], float] = time.monotonic,
    previous: SuiteOutcome | None = None,
    checkpoints: EvalCheckpoints | None = None,
) -> SuiteOutcome:
    """Runs each configuration not finished in `previous`; memory chains checkpoint their
    steps in `checkpoints` and continue from what it holds."""
    outcome = SuiteOutcome.continuing(previous)
    finished = {run.configuration for run in outcome.runs}
    started = clock()
    for group in groups:
        samples: list[EvalSample] | None = None
        for method in methods:
            configuration = Configuration(group.task, group.length_label, method.name)
            if configuration in finished:
                continue
            if time_budget_s is not None and clock() - started >= time_budget_s:
                skipped = SkippedConfiguration(
                    configuration, f"time budget of {time_budget_s / 60:g} min used up"
                )
                outcome.skipped.append(skipped)
                if listener:
                    listener.skipped(skipped)
                continue
            if samples is None:
                samples = group.build()
            progress = listener.started(configuration, len(samples)) if listener else None
            configuration_started = clock()
            predictions = await run_configuration(
                engine, tokenizer, samples, method, settings, progress, checkpoints
            )
            run = ConfigurationRun(
                configuration, len(samples), clock() - configuration_started, detect().describe()
            )
            outcome.predictions += predictions
            outcome.runs.append(run)
            if listener:
                listener.finished(run, predictions)
    return outcome
