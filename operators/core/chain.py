"""The memory chain: an engine-agnostic state machine for one (document, question) pair.

A chain yields one request at a time: an update per segment, then the final question. Whoever
drives it (a runner, a Ray actor, a test) sends the request to any engine and hands the reply
back with `submit`. The chain never sees the engine, so it can be checkpointed as (step, memory).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from enum import Enum
from typing import Protocol

from operators.core.extraction import extract_answer, strip_thinking
from operators.core.retrieval import Passage, render_passages, select_passages, split_passages
from operators.core.segmentation import Segment
from operators.core.templates import REFERENCE, TemplateSet

REFERENCE_MAX_MEMORY_TOKENS = 1024
REFERENCE_MAX_ANSWER_TOKENS = 1024
# Rough size of a token in English text: the memory budget of append policies, in characters.
CHARS_PER_TOKEN = 4


@dataclass(frozen=True)
class ChainConfig:
    templates: TemplateSet = REFERENCE
    max_memory_tokens: int = REFERENCE_MAX_MEMORY_TOKENS
    max_answer_tokens: int = REFERENCE_MAX_ANSWER_TOKENS
    # Tokens of the document re-read at answer time: passages that the question and the final
    # memory point to (operators.core.retrieval). 0 answers from the memory alone, as published.
    reread_tokens: int = 0

    def __post_init__(self) -> None:
        for name in ("max_memory_tokens", "max_answer_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1, got {getattr(self, name)}")
        if self.reread_tokens < 0:
            raise ValueError(f"reread_tokens must be 0 or more, got {self.reread_tokens}")


class ChainStatus(str, Enum):
    """Where a chain stands, in one vocabulary: the state store keeps the first four in
    `chains.status` (pending -> running -> done | failed), a runner's result is done or failed,
    and one resume of a checkpointed chain may also end skipped or stopped. The values are what
    the store and the Parquet outputs hold."""

    PENDING = "pending"  # planned, no step run
    RUNNING = "running"  # under way: some steps may be checkpointed
    DONE = "done"  # answered
    FAILED = "failed"  # an error ended it
    SKIPPED = "skipped"  # a resume found it answered by an earlier run: nothing was run
    STOPPED = "stopped"  # a resume stopped where it was: its checkpoint writes were refused

    def __str__(self) -> str:
        return self.value

    def __format__(self, spec: str) -> str:
        return format(self.value, spec)

    @property
    def answer_status(self) -> str:
        """The answer's status as the Serve API and `memstream ask --json` show it: "ok" once
        answered, "error" once failed, else "pending"."""
        if self in (ChainStatus.DONE, ChainStatus.SKIPPED):
            return "ok"
        return "error" if self is ChainStatus.FAILED else "pending"


class StepKind(str, Enum):
    UPDATE = "update"
    FINAL = "final"


@dataclass(frozen=True)
class StepRequest:
    """One model call: a single user message and its token budget."""

    chain_id: str
    step: int
    kind: StepKind
    prompt: str
    max_tokens: int
    segment: Segment | None  # the segment read by an update step

    @property
    def request_id(self) -> str:
        return f"{self.chain_id}:{self.step}"


class MemoryChain:
    """Reads `segments` in order, overwriting the memory after each, then answers `question`.

    `memory` and `start_step` resume a checkpointed chain: step k reads segment k, and
    step len(segments) is the final answer.
    """

    def __init__(
        self,
        chain_id: str,
        question: str,
        segments: Sequence[Segment],
        config: ChainConfig = ChainConfig(),
        *,
        memory: str | None = None,
        start_step: int = 0,
    ) -> None:
        if not 0 <= start_step <= len(segments):
            raise ValueError(f"start_step {start_step} outside 0..{len(segments)}")
        self.chain_id = chain_id
        self.question = question
        self.segments = segments
        self.config = config
        self.memory = config.templates.initial_memory if memory is None else memory
        self.step = start_step
        self.raw_response: str | None = None
        self.rejected: tuple[str, ...] = ()  # reply lines the last update's policy dropped
        self.reread: tuple[Passage, ...] = ()  # the passages the answer step re-read

    @property
    def n_steps(self) -> int:
        return len(self.segments) + 1

    @property
    def done(self) -> bool:
        return self.raw_response is not None

    @property
    def tokens_left(self) -> int:
        """Document tokens this chain has still to read: its remaining critical path."""
        return sum(segment.n_tokens for segment in self.segments[self.step :])

    @property
    def answer(self) -> str | None:
        return None if self.raw_response is None else extract_answer(self.raw_response)

    def next_request(self) -> StepRequest | None:
        if self.done:
            return None
        templates = self.config.templates
        if self.step < len(self.segments):
            segment = self.segments[self.step]
            return StepRequest(
                chain_id=self.chain_id,
                step=self.step,
                kind=StepKind.UPDATE,
                prompt=templates.render_update(self.question, self.memory, segment.shown_text),
                max_tokens=self.config.max_memory_tokens,
                segment=segment,
            )
        if self.config.reread_tokens:
            self.reread = tuple(self.passages_to_reread())
            prompt = templates.render_reread(
                self.question, self.memory, render_passages(self.reread)
            )
        else:
            prompt = templates.render_final(self.question, self.memory)
        return StepRequest(
            chain_id=self.chain_id,
            step=self.step,
            kind=StepKind.FINAL,
            prompt=prompt,
            max_tokens=self.config.max_answer_tokens,
            segment=None,
        )

    def passages_to_reread(self) -> list[Passage]:
        """The passages the question and the final memory point to (its quotes, names and
        figures), within the re-read budget, the best one last: nearest the memory and the
        question in the answer prompt."""
        memory = self.memory if self.memory != self.config.templates.initial_memory else ""
        return select_passages(
            split_passages(self.segments),
            self.question,
            self.config.reread_tokens,
            hints=memory,
            best_last=True,
        )

    def submit(self, reply: str) -> None:
        """Takes the model's reply to the current request and advances."""
        if self.done:
            raise RuntimeError(f"chain {self.chain_id} is already answered")
        if self.step < len(self.segments):
            templates = self.config.templates
            budget_chars = (
                self.config.max_memory_tokens * templates.memory_holds_replies * CHARS_PER_TOKEN
            )
            read = self.segments[self.step]
            update = templates.next_memory(
                self.memory,
                strip_thinking(reply),
                read.text,
                budget_chars,
                label=read.document.label if read.document else "",
            )
            self.memory, self.rejected = update.memory, update.rejected
        else:
            self.raw_response = reply
        self.step += 1


