"""The one checkpointed chain driver: the Ray memory operator and Serve jobs both run chains
through `resume_chain`.

Load the chain's checkpoint; skip it if answered (recording its evidence if a crash came between
the answer and its evidence); otherwise rebuild it at its checkpointed step and memory, run it,
checkpoint every step, and record the answer's evidence, or the chain's failure. Where the
checkpoints are kept and who may write them is the `ChainCheckpoints` it is given.
"""

from __future__ import annotations

import asyncio
import functools
import hashlib
import json
import logging
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from connectors.engines.factory import EngineSpec
from connectors.state.database import StateStoreError
from connectors.state.records import Checkpoint, StepCheckpoint
from operators.config import MethodConfig
from operators.core.chain import ChainConfig, ChainStatus, MemoryChain, StepRecord
from operators.core.evidence import Grounding, find_evidence
from operators.core.segmentation import Segment
from operators.runner import ChainResult, ChainRunner

logger = logging.getLogger(__name__)

# How a blocking store call is run off the event loop (default: a worker thread).
StoreCall = Callable[..., Awaitable[Any]]


def chain_key(content_sha256: str, question: str, engine: EngineSpec, method: MethodConfig) -> str:
    """A chain's key: everything that changes its steps, so a checkpoint is continued only by
    the same question of the same text, read the same way by the same model."""
    return _key(content_sha256, question, engine, method.identity())


def memory_keys(
    content_sha256: str, question: str, engine: EngineSpec, method: MethodConfig
) -> tuple[str, ...]:
    """The keys of the chains whose final memory a re-reading chain may start its answer step
    from (`MethodConfig.memory_identities`, `ChainWork.memory_from`)."""
    return tuple(
        _key(content_sha256, question, engine, identity) for identity in method.memory_identities()
    )


def _key(content_sha256: str, question: str, engine: EngineSpec, method: dict[str, object]) -> str:
    identity = {
        "content_sha256": content_sha256,
        "question": question,
        "model": engine.model,
        "tokenizer": engine.tokenizer or engine.model,
        **engine.answer_settings(),
        "method": method,
    }
    return hashlib.sha256(json.dumps(identity, sort_keys=True).encode()).hexdigest()


class ChainCheckpoints(Protocol):
    """Where chains' progress is kept. Each write returns False when this writer may no longer
    write (a Serve replica that lost its job's lease); the chain then stops where it is."""

    def load_checkpoint(self, chain_key: str) -> Checkpoint | None: ...
    def mark_running(self, chain_key: str) -> bool: ...
    def record_step(self, checkpoint: StepCheckpoint) -> bool: ...
    def record_grounding(self, chain_key: str, grounding: Grounding) -> bool: ...
    def mark_failed(self, chain_key: str, error: str) -> bool: ...


@dataclass(frozen=True)
class ChainWork:
    """One chain to bring to its answer: its key, its question and its document's segments
    (None when the document was not segmented again because every chain was answered)."""

    chain_key: str
    question: str
    segments: Sequence[Segment] | None
    page_starts: Sequence[int] | None = None
    # The keys of the same chain answered another way (`memory_keys`): when this chain has run
    # no step and one of them read every segment, this one starts at its answer step from that
    # final memory, so a re-read costs one call, not the whole chain again.
    memory_from: tuple[str, ...] = ()


@dataclass(frozen=True)
class ChainOutcome:
    status: ChainStatus  # DONE, FAILED, SKIPPED (answered earlier) or STOPPED (writes refused)
    start_step: int = 0
    result: ChainResult | None = None
    error: str | None = None


class WritesRefused(Exception):
    """The checkpoints refused a write: another writer owns the chain now."""


