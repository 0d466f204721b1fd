"""Rollouts: memory chains sampled through an engine, kept as the token ids it saw and sampled.

A rollout of one sample is a `MemoryChain` driven step by step: K update conversations (segment
and memory in, new memory out) and one final conversation (memory and question in, answer
out). Each conversation is kept as the prompt ids the engine was sent and the ids it sampled,
the end-of-sequence token included, so the learner trains on exactly those tokens, never on
re-encoded text.

A memory enters the next prompt as the ids it was sampled as, its end-of-sequence token
stripped, as the reference does (`unpad(remove_eos=True)`): the prompt is the chat-rendered
template cut at the memory's place, its two sides encoded, the memory's ids spliced between
them. Where the system changed the memory (an append or quotes policy, escaped tags, a
`</think>` stripped), the memory's text is encoded instead; the engine is still sent, and the
learner still trains on, the same ids.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from connectors.engines import models
from connectors.engines.factory import EngineSpec
from operators.core.chain import ChainConfig, MemoryChain, StepKind, StepRequest
from operators.core.extraction import extract_answer
from operators.core.scoring import AnswerMode, score
from operators.core.segmentation import Segment, SegmentationConfig, segment, tokenize
from operators.core.templates import defang
from operators.engine import Engine, GenerationRequest, SamplingConfig
from pipeline.training.config import TrainConfig
from pipeline.training.contract_fields import FieldSample
from pipeline.training.learner import Conversation
from pipeline.training.needle_facts import NeedleSample
from pipeline.training.table_figures import TableFigureSample
from pipeline.training.tasks import FactSample

TrainingSample = FactSample | NeedleSample | TableFigureSample | FieldSample

# Where the memory goes in a rendered prompt: private-use characters no template, tokenizer
# rule or document text makes, and that defang leaves alone.
MEMORY_SLOT = "\ue000memory\ue001"


@dataclass(frozen=True)
class ChainRollout:
    """One sampled chain of one sample: its conversations, its answer and its reward."""

    group: int  # the sample it answers: rollouts of one sample form a group
    conversations: tuple[Conversation, ...]
    response: str  # the final conversation's text
    answer: str | None  # extracted from `response` (None: no "the answer is")
    reward: float
    memory_hit_budget: tuple[bool, ...]  # each update that stopped at the memory budget


def reward_of(
    response: str,
    answers: Sequence[str],
    *,
    raw_match: bool = False,
    answer_mode: AnswerMode = "any",
) -> float:
    """1.0 when the extracted answer is right as the evaluation scores it
    (operators.core.scoring): for `answer_mode` "any" it matches a gold answer after
    normalisation (sub_em, best over the golds), for "all" it names every gold (the parties of
    a contract); else 0.0. `raw_match` also counts the golds found anywhere in the response,
    for models that seldom say "the answer is"."""
    if not answers:
        return 0.0
    scores = score(answers, answer_mode, extract_answer(response), response)
    if scores["accuracy"] == 1.0 or (raw_match and scores["raw_match"] == 1.0):
        return 1.0
    return 0.0


class PromptSplicer:
    """The token ids of a chain's next prompt, with the last memory's sampled ids spliced in."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self.end_ids = frozenset(tokenizer.all_special_ids)

    def chat_ids(self, content: str) -> list[int]:
        return list(
            self.tokenizer.apply_chat_template(
                [{"role": "user", "content": content}],
                tokenize=True,
                add_generation_prompt=True,
                return_dict=False,
            )
        )

    def prompt_ids(
        self, chain: MemoryChain, request: StepRequest, memory_ids: Sequence[int] | None
    ) -> list[int]:
        if memory_ids is None:
            return self.chat_ids(request.prompt)
        templates = chain.config.templates
        if request.kind is StepKind.UPDATE:
            assert request.segment is not None
            content = templates.render_update(chain.question, MEMORY_SLOT, request.segment.text)
        else:
            content = templates.render_final(chain.question, MEMORY_SLOT)
        if MEMORY_SLOT not in content:  # the template does not show the memory (verified-quotes)
            return self.chat_ids(request.prompt)
        rendered = self.tokenizer.apply_chat_template(
            [{"role": "user", "content": content}], tokenize=False, add_generation_prompt=True
        )
        before, after = rendered.split(MEMORY_SLOT)
        encode = self.tokenizer.encode
        return (
            encode(before, add_special_tokens=False)
            + list(memory_ids)
            + encode(after, add_special_tokens=False)
        )

    def memory_ids(self, memory: str, response_ids: Sequence[int], reply: str) -> list[int] | None:
        """The reply's ids without its end-of-sequence token when they are the new memory as
        is; None when the memory is not the reply (the system changed it) or holds what the
        template would escape."""
        ids = list(response_ids)
        if ids and ids[-1] in self.end_ids:
            ids.pop()
        if memory != reply or defang(memory) != memory:
            return None
        if self.tokenizer.decode(ids, skip_special_tokens=True) != memory:
            return None
        return ids


