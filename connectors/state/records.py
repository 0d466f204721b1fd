"""What the state store takes and gives back: plain, frozen records."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from connectors.state.schema import FINISHED_JOB
from operators.core.chain import ChainStatus

if TYPE_CHECKING:
    from operators.core.chain import MemoryChain, StepRecord


@dataclass(frozen=True)
class DocumentRecord:
    run_id: str
    attempt: int
    source_uri: str
    doc_id: str
    name: str
    content_sha256: str
    parser: str | None
    pages: int | None
    warnings: Sequence[str]
    metadata: Mapping[str, Any]
    n_tokens: int | None = None
    n_segments: int | None = None


@dataclass(frozen=True)
class Checkpoint:
    """Where a chain stands: its status, the next step to run and the memory after the last."""

    status: ChainStatus
    step: int
    memory: str | None
    answer: str | None = None
    has_evidence: bool = False  # whether the answer's evidence was recorded


@dataclass(frozen=True)
class StepCheckpoint:
    """One finished model call (its `steps` row; the record's chain_id is the chain key) and
    the chain state right after it."""

    record: StepRecord
    next_step: int
    memory: str
    done: bool
    answer: str | None
    raw_response: str | None

    @classmethod
    def after(cls, chain: MemoryChain, record: StepRecord) -> StepCheckpoint:
        return cls(record, chain.step, chain.memory, chain.done, chain.answer, chain.raw_response)

    @property
    def chain_key(self) -> str:
        return self.record.chain_id


@dataclass(frozen=True)
class ErrorRecord:
    run_id: str
    attempt: int
    source_uri: str
    stage: str  # "read", "parse", "segment", "memory"
    error_type: str
    message: str
    doc_id: str | None = None
    name: str | None = None


@dataclass(frozen=True)
class RunStart:
    """The run an invocation of a job works on: a new one, or the unfinished one it resumes."""

    run_id: str
    attempt: int  # 1 for a new run
    previous_run_id: str | None  # the last finished run over the same archive before it


@dataclass(frozen=True)
class DocumentChanges:
    """A run's documents against the previous finished run over the same archive, by source
    URI, and by content sha256 for the documents both answered. A document that cannot be read
    now counts in neither, and is not removed."""

    previous_run_id: str | None = None
    new: int = 0  # not answered by the previous run
    changed: int = 0  # other content
    unchanged: int = 0  # the same content: its answers carried forward, unless asked anew
    removed: int = 0  # answered by the previous run, no longer listed


@dataclass(frozen=True)
class LockHolder:
    """Who holds an archive's run lock, and until when unless renewed."""

    owner: str  # a token of the holding process
    host: str
    pid: int
    acquired_at: float
    expires_at: float


@dataclass(frozen=True)
class RunProgress:
    steps_done: int
    steps_planned: int
    chains_done: int
    chains_planned: int
    # Of the collections' chains: the members each has read whole, and each one's member count,
    # summed over the chains (a collection asked two questions counts its members twice).
    members_done: int = 0
    members_planned: int = 0


@dataclass(frozen=True)
class NewJob:
    name: str
    source: str
    questions: tuple[str, ...]
    method: dict[str, Any]
    uri: str | None = None
    data: bytes | None = None
    mime_type: str | None = None


@dataclass(frozen=True)
class ChainState:
    chain_index: int
    chain_key: str
    question: str
    n_segments: int
    step: int
    memory: str | None
    status: ChainStatus  # as stored: pending, running, done or failed
    answer: str | None
    raw_response: str | None
    error: str | None
    prompt_tokens: int
    completion_tokens: int
    compute_s: float
    grounded: bool | None = None  # None until the answer's evidence is looked up
    grounding_reason: str | None = None
    evidence: tuple[dict[str, Any], ...] = ()

    @property
    def segments_done(self) -> int:
        return min(self.step, self.n_segments)

    @property
    def done(self) -> bool:
        return self.status in (ChainStatus.DONE, ChainStatus.FAILED)

    def answer_record(self) -> dict[str, Any]:
        return {
            "question": self.question,
            "status": self.status.answer_status,
            "answer": self.answer,
            "raw_response": self.raw_response,
            "final_memory": self.memory or "",
            "n_segments": self.n_segments,
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": self.completion_tokens,
            "compute_s": round(self.compute_s, 3),
            "error": self.error,
            "grounded": self.grounded,
            "grounding_reason": self.grounding_reason,
            "evidence": list(self.evidence),
        }


@dataclass(frozen=True)
class JobState:
    job_id: str
    status: str
    name: str
    source: str
    questions: tuple[str, ...]
    method: dict[str, Any]
    document: dict[str, Any] | None
    error: str | None
    created_at: float
    started_at: float | None
    updated_at: float
    finished_at: float | None
    chains: tuple[ChainState, ...] = ()

    @property
    def finished(self) -> bool:
        return self.status in FINISHED_JOB


@dataclass(frozen=True)
class JobInput:
    """What a replica needs to run a claimed job."""

    job_id: str
    name: str
    uri: str | None
    data: bytes | None
    mime_type: str | None
    questions: tuple[str, ...]
    method: dict[str, Any]
    text: str | None
    chains: tuple[ChainState, ...]


@dataclass(frozen=True)
class Event:
    event_id: int
    kind: str
    data: dict[str, Any] = field(default_factory=dict)
