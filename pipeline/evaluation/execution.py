"""Runs one configuration: every sample at once against one engine, so the engine batches them.

`memstream:<template>` runs memory chains through ChainRunner; `direct` sends one prompt per
sample with the document middle-truncated to the window. Both return the same records.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from pipeline.ask import DocumentInput, prepare
from pipeline.config import MethodConfig
from pipeline.core.chain import REFERENCE_MAX_ANSWER_TOKENS, REFERENCE_MAX_MEMORY_TOKENS
from pipeline.core.evidence import find_evidence, text_segments
from pipeline.core.extraction import extract_answer, strip_thinking
from pipeline.core.scoring import score
from pipeline.core.segmentation import REFERENCE_CHUNK_SIZE
from pipeline.core.templates import get_template_set
from pipeline.engines.base import Engine, GenerationRequest, SamplingConfig
from pipeline.evaluation.direct import build_direct_prompt, chat_overhead_tokens
from pipeline.evaluation.results import Prediction
from pipeline.evaluation.samples import EvalSample
from pipeline.runner import ChainResult, ChainRunner

DIRECT = "direct"
MEMSTREAM_PREFIX = "memstream:"


@dataclass(frozen=True)
class EvalMethod:
    name: str  # "direct" or "memstream:<template set>"
    template: str | None  # None for direct

    @classmethod
    def parse(cls, text: str) -> EvalMethod:
        name = text.strip()
        if name == DIRECT:
            return cls(DIRECT, None)
        if name.startswith(MEMSTREAM_PREFIX):
            template = name.removeprefix(MEMSTREAM_PREFIX)
            get_template_set(template)  # an unknown template set fails here, naming the known
            return cls(name, template)
        raise ValueError(f"unknown method {text!r}: use direct or memstream:<template set>")

    @property
    def is_direct(self) -> bool:
        return self.template is None


def parse_methods(text: str) -> list[EvalMethod]:
    methods = [EvalMethod.parse(part) for part in text.split(",") if part.strip()]
    if not methods:
        raise ValueError("no method given; use e.g. --methods memstream:memagent-reference,direct")
    return list(dict.fromkeys(methods))


@dataclass(frozen=True)
class EvalSettings:
    """What every method of a run shares; `context_window` is the engine's max_model_len."""

    context_window: int
    chunk_size: int = REFERENCE_CHUNK_SIZE
    max_memory_tokens: int = REFERENCE_MAX_MEMORY_TOKENS
    max_answer_tokens: int = REFERENCE_MAX_ANSWER_TOKENS
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int = 0

    def method_config(self, template: str) -> MethodConfig:
        return MethodConfig(
            chunk_size=self.chunk_size,
            max_memory_tokens=self.max_memory_tokens,
            max_answer_tokens=self.max_answer_tokens,
            template=template,
            temperature=self.temperature,
            top_p=self.top_p,
            seed=self.seed,
        )

    def sampling(self) -> SamplingConfig:
        return SamplingConfig(temperature=self.temperature, top_p=self.top_p, seed=self.seed)


class ProgressHook(Protocol):
    def planned(self, calls: int) -> None: ...

    def called(self) -> None: ...


class _NoProgress:
    def planned(self, calls: int) -> None:
        pass

    def called(self) -> None:
        pass


async def run_configuration(
    engine: Engine,
    tokenizer: Any,
    samples: Sequence[EvalSample],
    method: EvalMethod,
    settings: EvalSettings,
    progress: ProgressHook | None = None,
) -> list[Prediction]:
    hook = progress or _NoProgress()
    if method.template is None:
        return await _run_direct(engine, tokenizer, samples, settings, hook)
    return await _run_memstream(engine, tokenizer, samples, method, method.template, settings, hook)


async def _run_memstream(
    engine: Engine,
    tokenizer: Any,
    samples: Sequence[EvalSample],
    method: EvalMethod,
    template: str,
    settings: EvalSettings,
    progress: ProgressHook,
) -> list[Prediction]:
    config = settings.method_config(template)
    prepared = [
        prepare(
            DocumentInput(sample.sample_id, sample.document), [sample.question], tokenizer, config
        )
        for sample in samples
    ]
    chains = [document.chains[0] for document in prepared]
    progress.planned(sum(chain.n_steps for chain in chains))
    runner = ChainRunner(engine, config.sampling())
    results = await runner.run(chains, lambda *_: progress.called())
    return [
        _chain_prediction(sample, method, result, document.n_tokens)
        for sample, result, document in zip(samples, results, prepared, strict=True)
    ]


