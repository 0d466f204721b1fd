"""The memory stage: planned documents in, one result row per chain out, on an actor pool
of engines.

Each actor owns one engine and drives every chain of every batch it holds concurrently, so the
engine batches steps across documents.
"""

from __future__ import annotations

import asyncio
import atexit
import functools
import logging
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pyarrow as pa

from connectors.engines.factory import ENGINE_ACTOR_ENV_VARS, EngineFactory, open_engine
from connectors.state.store import StateStore
from operators.core.document import Document, PlannedChain, documents_of
from operators.runner import ChainRunner
from pipeline.resume import ChainWork, resume_chain
from pipeline.stages.run import RunContext

logger = logging.getLogger(__name__)

# Ray kills an exiting actor's child processes before any Python teardown runs, so the engine
# would lose its processes while alive (and log EngineDeadError). With this off in the memory
# actors, MemoryStage.close shuts the engine down in order at exit; vLLM's own processes still
# exit when their parent dies.
ENGINE_ACTOR_ENV = {**ENGINE_ACTOR_ENV_VARS, "RAY_kill_child_processes_on_worker_exit": "false"}

# Documents reach an actor one at a time (a burst when its engine has just started), so free
# slots wait until chains stop arriving for this long, then go to the longest waiting chains.
ADMISSION_SETTLE_S = 0.25

RESULT_SCHEMA = pa.schema(
    [
        ("source_uri", pa.string()),
        ("doc_id", pa.string()),
        ("question_id", pa.string()),
        ("chain_key", pa.string()),
        # done, failed, skipped (answered by an earlier attempt) or stopped
        ("status", pa.string()),
        ("start_step", pa.int64()),
        ("steps_run", pa.int64()),
        ("n_steps", pa.int64()),
        ("prompt_tokens", pa.int64()),
        ("completion_tokens", pa.int64()),
        ("elapsed_s", pa.float64()),
        ("error", pa.string()),
    ]
)


class MemoryStage:
    """Planned documents in, one result row per chain out. Each actor owns one engine;
    `__call__` is async, so the batches an actor holds run side by side on one event loop and
    their chains' steps meet in the engine's continuous batch. Every step is checkpointed
    before the chain moves on; a chain resumes from its last checkpoint, and an answered one
    is skipped. The engine is built by `engine_factory` when the first chain needs it, so a
    rerun whose chains are all answered costs no engine start-up."""

    def __init__(
        self,
        run: RunContext,
        max_active_chains: int,
        longest_first: bool = True,
        engine_factory: EngineFactory = open_engine,
    ) -> None:
        self.run = run
        self.engine_factory = engine_factory
        self.store = StateStore(run.store_url)
        self.chain_config = run.method.chain()
        self.max_active_chains = max_active_chains
        self.longest_first = longest_first
        self.engine: Any = None
        self._runner: ChainRunner | None = None
        self._runner_lock = asyncio.Lock()
        # Store calls block; one thread per actor keeps them off the event loop, in order.
        self._store_thread = ThreadPoolExecutor(1, thread_name_prefix="memstream-store")
        self._closed = threading.Event()

    async def __call__(self, batch: pa.Table) -> pa.Table:
        results = await asyncio.gather(*(self._run_document(d) for d in documents_of(batch)))
        return pa.Table.from_pylist([r for rows in results for r in rows], schema=RESULT_SCHEMA)

    async def _run_document(self, document: Document) -> list[dict[str, Any]]:
        return list(
            await asyncio.gather(*(self._run_chain(document, chain) for chain in document.chains))
        )

    async def _run_chain(self, document: Document, chain: PlannedChain) -> dict[str, Any]:
        segments = None if document.segments is None else list(document.segments)
        work = ChainWork(
            chain.chain_key,
            chain.question,
            segments,
            document.page_starts or None,
            memory_from=self.run.memory_keys(document.content_sha256 or "", chain.question),
        )
        outcome = await resume_chain(
            work, self._chain_runner, self.chain_config, self.store, self._in_store
        )
        result = outcome.result
        return {
            "source_uri": document.uri,
            "doc_id": document.doc_id,
            "question_id": chain.question_id,
            "chain_key": work.chain_key,
            "status": outcome.status.value,
            "start_step": outcome.start_step,
            "steps_run": len(result.trajectory) if result else 0,
            "n_steps": 0 if segments is None else len(segments) + 1,
            "prompt_tokens": result.prompt_tokens if result else 0,
            "completion_tokens": result.completion_tokens if result else 0,
            "elapsed_s": result.elapsed_s if result else 0.0,
            "error": outcome.error,
        }

    async def _chain_runner(self) -> ChainRunner:
        async with self._runner_lock:
            if self._runner is None:
                # Blocks the actor's event loop while the engine starts; no chain of this
                # actor could move without it anyway.
                self.engine = self.engine_factory(self.run.engine)
                # Ray Data's async actors keep the UDF referenced until the process exits, so
                # __del__ would come too late: multiprocessing's exit hook would wait forever
                # on the engine's processes. Exit hooks run last-registered first; registered
                # here, after the engine imported multiprocessing, this one runs before it.
                atexit.register(self.close)
                self._runner = ChainRunner(
                    self.engine,
                    self.run.method.sampling(),
                    self.max_active_chains,
                    longest_first=self.longest_first,
                    admission_settle_s=ADMISSION_SETTLE_S if self.longest_first else 0.0,
                )
            return self._runner

    async def _in_store(self, call: Any, *args: Any) -> Any:
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._store_thread, functools.partial(call, *args))

    def close(self) -> None:
        """Shuts the engine down. Called from the actor's main thread at teardown; vLLM's
        shutdown is synchronous inside, so it needs no event loop of the actor's."""
        if self._closed.is_set():
            return
        self._closed.set()
        engine, self.engine = self.engine, None
        if engine is not None:
            try:
                asyncio.run(engine.shutdown())
            except Exception:
                logger.warning("engine shutdown failed", exc_info=True)
        self._store_thread.shutdown(wait=True)
        self.store.close()

    def __del__(self) -> None:
        if hasattr(self, "_closed"):
            self.close()
