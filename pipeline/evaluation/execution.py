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
from operators.config import (
    ChunkSize,
    ConfigError,
    MaxAnswerTokens,
    MaxMemoryTokens,
    MethodConfig,
    Seed,
    Temperature,
    TopP,
)
from operators.core.collection import (
    Member,
    document_refs,
    in_collection,
    order_members,
    segment_collection,
)
from operators.core.document import Document
from operators.core.evidence import find_evidence, text_segments
from operators.core.extraction import extract_answer, strip_thinking
from operators.core.retrieval import as_printed, render_passages, select_passages, split_passages
from operators.core.scoring import score
from operators.core.segmentation import (
    Segment,
    SegmentationConfig,
    segment,
    tokenize,
)
from operators.core.templates import defang, get_template_set
from operators.engine import Engine, GenerationRequest, SamplingConfig
from operators.runner import ChainRunner
from pipeline.ask import PreparedDocument, prepare, prepare_collection
from pipeline.evaluation.checkpoints import EvalCheckpoints
from pipeline.evaluation.combined import build_combine_prompt, render_answers
from pipeline.evaluation.direct import DIRECT_TEMPLATE, build_direct_prompt, chat_overhead_tokens
from pipeline.evaluation.results import EARLIER_SITTINGS_CALLS, Prediction
from pipeline.evaluation.samples import EvalSample, count_tokens
from pipeline.resume import ChainWork, resume_chain

MEMORY_REUSED = "memory_reused"
DIRECT = "direct"
RAG_BM25 = "rag-bm25"
MEMSTREAM_PREFIX = "memstream:"
_REREAD_SUFFIX = re.compile(r"\+reread(\d+)$")
COMBINED_SUFFIX = "+combined"


@dataclass(frozen=True)
class EvalMethod:
    name: str  # "direct", "rag-bm25" or "memstream:<template set>[+reread<N>][+combined]"
    template: str | None  # None for the one-call methods
    reread_tokens: int = 0
    # A collection's documents each asked alone, their answers combined by one call
    # (`pipeline.evaluation.combined`), instead of one chain over the collection.
    combined: bool = False

    @classmethod
    def parse(cls, text: str) -> EvalMethod:
        name = text.strip()
        if name in (DIRECT, RAG_BM25):
            return cls(name, None)
        if name.startswith(MEMSTREAM_PREFIX):
            template = name.removeprefix(MEMSTREAM_PREFIX)
            combined = template.endswith(COMBINED_SUFFIX)
            template = template.removesuffix(COMBINED_SUFFIX)
            reread = _REREAD_SUFFIX.search(template)
            if reread:
                template = template[: reread.start()]
            get_template_set(template)  # an unknown template set fails here, naming the known
            return cls(name, template, int(reread[1]) if reread else 0, combined)
        raise ConfigError(
            f"unknown method {text!r}: use direct, rag-bm25 or "
            "memstream:<template set>[+reread<N>][+combined]"
        )

    @property
    def is_direct(self) -> bool:
        return self.name == DIRECT


def parse_methods(text: str) -> list[EvalMethod]:
    methods = [EvalMethod.parse(part) for part in text.split(",") if part.strip()]
    if not methods:
        raise ConfigError("no method given; use e.g. --methods memstream:memagent-reference,direct")
    return list(dict.fromkeys(methods))


_METHOD = MethodConfig()


@dataclass(frozen=True)
class EvalSettings:
    """What every method of a run shares, as a run's results record it: the method's settings
    (declared by `MethodConfig`, with its defaults) but the template set and the re-read budget,
    which each method names; `context_window` is the engine's max_model_len."""

    context_window: int
    chunk_size: ChunkSize = _METHOD.chunk_size
    max_memory_tokens: MaxMemoryTokens = _METHOD.max_memory_tokens
    max_answer_tokens: MaxAnswerTokens = _METHOD.max_answer_tokens
    temperature: Temperature = _METHOD.temperature
    top_p: TopP = _METHOD.top_p
    seed: Seed = _METHOD.seed

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
    run = _run_combined if method.combined else _run_memstream
    if checkpoints is None:
        with contextlib.closing(EvalCheckpoints.temporary()) as temporary:
            return await run(
                engine, tokenizer, samples, method, method.template, settings, hook, temporary
            )
    return await run(
        engine, tokenizer, samples, method, method.template, settings, hook, checkpoints
    )