async def resume_chain(
    work: ChainWork,
    runner: Callable[[], Awaitable[ChainRunner]],
    config: ChainConfig,
    checkpoints: ChainCheckpoints,
    in_store: StoreCall | None = None,
    on_step: Callable[[StepRecord], None] | None = None,
) -> ChainOutcome:
    """Brings one chain to its answer from wherever its checkpoint left it. `runner` gives the
    runner when there is a step to run (so a rerun with everything answered starts no engine);
    `in_store` runs each store call off the event loop; `on_step` sees every written step."""
    call: StoreCall = in_store or asyncio.to_thread
    try:
        checkpoint = await call(checkpoints.load_checkpoint, work.chain_key)
        if checkpoint is not None and checkpoint.status == ChainStatus.DONE:
            if not checkpoint.has_evidence and work.segments is not None:
                await _ground(work, checkpoint.answer, checkpoint.memory, checkpoints, call)
            return ChainOutcome(ChainStatus.SKIPPED, checkpoint.step)
        if work.segments is None:
            raise RuntimeError("the document was planned as answered; run the job again")
        for source in work.memory_from if checkpoint is None or checkpoint.step == 0 else ():
            read = await call(checkpoints.load_checkpoint, source)
            if read is not None and read.step >= len(work.segments):
                checkpoint = Checkpoint(read.status, len(work.segments), read.memory)
                break
        start_step = min(checkpoint.step if checkpoint else 0, len(work.segments))
        chain = MemoryChain(
            work.chain_key,
            work.question,
            work.segments,
            config,
            memory=checkpoint.memory if checkpoint and start_step > 0 else None,
            start_step=start_step,
        )
        chain_runner = await runner()  # may start the engine: the chain waits, not running
        if not await call(checkpoints.mark_running, work.chain_key):
            return ChainOutcome(ChainStatus.STOPPED, start_step)

        refused = False
        store_failure: StateStoreError | None = None

        async def checkpoint_step(chain: MemoryChain, record: StepRecord) -> None:
            nonlocal refused, store_failure
            try:
                written = await call(checkpoints.record_step, StepCheckpoint.after(chain, record))
            except StateStoreError as error:  # the runner makes it the chain's error: keep it
                store_failure = error
                raise
            if not written:
                refused = True
                raise WritesRefused(work.chain_key)
            if on_step is not None:
                on_step(record)
            if chain.done:  # in the chain's runner slot, so an answer and its evidence go together
                await _ground(work, chain.answer, chain.memory, checkpoints, call)

        result = await chain_runner.run_chain(chain, checkpoint_step)
        if store_failure is not None:
            raise store_failure
    except StateStoreError:
        # Nothing can be recorded: the caller stops, and the chain resumes from its last
        # written step on the next attempt.
        raise
    except Exception as error:  # a bug: recorded, resumable later
        logger.exception("chain %s failed", work.chain_key)
        message = f"{type(error).__name__}: {error}"
        await _record_failure(work.chain_key, message, checkpoints, call)
        return ChainOutcome(ChainStatus.FAILED, error=message)
    if refused:
        return ChainOutcome(ChainStatus.STOPPED, start_step, result)
    if result.status != ChainStatus.DONE:
        error_message = result.error or "unknown error"
        await _record_failure(work.chain_key, error_message, checkpoints, call)
        return ChainOutcome(ChainStatus.FAILED, start_step, result, error_message)
    return ChainOutcome(ChainStatus.DONE, start_step, result)


async def _ground(
    work: ChainWork,
    answer: str | None,
    memory: str | None,
    checkpoints: ChainCheckpoints,
    call: StoreCall,
) -> None:
    """Finds the answer's evidence in the source and records it; a failure here costs the
    answer its evidence, never the answer."""
    assert work.segments is not None
    try:
        grounding = await asyncio.get_running_loop().run_in_executor(
            None,
            functools.partial(
                find_evidence, work.question, answer, memory or "", work.segments,
                work.page_starts or None,
            ),
        )  # fmt: skip
        await call(checkpoints.record_grounding, work.chain_key, grounding)
    except Exception:
        logger.exception("cannot find the evidence of chain %s", work.chain_key)


async def _record_failure(
    chain_key: str, message: str, checkpoints: ChainCheckpoints, call: StoreCall
) -> None:
    try:
        await call(checkpoints.mark_failed, chain_key, message)
    except Exception:
        logger.exception("cannot record the failure of chain %s", chain_key)