class Reply(Protocol):
    """What a step needs of the engine's reply (`operators.engine.Completion` is one)."""

    @property
    def text(self) -> str: ...
    @property
    def prompt_tokens(self) -> int: ...
    @property
    def completion_tokens(self) -> int: ...
    @property
    def finish_reason(self) -> str | None: ...
    @property
    def latency_s(self) -> float: ...


@dataclass(frozen=True)
class StepRecord:
    """One model call of a chain: a row of the memory trajectory (the audit trail)."""

    chain_id: str
    step: int
    kind: str
    segment_index: int | None
    token_start: int | None
    token_end: int | None
    char_start: int | None
    char_end: int | None
    output: str  # the memory after an update step, the raw response of the final step
    prompt_tokens: int
    completion_tokens: int
    finish_reason: str | None
    latency_s: float
    rejected_quotes: tuple[str, ...] = ()  # reply lines a verifying memory policy dropped
    # The answer step's re-read passages, as (char_start, char_end) in the document's text.
    reread_spans: tuple[tuple[int, int], ...] = ()

    @classmethod
    def after(cls, chain: MemoryChain, request: StepRequest, completion: Reply) -> StepRecord:
        """The record of `request`, whose reply `chain` has just taken."""
        update = request.kind is StepKind.UPDATE
        segment = request.segment
        return cls(
            chain_id=request.chain_id,
            step=request.step,
            kind=request.kind.value,
            segment_index=segment.index if segment else None,
            token_start=segment.token_start if segment else None,
            token_end=segment.token_end if segment else None,
            char_start=segment.char_start if segment else None,
            char_end=segment.char_end if segment else None,
            output=chain.memory if update else completion.text,
            prompt_tokens=completion.prompt_tokens,
            completion_tokens=completion.completion_tokens,
            finish_reason=completion.finish_reason,
            latency_s=completion.latency_s,
            rejected_quotes=chain.rejected if update else (),
            reread_spans=() if update else tuple((p.char_start, p.char_end) for p in chain.reread),
        )
