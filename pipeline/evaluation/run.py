"""One `memstream eval` run: each task's samples, built once per run (`SampleBuilders`), every
configuration run on an open engine (`evaluate`), and a finished run's answers scored again
(`regrade_results`, from the run rebuilt by `saved_run`).

The command line (`pipeline.cli.evaluate`) opens the engine, shows the progress and prints the
report; the listener it gives `evaluate` rewrites results.json and results.md after each
configuration.
"""

from __future__ import annotations

import datetime
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from connectors.engines.factory import EngineSpec, load_tokenizer
from operators.engine import Engine
from pipeline.corpora.cuad import load_cuad
from pipeline.evaluation import corpora
from pipeline.evaluation.checkpoints import EvalCheckpoints
from pipeline.evaluation.cuad import build_cuad_samples
from pipeline.evaluation.execution import EvalSettings
from pipeline.evaluation.haystack import HaystackCorpus, split_passages
from pipeline.evaluation.hotpotqa import HotpotQABuilder
from pipeline.evaluation.niah import DEFAULT_DEPTHS, NiahBuilder
from pipeline.evaluation.regrade import Regraded, regrade
from pipeline.evaluation.report import RESULTS_JSON, read_results
from pipeline.evaluation.request import EvalRequest
from pipeline.evaluation.samples import EvalSample, LengthSpec
from pipeline.evaluation.sec10q import build_sec10q_samples
from pipeline.evaluation.sec10q_across import build_sec10q_across_samples
from pipeline.evaluation.suite import SuiteListener, SuiteOutcome, plan_groups, run_suite


class SampleBuilders:
    """Builds each task's samples on first use; the texts are tokenized once per run."""

    def __init__(self, request: EvalRequest, tokenizer: Any) -> None:
        self.request = request
        self.tokenizer = tokenizer
        self._texts: dict[str, str] | None = None
        self._hotpotqa: HotpotQABuilder | None = None
        self._niah: NiahBuilder | None = None

    def by_task(self) -> dict[str, Callable[[LengthSpec | None], list[EvalSample]]]:
        return {
            "hotpotqa": self.hotpotqa,
            "niah": self.niah,
            "cuad": self.cuad,
            "sec10q": self.sec10q,
            "sec10q-tune": self.sec10q_tune,
            "sec10q-across": self.sec10q_across,
        }

    def texts(self) -> dict[str, str]:
        if self._texts is None:
            self._texts = corpora.load_texts(self.request.corpora)
        return self._texts

    def hotpotqa(self, length: LengthSpec | None) -> list[EvalSample]:
        assert length is not None
        if self._hotpotqa is None:
            filler = [
                passage
                for name, text in self.texts().items()
                for passage in split_passages(name, text, self.tokenizer)
            ]
            examples = corpora.load_hotpotqa(self.request.corpora)
            self._hotpotqa = HotpotQABuilder(examples, filler, self.tokenizer)
        return self._hotpotqa.build(
            length.tokens, self.request.samples, self.request.settings.seed, length.label
        )

    def niah(self, length: LengthSpec | None) -> list[EvalSample]:
        assert length is not None
        if self._niah is None:
            self._niah = NiahBuilder(HaystackCorpus(self.texts(), self.tokenizer), self.tokenizer)
        return self._niah.build(
            length.tokens,
            self.request.samples,
            self.request.settings.seed,
            length.label,
            self.request.depths,
        )

    def cuad(self, _: LengthSpec | None) -> list[EvalSample]:
        contracts = load_cuad(self.request.corpora)
        return build_cuad_samples(contracts, self.tokenizer)  # every label, never cut

    def sec10q(self, _: LengthSpec | None) -> list[EvalSample]:
        return build_sec10q_samples(
            "sec10q", self.request.corpora, self.tokenizer, self.request.samples
        )

    def sec10q_tune(self, _: LengthSpec | None) -> list[EvalSample]:
        return build_sec10q_samples(
            "sec10q-tune", self.request.corpora, self.tokenizer, self.request.samples
        )

    def sec10q_across(self, _: LengthSpec | None) -> list[EvalSample]:
        return build_sec10q_across_samples(
            self.request.corpora, self.tokenizer, self.request.samples
        )


async def evaluate(
    request: EvalRequest,
    engine: Engine,
    tokenizer: Any,
    metadata: dict[str, Any],
    listener: SuiteListener,
    previous: SuiteOutcome | None = None,
    checkpoints: EvalCheckpoints | None = None,
) -> SuiteOutcome:
    """Runs every configuration of `request` not in `previous` on an open engine, telling
    `listener` as each one starts and finishes; every chain's steps are checkpointed in
    `checkpoints`, and the time it took is recorded in `metadata` (elapsed_s)."""
    builders = SampleBuilders(request, tokenizer)
    groups = plan_groups(request.tasks, request.lengths, builders.by_task())
    budget_s = None if request.time_budget_min is None else request.time_budget_min * 60
    started = time.perf_counter()
    try:
        return await run_suite(
            engine,
            tokenizer,
            groups,
            request.methods,
            request.settings,
            time_budget_s=budget_s,
            listener=listener,
            previous=previous,
            checkpoints=checkpoints,
        )
    finally:
        metadata["elapsed_s"] = round(time.perf_counter() - started, 1)


def saved_run(
    output: Path, corpora_root: Path
) -> tuple[EvalRequest, dict[str, Any], SuiteOutcome, Callable[[str, str], list[EvalSample]]]:
    """The finished run in `output`: its request, rebuilt from its metadata; the metadata; its
    outcome as saved; and `build(task, length_label)`, which rebuilds that cell's samples exactly
    (same corpora, tokenizer, seed and sizes)."""
    metadata, outcome = read_results(output / RESULTS_JSON)
    lengths = {length["label"]: LengthSpec(**length) for length in metadata["lengths"]}
    request = EvalRequest(
        tasks=metadata["tasks"],
        lengths=list(lengths.values()),
        methods=[],
        samples=metadata["samples_per_task_and_length"],
        depths=tuple(metadata.get("niah_depths", DEFAULT_DEPTHS)),
        settings=EvalSettings(**metadata["settings"]),
        time_budget_min=None,
        output=output,
        corpora=corpora_root,
        quick=metadata.get("quick", False),
    )
    tokenizer = load_tokenizer(EngineSpec(model=metadata["model"]))
    builders = SampleBuilders(request, tokenizer).by_task()
    return request, metadata, outcome, lambda task, label: builders[task](lengths.get(label))


def regrade_results(
    output: Path, corpora_root: Path
) -> tuple[EvalRequest, dict[str, Any], SuiteOutcome, Regraded]:
    """The run in `output` scored again (see pipeline.evaluation.regrade): its request, rebuilt
    from its metadata; the metadata, stamped regraded_at; the re-graded outcome; and what
    changed. Writes nothing."""
    request, metadata, outcome, build = saved_run(output, corpora_root)
    regraded = regrade(outcome.predictions, build)
    outcome = SuiteOutcome(predictions=regraded.predictions, runs=outcome.runs)
    metadata["regraded_at"] = datetime.datetime.now(datetime.timezone.utc).isoformat(
        timespec="seconds"
    )
    return request, metadata, outcome, regraded