def _chain_prediction(
    sample: EvalSample, method: EvalMethod, result: ChainResult, document_tokens: int
) -> Prediction:
    return _prediction(
        sample,
        method,
        answer=result.answer,
        raw_response=result.raw_response,
        final_memory=result.final_memory,
        document_tokens=document_tokens,
        prompt_tokens=result.prompt_tokens,
        completion_tokens=result.completion_tokens,
        n_calls=len(result.trajectory),
        seconds=result.elapsed_s,
        status=result.status,
        error=result.error,
        details={"n_segments": result.n_segments},
    )


async def _run_direct(
    engine: Engine,
    tokenizer: Any,
    samples: Sequence[EvalSample],
    settings: EvalSettings,
    progress: ProgressHook,
) -> list[Prediction]:
    method = EvalMethod(DIRECT, None)
    overhead = chat_overhead_tokens(tokenizer)
    sampling = settings.sampling()
    progress.planned(len(samples))

    async def answer(sample: EvalSample) -> Prediction:
        started = time.perf_counter()
        document_tokens = sample.n_tokens
        try:
            prompt = build_direct_prompt(
                sample.document,
                sample.question,
                tokenizer,
                settings.context_window,
                settings.max_answer_tokens,
                overhead,
            )
            document_tokens = prompt.document_tokens
            completion = await engine.generate(
                GenerationRequest(
                    f"{sample.sample_id}:direct",
                    prompt.prompt,
                    settings.max_answer_tokens,
                    sampling,
                )
            )
        except Exception as error:  # one failing sample must not stop the others
            progress.called()
            return _prediction(
                sample,
                method,
                document_tokens=document_tokens,
                seconds=time.perf_counter() - started,
                status="error",
                error=f"{type(error).__name__}: {error}",
            )
        progress.called()
        return _prediction(
            sample,
            method,
            answer=extract_answer(strip_thinking(completion.text)),
            raw_response=completion.text,
            document_tokens=document_tokens,
            prompt_tokens=completion.prompt_tokens,
            completion_tokens=completion.completion_tokens,
            n_calls=1,
            seconds=time.perf_counter() - started,
            details={"shown_tokens": prompt.shown_tokens, "truncated": prompt.truncated},
        )

    return list(await asyncio.gather(*(answer(sample) for sample in samples)))


def grade(
    sample: EvalSample, answer: str | None, raw_response: str | None, final_memory: str | None
) -> dict[str, float]:
    """An answer's scores against the sample's gold answers, and whether it is grounded in the
    sample's document."""
    scores = score(sample.answers, sample.answer_mode, answer, raw_response)
    segments = text_segments(sample.sample_id, sample.document)
    grounding = find_evidence(sample.question, answer, final_memory or "", segments)
    scores["grounded"] = float(grounding.grounded)
    return scores


def _prediction(
    sample: EvalSample,
    method: EvalMethod,
    *,
    document_tokens: int,
    seconds: float,
    answer: str | None = None,
    raw_response: str | None = None,
    final_memory: str | None = None,
    prompt_tokens: int = 0,
    completion_tokens: int = 0,
    n_calls: int = 0,
    status: str = "ok",
    error: str | None = None,
    details: dict[str, Any] | None = None,
) -> Prediction:
    if status == "ok":
        scores = grade(sample, answer, raw_response, final_memory)
    else:
        scores = score(sample.answers, sample.answer_mode, answer, raw_response)
    return Prediction(
        task=sample.task,
        length_label=sample.length_label,
        target_tokens=sample.target_tokens,
        document_tokens=document_tokens,
        depth=sample.depth,
        variant=sample.variant,
        method=method.name,
        sample_id=sample.sample_id,
        question=sample.question,
        gold=list(sample.answers),
        answer_mode=sample.answer_mode,
        prediction=answer,
        raw_response=raw_response,
        final_memory=final_memory,
        scores=scores,
        prompt_tokens=prompt_tokens,
        completion_tokens=completion_tokens,
        n_calls=n_calls,
        seconds=round(seconds, 3),
        status=status,
        error=error,
        details={**sample.details, **(details or {})},
    )
