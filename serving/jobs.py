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
from dataclasses import replace

from connectors.state.database import StateStoreError
from connectors.state.records import ChainState, Checkpoint, JobInput, StepCheckpoint
from connectors.state.schema import FAILED, SUCCEEDED
from connectors.state.store import StateStore
from operators.config import MethodConfig, TemplateChanged
from operators.core.chain import ChainStatus
from operators.core.document import Document
from operators.core.evidence import Grounding
from operators.engine import Completion, Engine, GenerationRequest
from operators.runner import ChainRunner
from pipeline.resume import ChainWork, resume_chain
from serving.answering import DocumentPreparer, document_info
from serving.config import JobsConfig
from serving.documents import DocumentLoader, DocumentRequest, InputError
from serving.engine import EngineUnavailable
from serving.metrics import ServingMetrics

logger = logging.getLogger("ray.serve")
STORE_RETRY_S = 2.0


class JobWorker:
    def __init__(
        self,
        store: StateStore,
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
            await asyncio.to_thread(self.store.release_jobs, self.owner, list(tasks))
        except StateStoreError:
            logger.warning(
                "could not release %d job lease(s); they expire by themselves", len(tasks)
            )

    async def _claim_forever(self) -> None:
        renewed_at = time.monotonic()
        while True:
            try:
                free = self.config.max_running_per_replica - len(self._tasks)
                for job_id in await asyncio.to_thread(
                    self.store.claim_jobs, self.owner, self.config.lease_s, free
                ):
                    self._start(job_id)
                if time.monotonic() - renewed_at >= self.config.lease_s / 3:
                    await self._renew()
                    renewed_at = time.monotonic()
            except StateStoreError as error:
                logger.warning("job store unavailable: %s", error)
                await asyncio.sleep(STORE_RETRY_S)
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._wake.wait(), self.config.poll_interval_s)
            self._wake.clear()

    async def _renew(self) -> None:
        local = list(self._tasks)
        held = await asyncio.to_thread(
            self.store.renew_leases, self.owner, local, self.config.lease_s
        )
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
            job = await asyncio.to_thread(self.store.load_job_input, job_id)
            if job is not None:
                await JobRun(self, job).run()
        except asyncio.CancelledError:
            raise
        except StateStoreError as error:
            # Left unfinished: its lease runs out and it resumes from the last checkpoint.
            logger.warning("job %s interrupted: %s", job_id, error)
        except TemplateChanged as error:  # this server's prompts are not the job's
            await self._fail(job_id, str(error))
        except Exception as error:
            logger.exception("job %s failed unexpectedly", job_id)
            await self._fail(job_id, f"internal error: {type(error).__name__}")

    async def _fail(self, job_id: str, message: str) -> None:
        with contextlib.suppress(StateStoreError):
            await asyncio.to_thread(self.store.finish_job, job_id, self.owner, FAILED, message)


class JobRun:
    """One attempt at one job, from its stored input or checkpoint to its end."""

    def __init__(self, worker: JobWorker, job: JobInput) -> None:
        self.worker = worker
        self.store = worker.store
        self.owner = worker.owner
        self.job = job
        self.method = MethodConfig.from_identity(job.method)

    async def run(self) -> None:
        job = self.job
        if job.text is None:
            read = await self._read_document()
            if read is None:
                return
            states, text = read
        else:
            states, text = job.chains, job.text
        try:
            prepared = await self.worker.preparer.prepare(
                Document(uri=job.job_id, name=job.name, text=text), job.questions, self.method
            )
        except InputError as error:
            await asyncio.to_thread(
                self.store.finish_job, job.job_id, self.owner, FAILED, error.message
            )
            return
        engine = WatchedEngine(self.worker.engine)
        runner = ChainRunner(engine, self.method.sampling())
        checkpoints = JobCheckpoints(self.store, job.job_id, self.owner, states, engine)

        async def the_runner() -> ChainRunner:
            return runner

        to_run = [state for state in states if state.status != ChainStatus.FAILED]  # final
        outcomes = await asyncio.gather(
            *(
                resume_chain(
                    ChainWork(state.chain_key, state.question, prepared.segments),
                    the_runner,
                    self.method.chain(),
                    checkpoints,
                    on_step=self.worker.metrics.observe_step,
                )
                for state in to_run
            )
        )
        if any(outcome.status == ChainStatus.STOPPED for outcome in outcomes):
            return  # the lease is gone (cancelled, or taken over): the job is not ours to end
        if engine.unavailable is not None:
            # Not the job's fault: keep it unfinished. Its lease runs out and a replica (this
            # one, or another once the engine is back) resumes it from the last checkpoint.
            logger.warning("job %s interrupted: %s", job.job_id, engine.unavailable)
            return
        errors = [f"{s.question!r}: {s.error}" for s in states if s.status == ChainStatus.FAILED]
        for state, outcome in zip(to_run, outcomes, strict=True):
            if outcome.result is not None:
                self.worker.metrics.observe_answer("job", outcome.result.status.answer_status)
            if outcome.status == ChainStatus.FAILED:
                errors.append(f"{state.question!r}: {outcome.error}")
        status, error = (FAILED, "; ".join(errors)) if errors else (SUCCEEDED, None)
        await asyncio.to_thread(self.store.finish_job, job.job_id, self.owner, status, error)

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
            # named after the job, as when it resumes from its stored text
            prepared = await self.worker.preparer.prepare(
                replace(loaded, uri=job.job_id), job.questions, self.method
            )
        except InputError as error:
            await asyncio.to_thread(
                self.store.finish_job, job.job_id, self.owner, FAILED, error.message
            )
            return None
        self.worker.metrics.input_bytes.labels(self.worker.metrics.replica).inc(loaded.size)
        info = document_info(loaded, prepared).model_dump()
        info["read_s"] = round(time.perf_counter() - started, 3)
        saved = await asyncio.to_thread(
            self.store.save_job_document,
            job.job_id,
            self.owner,
            loaded.text,
            info,
            job.questions,
        )
        if not saved:
            return None
        planned = await asyncio.to_thread(self.store.load_job_input, job.job_id)
        if planned is None:
            return None
        return planned.chains, loaded.text


class JobCheckpoints:
    """A job's chains as `pipeline.resume` reads and writes them: every write needs the job's
    lease, a step also records its event, and a chain the engine deployment dropped is left
    unfinished for a later resume rather than failed."""

    def __init__(
        self,
        store: StateStore,
        job_id: str,
        owner: str,
        states: Sequence[ChainState],
        engine: WatchedEngine,
    ) -> None:
        self.store = store
        self.job_id = job_id
        self.owner = owner
        self.index = {state.chain_key: state.chain_index for state in states}
        self.engine = engine

    def load_checkpoint(self, chain_key: str) -> Checkpoint | None:
        return self.store.load_checkpoint(chain_key)

    def mark_running(self, chain_key: str) -> bool:
        return self.store.holds_lease(self.owner, self.job_id)

    def record_step(self, checkpoint: StepCheckpoint) -> bool:
        index = self.index[checkpoint.chain_key]
        return self.store.record_job_step(self.job_id, self.owner, index, checkpoint)

    def record_grounding(self, chain_key: str, grounding: Grounding) -> bool:
        index = self.index[chain_key]
        return self.store.record_job_grounding(self.job_id, self.owner, index, grounding)

    def mark_failed(self, chain_key: str, error: str) -> bool:
        if self.engine.unavailable is not None:
            return True
        return self.store.fail_job_chain(self.job_id, self.owner, self.index[chain_key], error)


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