async def roll_out_chain(
    engine: Engine,
    splicer: PromptSplicer,
    chain: MemoryChain,
    sampling: SamplingConfig,
    sample_index: int,
) -> tuple[list[Conversation], str, list[bool]]:
    """Drives `chain` to its answer through `engine`; returns its conversations, the final
    response and, per update, whether it stopped at the memory budget."""
    conversations: list[Conversation] = []
    hit_budget: list[bool] = []
    memory_ids: list[int] | None = None
    while (request := chain.next_request()) is not None:
        prompt_ids = splicer.prompt_ids(chain, request, memory_ids)
        completion = await engine.generate(
            GenerationRequest(
                request_id=request.request_id,
                prompt=request.prompt,
                max_tokens=request.max_tokens,
                sampling=sampling,
                prompt_token_ids=tuple(prompt_ids),
                logprobs=True,
            )
        )
        if tuple(completion.prompt_token_ids) != tuple(prompt_ids) or not completion.token_ids:
            raise RuntimeError(
                f"engine {engine.model} does not report token ids: train with the vLLM engine"
            )
        conversations.append(
            Conversation(
                sample_index, completion.prompt_token_ids, completion.token_ids,
                completion.logprobs,
            )
        )  # fmt: skip
        chain.submit(completion.text)
        if request.kind is StepKind.UPDATE:
            hit_budget.append(completion.finish_reason == "length")
            memory_ids = splicer.memory_ids(chain.memory, completion.token_ids, completion.text)
    return conversations, chain.raw_response or "", hit_budget


async def roll_out_group(
    engine: Engine,
    splicer: PromptSplicer,
    *,
    group: int,
    first_index: int,
    question: str,
    answers: Sequence[str],
    answer_mode: AnswerMode = "any",
    segments: Sequence[Segment],
    config: ChainConfig,
    sampling: SamplingConfig,
    group_size: int,
    raw_match: bool = False,
) -> list[ChainRollout]:
    """`group_size` chains over one sample, sampled side by side (the engine batches them),
    each with its own seed; rollout i of the group is sample `first_index + i` of the batch."""

    async def one(i: int) -> ChainRollout:
        chain = MemoryChain(f"g{group}r{i}", question, segments, config)
        seeded = replace(sampling, seed=sampling.seed + first_index + i)
        conversations, response, hit_budget = await roll_out_chain(
            engine, splicer, chain, seeded, first_index + i
        )
        return ChainRollout(
            group=group,
            conversations=tuple(conversations),
            response=response,
            answer=extract_answer(response),
            reward=reward_of(response, answers, raw_match=raw_match, answer_mode=answer_mode),
            memory_hit_budget=tuple(hit_budget),
        )

    return list(await asyncio.gather(*(one(i) for i in range(group_size))))


async def roll_out_samples(
    engine: Engine,
    splicer: PromptSplicer,
    config: TrainConfig,
    samples: Sequence[TrainingSample],
    tokenizer: Any,
    step: int,
    draw: int,
    sampling: SamplingConfig | None = None,
    first_group: int = 0,
) -> list[list[ChainRollout]]:
    """`group_size` chains for each sample, all at once; sampled at the run's temperature with
    a seed of (run, step, draw) unless `sampling` says otherwise. `samples` are groups
    `first_group` on of the draw: a chain's seed follows from its group, so a share of a draw
    rolled out apart (pipeline.training.rollout_engines) samples what the whole draw would."""
    sampling = sampling or SamplingConfig(
        temperature=config.temperature,
        top_p=config.top_p,
        seed=config.seed * 1_000_003 + step * 10_007 + draw * 101,
    )
    chain_config = config.chain()
    segmentation = SegmentationConfig(chunk_size=config.chunk_size)
    jobs = []
    for group, sample in enumerate(samples, start=first_group):
        tokenized = tokenize(sample.sample_id, sample.document, tokenizer)
        jobs.append(
            roll_out_group(
                engine, splicer, group=group, first_index=group * config.group_size,
                question=sample.question, answers=sample.answers,
                answer_mode=sample.answer_mode,
                segments=segment(tokenized, tokenizer, segmentation), config=chain_config,
                sampling=sampling, group_size=config.group_size, raw_match=config.raw_match,
            )
        )  # fmt: skip
    return list(await asyncio.gather(*jobs))


def rollout_engine_spec(config: TrainConfig, weights: Path) -> EngineSpec:
    """float32, so the engine's log-probabilities match the learner's (issue 17's sync rule);
    reported after the temperature, as the learner computes them; no prompt lookup, whose
    rejection sampling the learner does not model."""
    return EngineSpec(
        model=str(weights),
        tokenizer=models.resolve(config.model),
        dtype="float32",
        max_model_len=config.max_model_len,
        cpu_kvcache_space_gib=config.kv_cache_gib,
        enforce_eager=True,
        prompt_lookup_tokens=0,
        engine_kwargs={"logprobs_mode": "processed_logprobs"},
    )


def load_tokenizer(base: str) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(base)