class _WithMoreCalls:
    """A progress hook that plans `extra` calls beside those the chains plan."""

    def __init__(self, hook: ProgressHook, extra: int) -> None:
        self.hook, self.extra = hook, extra

    def planned(self, calls: int, earlier: int = 0) -> None:
        self.hook.planned(calls + self.extra, earlier)

    def called(self) -> None:
        self.hook.called()


async def _run_combined(
    engine: Engine,
    tokenizer: Any,
    samples: Sequence[EvalSample],
    method: EvalMethod,
    template: str,
    settings: EvalSettings,
    progress: ProgressHook,
    checkpoints: EvalCheckpoints,
) -> list[Prediction]:
    """`memstream:<template>+combined`: each document of a collection sample asked alone (a
    chain checkpointed as any one-document chain), then one call over their labelled answers."""
    alone = dataclasses.replace(method, combined=False)
    collections = [sample for sample in samples if sample.documents]
    per_document: list[EvalSample] = []
    for sample in collections:
        ordered = order_members(sample.documents, "listed")
        n_tokens = count_tokens([member.text for member, _ in ordered], tokenizer)
        per_document += [
            dataclasses.replace(
                sample,
                sample_id=f"{sample.sample_id}@{member.name}",
                document=member.text,
                n_tokens=tokens,
                documents=(),
            )
            for (member, _), tokens in zip(ordered, n_tokens, strict=True)
        ]
    singles = [sample for sample in samples if not sample.documents]
    hook = _WithMoreCalls(progress, len(collections))
    read = await _run_memstream(
        engine, tokenizer, [*singles, *per_document], alone, template, settings, hook, checkpoints
    )
    by_id = {prediction.sample_id: prediction for prediction in read}
    sampling = settings.sampling()

    async def combine(sample: EvalSample) -> Prediction:
        ordered = order_members(sample.documents, "listed")
        refs = document_refs(ordered)
        answers = [by_id[f"{sample.sample_id}@{member.name}"] for member, _ in ordered]
        block = render_answers([ref.label for ref in refs], [a.prediction for a in answers])
        started = time.perf_counter()
        details: dict[str, Any] = {
            "per_document": [
                {"document": ref.label, "answer": a.prediction, "status": a.status}
                for ref, a in zip(refs, answers, strict=True)
            ]
        }
        counts = {
            "document_tokens": sum(a.document_tokens for a in answers),
            "prompt_tokens": sum(a.prompt_tokens for a in answers),
            "completion_tokens": sum(a.completion_tokens for a in answers),
            "n_calls": sum(a.n_calls for a in answers),
        }
        chains_s = sum(a.seconds for a in answers)
        try:
            completion = await engine.generate(
                GenerationRequest(
                    f"{sample.sample_id}:{method.name}",
                    build_combine_prompt(sample.question, block),
                    settings.max_answer_tokens,
                    sampling,
                )
            )
        except Exception as error:  # one failing sample must not stop the others
            progress.called()
            return _prediction(
                sample,
                method,
                document_tokens=counts["document_tokens"],
                seconds=chains_s + time.perf_counter() - started,
                status="error",
                error=f"{type(error).__name__}: {error}",
                details=details,
            )
        progress.called()
        return _prediction(
            sample,
            method,
            answer=extract_answer(strip_thinking(completion.text)),
            raw_response=completion.text,
            final_memory=block,
            document_tokens=counts["document_tokens"],
            prompt_tokens=counts["prompt_tokens"] + completion.prompt_tokens,
            completion_tokens=counts["completion_tokens"] + completion.completion_tokens,
            n_calls=counts["n_calls"] + 1,
            seconds=chains_s + time.perf_counter() - started,
            details=details,
        )

    combined = dict(
        zip(
            (sample.sample_id for sample in collections),
            await asyncio.gather(*(combine(sample) for sample in collections)),
            strict=True,
        )
    )
    return [
        combined[sample.sample_id] if sample.documents else by_id[sample.sample_id]
        for sample in samples
    ]


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
    prepared = [prepare_sample(sample, tokenizer, config) for sample in samples]
    keys = await checkpoints.call(
        checkpoints.plan,
        [
            (sample, len(document.segments))
            for sample, document in zip(samples, prepared, strict=True)
        ],
        config,
    )
    to_run = dict(zip(keys, prepared, strict=True))  # a sample given twice runs once
    # A re-reading method starts from the final memory of the same method without re-read (or
    # re-read under an earlier wording), where an earlier configuration of this run (or a
    # resumed one) left it.
    memory_from = {
        key: checkpoints.memory_keys(sample, config)
        for key, sample in zip(keys, samples, strict=True)
    }
    before = await checkpoints.call(checkpoints.chains, to_run)
    sources = {source for keys_of_one in memory_from.values() for source in keys_of_one}
    memories = await checkpoints.call(checkpoints.chains, sources)
    reused = {
        key
        for key, keys_of_one in memory_from.items()
        if before[key]["steps_done"] == 0
        and any(
            source in memories and memories[source]["steps_done"] >= len(to_run[key].segments)
            for source in keys_of_one
        )
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
                    memory_from=memory_from.get(key, ()),
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


def prepare_sample(sample: EvalSample, tokenizer: Any, config: MethodConfig) -> PreparedDocument:
    """The sample's chain: over its document, or over its collection's documents in order."""
    if sample.documents:
        return prepare_collection(
            sample.sample_id, sample.documents, [sample.question], tokenizer, config
        )
    document = Document(uri=sample.sample_id, name=sample.sample_id, text=sample.document)
    return prepare(document, [sample.question], tokenizer, config)


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
    reading's prompt. Over a collection, the passages of all its documents are ranked together,
    each shown after its document's label."""
    segmentation = SegmentationConfig(chunk_size=settings.chunk_size)
    if sample.documents:
        ordered = order_members(sample.documents, "listed")
        segments = segment_collection(ordered, tokenizer, segmentation).segments
    else:
        tokenized = tokenize(sample.sample_id, sample.document, tokenizer)
        segments = segment(tokenized, tokenizer, segmentation)
    budget = settings.chunk_size + settings.max_memory_tokens
    passages = select_passages(split_passages(segments, show=as_printed), sample.question, budget)
    prompt = DIRECT_TEMPLATE.format(
        document=defang(render_passages(passages)), question=defang(sample.question)
    )
    details = {
        "shown_tokens": sum(p.n_tokens for p in passages),
        "passages": [
            [p.char_start, p.char_end, *([p.document] if p.document else [])] for p in passages
        ],
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
    sample's document (in any document of its collection)."""
    scores = score(sample.answers, sample.answer_mode, answer, raw_response)
    if sample.documents:
        segments = collection_text_segments(order_members(sample.documents, "listed"))
    else:
        segments = text_segments(sample.sample_id, sample.document)
    grounding = find_evidence(sample.question, answer, final_memory or "", segments)
    scores["grounded"] = float(grounding.grounded)
    return scores


def collection_text_segments(ordered: Sequence[tuple[Member, str]]) -> list[Segment]:
    """Character segments of each document of a collection, labelled with their document, to
    look up evidence in where no token segmentation is at hand."""
    segments: list[Segment] = []
    for (member, _), ref in zip(ordered, document_refs(ordered), strict=True):
        for piece in text_segments(member.doc_id, member.text):
            segments.append(in_collection(piece, len(segments), ref))
    return segments


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
