"""Running jobs in an API replica: claim them from the store, run their chains, checkpoint.

Each replica has a `JobWorker`. It leases queued jobs, and jobs whose lease ran out, from the
store (so after a restart, or when a replica dies, unfinished jobs are taken up again), runs up
to `max_running_per_replica` of them at once, and renews its leases. A job reads its document
(fetch, parse) the first time it runs and keeps the text in the store; each chain step is
checkpointed as (step, memory) with its event, so a resumed job continues where it stopped.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket
import time
import uuid
from collections.abc import Sequence

from connectors.state.store import StepCheckpoint
from pipeline.config import MethodConfig
from pipeline.core.chain import MemoryChain, StepRecord
from pipeline.core.evidence import find_evidence
from pipeline.core.segmentation import Segment
from pipeline.engines.base import Completion, Engine, GenerationRequest
from pipeline.runner import ChainRunner
from serving.answering import DocumentPreparer, document_info
from serving.config import JobsConfig
from serving.documents import DocumentLoader, DocumentRequest, InputError
from serving.engine import EngineUnavailable
from serving.metrics import ServingMetrics
from serving.store import FAILED, SUCCEEDED, ChainState, JobInput, JobStore, StoreError

logger = logging.getLogger("ray.serve")
STORE_RETRY_S = 2.0


class JobWorker:
    def __init__(
        self,
        store: JobStore,
        loader: DocumentLoader,
        preparer: DocumentPreparer,
        engine: Engine,
        config: JobsConfig,
        metrics: ServingMetrics,
    ) -> None:
        self.store = store
        self.loader = loader
        self.preparer = preparer
        self.engine = engine
        self.config = config
        self.metrics = metrics
        self.owner = f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:8]}"
        self._tasks: dict[str, asyncio.Task[None]] = {}
        self._wake = asyncio.Event()
        self._loop_task: asyncio.Task[None] | None = None

    @property
    def running(self) -> int:
        return len(self._tasks)

    def start(self) -> None:
        self._loop_task = asyncio.create_task(self._claim_forever(), name="memstream-jobs")

    def wake(self) -> None:
        """A job was just queued: look for it now rather than at the next poll."""
        self._wake.set()

    def cancel_local(self, job_id: str) -> None:
        task = self._tasks.get(job_id)
        if task is not None:
            task.cancel()

    async def stop(self) -> None:
        """Stops running jobs and gives them back to the store for any replica to resume."""
        if self._loop_task is not None:
            self._loop_task.cancel()
        tasks = dict(self._tasks)
        for task in tasks.values():
            task.cancel()
        await asyncio.gather(*tasks.values(), return_exceptions=True)
        try:
            await asyncio.to_thread(self.store.release, self.owner, list(tasks))
        except StoreError:
            logger.warning(
                "could not release %d job lease(s); they expire by themselves", len(tasks)
            )

    async def _claim_forever(self) -> None:
        renewed_at = time.monotonic()
        while True:
            try:
                free = self.config.max_running_per_replica - len(self._tasks)
                for job_id in await asyncio.to_thread(
                    self.store.claim, self.owner, self.config.lease_s, free
                ):
                    self._start(job_id)
                if time.monotonic() - renewed_at >= self.config.lease_s / 3:
                    await self._renew()
                    renewed_at = time.monotonic()
            except StoreError as error:
                logger.warning("job store unavailable: %s", error)
                await asyncio.sleep(STORE_RETRY_S)
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._wake.wait(), self.config.poll_interval_s)
            self._wake.clear()

    async def _renew(self) -> None:
        local = list(self._tasks)
        held = await asyncio.to_thread(self.store.renew, self.owner, local, self.config.lease_s)
        for job_id in set(local) - held:  # cancelled by a client, or taken over after a stall
            self.cancel_local(job_id)

    def _start(self, job_id: str) -> None:
        task = asyncio.create_task(self._run(job_id), name=f"memstream-job-{job_id}")
        self._tasks[job_id] = task
        self.metrics.jobs_running_here.labels(self.metrics.replica).set(len(self._tasks))
        task.add_done_callback(lambda _: self._forget(job_id))

    def _forget(self, job_id: str) -> None:
        self._tasks.pop(job_id, None)
        self.metrics.jobs_running_here.labels(self.metrics.replica).set(len(self._tasks))
        self._wake.set()  # a slot is free

    async def _run(self, job_id: str) -> None:
        try:
            job = await asyncio.to_thread(self.store.load_input, job_id)
            if job is not None:
                await JobRun(self, job).run()
        except asyncio.CancelledError:
            raise
        except StoreError as error:
            # Left unfinished: its lease runs out and it resumes from the last checkpoint.
            logger.warning("job %s interrupted: %s", job_id, error)
        except Exception as error:
            logger.exception("job %s failed unexpectedly", job_id)
            message = f"internal error: {type(error).__name__}"
            with contextlib.suppress(StoreError):
                await asyncio.to_thread(self.store.finish, job_id, self.owner, FAILED, message)


class JobRun:
    """One attempt at one job, from its stored input or checkpoint to its end."""

    def __init__(self, worker: JobWorker, job: JobInput) -> None:
        self.worker = worker
        self.store = worker.store
        self.owner = worker.owner
        self.job = job
        self.method = MethodConfig(**job.method)
        self.segments: Sequence[Segment] = ()  # the document's, once it is read

    async def run(self) -> None:
        job = self.job
        if job.text is None:
            read = await self._read_document()
            if read is None:
                return
            states, text = read
        else:
            states, text = job.chains, job.text
        prepared = await self.worker.preparer.prepare(job.job_id, text, job.questions, self.method)
        self.segments = prepared.segments
        indexes: dict[str, int] = {}
        chains = []
        for state in states:
            if state.status == "ok" and state.grounded is None:  # answered before an interruption
                await self._ground(state.chain_index, state.question, state.answer, state.memory)
            if state.done:
                continue
            chain = MemoryChain(
                state.chain_key,
                state.question,
                prepared.segments,
                self.method.chain(),
                memory=state.memory,
                start_step=min(state.step, len(prepared.segments)),
            )
            indexes[chain.chain_id] = state.chain_index
            chains.append(chain)
        engine = WatchedEngine(self.worker.engine)
        runner = ChainRunner(engine, self.method.sampling())

        async def checkpoint(chain: MemoryChain, record: StepRecord) -> None:
            await self._checkpoint(indexes[chain.chain_id], chain, record)

        results = await runner.run(chains, checkpoint)
        if engine.unavailable is not None:
            # Not the job's fault: keep it unfinished. Its lease runs out and a replica (this
            # one, or another once the engine is back) resumes it from the last checkpoint.
            logger.warning("job %s interrupted: %s", job.job_id, engine.unavailable)
            return
        errors = []
        for result in results:
            self.worker.metrics.observe_answer("job", result.status)
            if result.status != "ok":
                errors.append(f"{result.question!r}: {result.error}")
                await asyncio.to_thread(
                    self.store.fail_chain,
                    job.job_id,
                    self.owner,
                    indexes[result.chain_id],
                    result.error or "failed",
                )
        earlier_errors = [f"{s.question!r}: {s.error}" for s in states if s.status == "error"]
        errors = earlier_errors + errors
        status, error = (FAILED, "; ".join(errors)) if errors else (SUCCEEDED, None)
        await asyncio.to_thread(self.store.finish, job.job_id, self.owner, status, error)

    async def _read_document(self) -> tuple[tuple[ChainState, ...], str] | None:
        """Fetches and parses the input and plans the chains: (chains, text), or None when the
        job ended here."""
        job = self.job
        request = DocumentRequest(
            job.name, job.questions, data=job.data, uri=job.uri, mime_type=job.mime_type
        )
        started = time.perf_counter()
        try:
            loaded = await self.worker.loader.load(request)
        except InputError as error:
            await asyncio.to_thread(
                self.store.finish, job.job_id, self.owner, FAILED, error.message
            )
            return None
        self.worker.metrics.input_bytes.labels(self.worker.metrics.replica).inc(loaded.size)
        prepared = await self.worker.preparer.prepare(
            job.job_id, loaded.parsed.text, job.questions, self.method
        )
        info = document_info(loaded, prepared).model_dump()
        info["read_s"] = round(time.perf_counter() - started, 3)
        saved = await asyncio.to_thread(
            self.store.save_document,
            job.job_id,
            self.owner,
            loaded.parsed.text,
            info,
            job.questions,
        )
        if not saved:
            return None
        planned = await asyncio.to_thread(self.store.load_input, job.job_id)
        if planned is None:
            return None
        return planned.chains, loaded.parsed.text

    async def _ground(
        self, index: int, question: str, answer: str | None, memory: str | None
    ) -> None:
        """Finds an answer's evidence and records it; a failure costs the evidence only."""
        try:
            grounding = await asyncio.to_thread(
                find_evidence, question, answer, memory or "", self.segments
            )
            await asyncio.to_thread(
                self.store.record_grounding, self.job.job_id, self.owner, index, grounding
            )
        except Exception:
            logger.exception("cannot find the evidence of job %s chain %d", self.job.job_id, index)

    async def _checkpoint(self, index: int, chain: MemoryChain, record: StepRecord) -> None:
        self.worker.metrics.observe_step(record)
        step = StepCheckpoint.after(chain, record)
        if not await asyncio.to_thread(
            self.store.checkpoint, self.job.job_id, self.owner, index, step
        ):
            # The lease is gone (cancelled, or taken over): stop every chain of this job.
            self.worker.cancel_local(self.job.job_id)
            raise asyncio.CancelledError
        if chain.done:
            await self._ground(index, chain.question, chain.answer, chain.memory)


class WatchedEngine:
    """Passes calls through and remembers whether the engine deployment was unavailable."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self.model = engine.model
        self.unavailable: EngineUnavailable | None = None

    async def generate(self, request: GenerationRequest) -> Completion:
        try:
            return await self.engine.generate(request)
        except EngineUnavailable as error:
            self.unavailable = error
            raise

    async def check_health(self) -> None:
        await self.engine.check_health()

    async def shutdown(self) -> None:
        await self.engine.shutdown()
