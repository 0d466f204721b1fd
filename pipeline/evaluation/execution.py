"""Runs one configuration: every sample at once against one engine, so the engine batches them.

`memstream:<template>` runs memory chains through `resume_chain`, each step checkpointed (see
`checkpoints`); `memstream:<template>+reread<N>` re-reads up to N tokens of passages at answer
time. `direct` sends one prompt per sample with the document middle-truncated to the window;
`rag-bm25` sends one prompt per sample with the passages BM25 ranks first for the question (the
peer a user would build instead). All return the same records.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import re
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from connectors.state.schema import DONE
from pipeline.ask import DocumentInput, PreparedDocument, prepare
from pipeline.config import MethodConfig
from pipeline.core.chain import REFERENCE_MAX_ANSWER_TOKENS, REFERENCE_MAX_MEMORY_TOKENS
from pipeline.core.evidence import find_evidence, text_segments
from pipeline.core.extraction import extract_answer, strip_thinking
from pipeline.core.retrieval import render_passages, select_passages, split_passages
from pipeline.core.scoring import score
from pipeline.core.segmentation import (
    REFERENCE_CHUNK_SIZE,
    SegmentationConfig,
    segment,
    tokenize,
)
from pipeline.core.templates import defang, get_template_set
from pipeline.engines.base import Engine, GenerationRequest, SamplingConfig
from pipeline.evaluation.checkpoints import EvalCheckpoints
from pipeline.evaluation.direct import DIRECT_TEMPLATE, build_direct_prompt, chat_overhead_tokens
from pipeline.evaluation.results import EARLIER_SITTINGS_CALLS, Prediction
from pipeline.evaluation.samples import EvalSample
from pipeline.resume import ChainWork, resume_chain
from pipeline.runner import ChainRunner

MEMORY_REUSED = "memory_reused"
DIRECT = "direct"
RAG_BM25 = "rag-bm25"
MEMSTREAM_PREFIX = "memstream:"
_REREAD_SUFFIX = re.compile(r"\+reread(\d+)$")


@dataclass(frozen=True)
class EvalMethod:
    name: str  # "direct", "rag-bm25" or "memstream:<template set>[+reread<N>]"
    template: str | None  # None for the one-call methods
    reread_tokens: int = 0

    @classmethod
    def parse(cls, text: str) -> EvalMethod:
        name = text.strip()
        if name in (DIRECT, RAG_BM25):
            return cls(name, None)
        if name.startswith(MEMSTREAM_PREFIX):
            template = name.removeprefix(MEMSTREAM_PREFIX)
            reread = _REREAD_SUFFIX.search(template)
            if reread:
                template = template[: reread.start()]
            get_template_set(template)  # an unknown template set fails here, naming the known
            return cls(name, template, int(reread[1]) if reread else 0)
        raise ValueError(
            f"unknown method {text!r}: use direct, rag-bm25 or memstream:<template set>[+reread<N>]"
        )

    @property
    def is_direct(self) -> bool:
        return self.name == DIRECT


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

    def method_config(self, template: str, reread_tokens: int = 0) -> MethodConfig:
        return MethodConfig(
            chunk_size=self.chunk_size,
            max_memory_tokens=self.max_memory_tokens,
            max_answer_tokens=self.max_answer_tokens,
            template=template,
            temperature=self.temperature,
            top_p=self.top_p,
            seed=self.seed,
            reread_tokens=reread_tokens,
        )

    def sampling(self) -> SamplingConfig:
        return SamplingConfig(temperature=self.temperature, top_p=self.top_p, seed=self.seed)


class ProgressHook(Protocol):
    def planned(self, calls: int, earlier: int = 0) -> None:
        """`calls` still to make; `earlier`: those an earlier sitting made (a resumed run)."""

    def called(self) -> None: ...


class _NoProgress:
    def planned(self, calls: int, earlier: int = 0) -> None:
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
    checkpoints: EvalCheckpoints | None = None,
) -> list[Prediction]:
    """Every sample's prediction. Memory chains checkpoint each step in `checkpoints` and
    continue from what it holds (a temporary store when none is given)."""
    hook = progress or _NoProgress()
    if method.template is None:
        return await _run_one_call(engine, tokenizer, samples, method, settings, hook)
    if checkpoints is None:
        with contextlib.closing(EvalCheckpoints.temporary()) as temporary:
            return await _run_memstream(
                engine, tokenizer, samples, method, method.template, settings, hook, temporary
            )
    return await _run_memstream(
        engine, tokenizer, samples, method, method.template, settings, hook, checkpoints
    )


async def _run_memstream(
    engine: Engine,
    tokenizer: Any,
    samples: Sequence[EvalSample],
    method: EvalMethod,
    template: str,
    settings: EvalSettings,
    progress: ProgressHook,
    checkpoints: EvalCheckpoints,
) -> list[Prediction]:
    config = settings.method_config(template, method.reread_tokens)
    prepared = [
        prepare(
            DocumentInput(sample.sample_id, sample.document), [sample.question], tokenizer, config
        )
        for sample in samples
    ]
    keys = await checkpoints.call(
        checkpoints.plan,
        [
            (sample, len(document.segments))
            for sample, document in zip(samples, prepared, strict=True)
        ],
        config,
    )
    to_run = dict(zip(keys, prepared, strict=True))  # a sample given twice runs once
    # A re-reading method starts from the final memory of the same method without re-read,
    # where an earlier configuration of this run (or a resumed one) left it.
    memory_from = {
        key: checkpoints.key(sample, dataclasses.replace(config, reread_tokens=0))
        for key, sample in zip(keys, samples, strict=True)
        if config.reread_tokens
    }
    before = await checkpoints.call(checkpoints.chains, to_run)
    memories = await checkpoints.call(checkpoints.chains, set(memory_from.values()))
    reused = {
        key
        for key, source in memory_from.items()
        if before[key]["steps_done"] == 0
        and source in memories
        and memories[source]["steps_done"] >= len(to_run[key].segments)
    }
    earlier = sum(chain["steps_done"] for chain in before.values())
    progress.planned(
        sum(
            0
            if before[key]["status"] == DONE
            else 1
            if key in reused
            else document.chains[0].n_steps - before[key]["steps_done"]
            for key, document in to_run.items()
        ),
        earlier,
    )
    runner = ChainRunner(engine, config.sampling())

    async def started_runner() -> ChainRunner:
        return runner

    chain_config = config.chain()
    await asyncio.gather(
        *(
            resume_chain(
                ChainWork(
                    key,
                    document.chains[0].question,
                    document.segments,
                    memory_from=memory_from.get(key),
                ),
                started_runner,
                chain_config,
                checkpoints.store,
                checkpoints.call,
                on_step=lambda _: progress.called(),
            )
            for key, document in to_run.items()
        )
    )
    stored = await checkpoints.call(checkpoints.chains, to_run)
    return [
        _stored_prediction(
            sample, method, stored[key], before[key]["steps_done"], document, key in reused
        )
        for sample, key, document in zip(samples, keys, prepared, strict=True)
    ]


def _stored_prediction(
    sample: EvalSample,
    method: EvalMethod,
    chain: dict[str, Any],
    steps_before: int,
    document: PreparedDocument,
    memory_reused: bool = False,
) -> Prediction:
    """A chain's prediction from its row in the store: its counts cover every sitting, and its
    seconds are the sum of its model calls' latencies. A chain that started at its answer step
    from the final memory of the same chain without re-read (`memory_reused`) counts that step
    alone."""
    details: dict[str, Any] = {"n_segments": len(document.segments)}
    if steps_before:
        details[EARLIER_SITTINGS_CALLS] = steps_before
    n_calls = chain["steps_done"]
    if memory_reused:
        details[MEMORY_REUSED] = True
        n_calls -= len(document.segments)
    done = chain["status"] == DONE
    return _prediction(
        sample,
        method,
        answer=chain["answer"],
        raw_response=chain["raw_response"],
        final_memory=chain["final_memory"] or "",
        document_tokens=document.n_tokens,
        prompt_tokens=chain["prompt_tokens"],
        completion_tokens=chain["completion_tokens"],
        n_calls=n_calls,
        seconds=chain["compute_s"],
        status="ok" if done else "error",
        error=None
        if done
        else chain["error"] or f"the chain stopped at step {chain['steps_done']}",
        details=details,
    )


def build_rag_prompt(
    sample: EvalSample, tokenizer: Any, settings: EvalSettings
) -> tuple[str, dict[str, Any]]:
    """The `rag-bm25` peer, fixed before it was first measured: the document's 300-word
    passages (never across a segment), ranked by BM25 for the question alone, the best ones up
    to `chunk_size + max_memory_tokens` tokens in document order, read in one call with direct
    reading's prompt."""
    tokenized = tokenize(sample.sample_id, sample.document, tokenizer)
    segments = segment(tokenized, tokenizer, SegmentationConfig(chunk_size=settings.chunk_size))
    budget = settings.chunk_size + settings.max_memory_tokens
    passages = select_passages(split_passages(segments), sample.question, budget)
    prompt = DIRECT_TEMPLATE.format(
        document=defang(render_passages(passages)), question=defang(sample.question)
    )
    details = {
        "shown_tokens": sum(p.n_tokens for p in passages),
        "passages": [[p.char_start, p.char_end] for p in passages],
    }
    return prompt, details


async def _run_one_call(
    engine: Engine,
    tokenizer: Any,
    samples: Sequence[EvalSample],
    method: EvalMethod,
    settings: EvalSettings,
    progress: ProgressHook,
) -> list[Prediction]:
    """`direct` or `rag-bm25`: one prompt and one model call per sample."""
    overhead = chat_overhead_tokens(tokenizer)
    sampling = settings.sampling()
    progress.planned(len(samples))

    async def answer(sample: EvalSample) -> Prediction:
        started = time.perf_counter()
        document_tokens = sample.n_tokens
        try:
            if method.name == RAG_BM25:
                prompt_text, details = await asyncio.to_thread(
                    build_rag_prompt, sample, tokenizer, settings
                )
            else:
                prompt = build_direct_prompt(
                    sample.document,
                    sample.question,
                    tokenizer,
                    settings.context_window,
                    settings.max_answer_tokens,
                    overhead,
                )
                document_tokens = prompt.document_tokens
                prompt_text = prompt.prompt
                details = {"shown_tokens": prompt.shown_tokens, "truncated": prompt.truncated}
            completion = await engine.generate(
                GenerationRequest(
                    f"{sample.sample_id}:{method.name}",
                    prompt_text,
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
            details=details,
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
