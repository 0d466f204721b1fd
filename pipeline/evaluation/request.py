"""What `memstream eval` is asked, and the metadata a run records of it.

`EvalRequest` is the command's options with their defaults resolved (`pipeline.cli.evaluate`
turns a command line into one). `run_metadata` is what results.json records of a request and
its engine: `--resume` compares it (`pipeline.evaluation.resuming`), `--regrade` rebuilds the
request from it (`pipeline.evaluation.run`).
"""

from __future__ import annotations

import datetime
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from connectors.engines.factory import EngineSpec
from operators.config import MethodConfig, check_context_fit
from operators.core.templates import get_template_set
from pipeline.evaluation.execution import EvalMethod, EvalSettings
from pipeline.evaluation.samples import LengthSpec


@dataclass(frozen=True)
class EvalRequest:
    """Everything `memstream eval` was asked, with the defaults resolved."""

    tasks: list[str]
    lengths: list[LengthSpec]
    methods: list[EvalMethod]
    samples: int
    depths: tuple[float, ...]
    settings: EvalSettings
    time_budget_min: float | None
    output: Path
    corpora: Path
    quick: bool
    resume: bool = False


def check_chunks_fit(request: EvalRequest, tokenizer: Any) -> None:
    """Each memory method's update prompt and reply fit the engine's context (the samples'
    questions are short; the check allows for the chat template, not for them)."""
    settings = request.settings
    for method in request.methods:
        if method.template is not None:
            config = MethodConfig(
                chunk_size=settings.chunk_size,
                max_memory_tokens=settings.max_memory_tokens,
                max_answer_tokens=settings.max_answer_tokens,
                template=method.template,
                reread_tokens=method.reread_tokens,
            )
            check_context_fit(config, (), tokenizer, settings.context_window)


def run_metadata(request: EvalRequest, spec: EngineSpec) -> dict[str, Any]:
    return {
        "model": spec.model,
        "engine": spec.kind,
        "dtype": spec.dtype,
        "prompt_lookup_tokens": spec.prompt_lookup_tokens,
        "started_at": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "quick": request.quick,
        "tasks": request.tasks,
        "lengths": [asdict(length) for length in request.lengths],
        "methods": [method.name for method in request.methods],
        "template_digests": {
            method.name: get_template_set(method.template).digest
            for method in request.methods
            if method.template is not None
        },
        "samples_per_task_and_length": request.samples,
        "niah_depths": list(request.depths),
        "time_budget_min": request.time_budget_min,
        "settings": asdict(request.settings),
        "corpora": str(request.corpora),
    }
