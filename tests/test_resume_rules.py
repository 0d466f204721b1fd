"""The resume rules, fast: the corpus job's stages and a Serve job's run on the fake engine
(connectors/engines/fake.py) and a SQLite state store, without vLLM and without Ray.

The rules: a chain stopped after step k resumes at step k with the memory checkpointed there,
and its trajectory ends with one `steps` row per step (no gap, no duplicate, the early rows
untouched); an answered chain is not run again; in the corpus job a failed chain is retried on
the next attempt. A Serve job resumes the same way on whichever replica takes it up, and a
replica that lost a job's lease writes nothing more for it.
"""

from __future__ import annotations

import asyncio
import atexit
import hashlib
from collections.abc import Iterator
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa

from connectors.engines.factory import EngineSpec
from connectors.engines.fake import EngineCrash, FactEngine, WordTokenizer, tagged
from connectors.state.jobs import job_chain_key
from connectors.state.records import Checkpoint, NewJob
from connectors.state.schema import groundings, steps
from connectors.state.store import StateStore
from operators.config import MethodConfig
from operators.core.chain import ChainStatus
from operators.core.document import Document, documents_table
from operators.core.templates import INITIAL_MEMORY, TEMPLATE_SETS, get_template_set
from operators.engine import GenerationRequest
from pipeline.stages.memory import MemoryStage
from pipeline.stages.read import ReadParseStage
from pipeline.stages.run import Question, RunContext
from pipeline.stages.segment import SegmentStage
from serving.answering import DocumentPreparer
from serving.config import JobsConfig, ServingConfig
from serving.documents import DocumentLoader
from serving.engine import EngineUnavailable
from serving.jobs import JobRun, JobWorker
from serving.metrics import ServingMetrics
from serving.uris import DocumentFetcher, UriPolicy

QUESTION = "Which facts does the record hold?"
OTHER_QUESTION = "What does the record say?"
FACTS = ("fact-amber", "fact-birch", "fact-cedar", "fact-dune")
# One line of eight words per fact, and segments of eight words: segment i reads fact i.
LINES = tuple(f"Part {i} of the record says {fact} plainly." for i, fact in enumerate(FACTS))
RECORD = "\n".join(LINES)
METHOD = MethodConfig(chunk_size=8, max_memory_tokens=64, max_answer_tokens=32)
N_STEPS = len(FACTS) + 1  # an update per segment, then the answer
ANSWER = ", ".join(FACTS)
RUN_ID = "run-resume"


def memory_after(updates: int) -> str | None:
    """The checkpointed memory once `updates` update steps are done (None before the first)."""
    return "\n".join(LINES[:updates]) if updates else None


ANSWERED = Checkpoint(
    ChainStatus.DONE, N_STEPS, memory_after(len(FACTS)), ANSWER, has_evidence=True
)


def prompt_memory(request: GenerationRequest) -> str | None:
    return tagged(request.prompt, "memory")


def crash_on(call: int) -> FactEngine:
    return FactEngine(fail_on_call=call, failure=EngineCrash(f"killed in call {call}"))


def unavailable_in(request_id: str) -> FactEngine:
    """An engine whose deployment goes away in the call of `request_id` (Serve's engine)."""

    def go_away(request: GenerationRequest, call: int) -> None:
        if request.request_id == request_id:
            raise EngineUnavailable("the engine replica is restarting")

    return FactEngine(before_reply=go_away)


def steps_written(url: str) -> dict[tuple[str, int], float]:
    """When each `steps` row was written, by (chain key, step)."""
    engine = sa.create_engine(url)
    with engine.connect() as connection:
        rows = connection.execute(sa.select(steps.c.chain_key, steps.c.step, steps.c.created_at))
        written = {(key, step): created_at for key, step, created_at in rows}
    engine.dispose()
    return written


def assert_one_row_per_step(
    url: str, keys: list[str], before: dict[tuple[str, int], float]
) -> None:
    """Each chain has steps 0..N_STEPS-1 once, and the rows written before are untouched."""
    after = steps_written(url)
    assert sorted(after) == sorted((key, step) for key in keys for step in range(N_STEPS))
    assert {row: after[row] for row in before} == before


# --- the corpus job: read, segment and memory stages, as Ray Data calls them -----------------


# The record as a source lists it: a document that carries its text, as SQL and dataset rows do.
RECORD_DOCUMENT = Document(uri="file:///records/facts.txt", name="facts.txt", text=RECORD)


@dataclass
class CorpusRun:
    """Attempts of one run over one document. Each attempt begins in the store as the job
    does, then calls the job's three stages in turn on Arrow tables; the memory stage's engine
    is the one the attempt brings."""

    store_url: str
    questions: tuple[Question, ...] = (Question("q0", QUESTION),)
    method: MethodConfig = METHOD
    engines_opened: list[FactEngine] = field(default_factory=list)
    tokenizer: WordTokenizer = field(default_factory=WordTokenizer)
    _engine: FactEngine | None = None

    def __post_init__(self) -> None:
        self.store = StateStore(self.store_url)

    def chain_key(self, question: str) -> str:
        return self._context(1).chain_key(hashlib.sha256(RECORD.encode()).hexdigest(), question)

    def attempt(
        self, engine: FactEngine, *, max_active_chains: int = 8, longest_first: bool = True
    ) -> list[dict[str, Any]]:
        """The memory stage's result rows; raises what the engine raised if it crashed."""
        context = self._context(self.store.begin_run(RUN_ID, {"test": "resume"}).attempt)
        documents = ReadParseStage([], context)(documents_table([RECORD_DOCUMENT]))
        plans = SegmentStage(context, tokenizer_factory=lambda spec: self.tokenizer)(documents)
        self._engine = engine
        memory = MemoryStage(
            context, max_active_chains, longest_first, engine_factory=self.open_engine
        )
        try:
            return asyncio.run(memory(plans)).to_pylist()
        finally:
            memory.close()
            atexit.unregister(memory.close)

    def open_engine(self, spec: EngineSpec) -> FactEngine:
        assert self._engine is not None
        self.engines_opened.append(self._engine)
        return self._engine

    def _context(self, attempt: int) -> RunContext:
        spec = EngineSpec(model="fake-model", dtype="float32")
        return RunContext(RUN_ID, attempt, self.store_url, spec, self.method, self.questions)


@pytest.fixture
def corpus(tmp_path: Path) -> Iterator[CorpusRun]:
    from pipeline.stages import run as run_module

    run = CorpusRun(f"sqlite:///{tmp_path / 'state.sqlite'}")
    run.store.migrate()
    yield run
    run.store.close()
    run_module.open_store(run.store_url).close()


@pytest.mark.parametrize("crash_on_call", range(1, N_STEPS + 1))
def test_a_chain_killed_in_step_k_resumes_at_step_k_with_the_memory_checkpointed_there(
    corpus: CorpusRun, crash_on_call: int
) -> None:
    done = crash_on_call - 1  # the steps written before the kill
    key = corpus.chain_key(QUESTION)
    with pytest.raises(EngineCrash):
        corpus.attempt(crash_on(crash_on_call))
    assert corpus.store.load_checkpoint(key) == Checkpoint(
        ChainStatus.RUNNING, done, memory_after(done)
    )
    before = steps_written(corpus.store_url)
    assert sorted(before) == [(key, step) for step in range(done)]

    engine = FactEngine()
    (result,) = corpus.attempt(engine)
    assert (result["status"], result["start_step"], result["steps_run"]) == (
        "done",
        done,
        N_STEPS - done,
    )
    assert engine.request_ids == [f"{key}:{step}" for step in range(done, N_STEPS)]
    assert prompt_memory(engine.requests[0]) == (memory_after(done) or INITIAL_MEMORY)
    assert_one_row_per_step(corpus.store_url, [key], before)
    (answer,) = corpus.store.answers(RUN_ID, 2)
    assert (answer["status"], answer["answer"], answer["steps_done"]) == ("done", ANSWER, N_STEPS)


def test_an_answered_document_never_reaches_the_memory_stage_and_starts_no_engine(
    corpus: CorpusRun,
) -> None:
    key = corpus.chain_key(QUESTION)
    (first,) = corpus.attempt(FactEngine())
    assert first["status"] == "done"
    before = steps_written(corpus.store_url)

    rerun = FactEngine()
    assert corpus.attempt(rerun) == []  # planned for the attempt, passed no further
    assert rerun.requests == [] and rerun not in corpus.engines_opened
    assert steps_written(corpus.store_url) == before
    (answer,) = corpus.store.answers(RUN_ID, 2)
    assert (answer["chain_key"], answer["status"], answer["answer"]) == (key, "done", ANSWER)


def test_a_re_read_budget_over_an_answered_corpus_runs_only_the_answer_steps(
    corpus: CorpusRun,
) -> None:
    """Re-read changes only the answer step: the answered chain's updates are not run again;
    the new chain starts at its answer step from that chain's final memory."""
    answered_key = corpus.chain_key(QUESTION)
    corpus.attempt(FactEngine())
    corpus.method = replace(METHOD, reread_tokens=40)
    key = corpus.chain_key(QUESTION)
    assert key != answered_key

    engine = FactEngine()
    (result,) = corpus.attempt(engine)
    assert (result["status"], result["start_step"], result["steps_run"]) == (
        "done",
        N_STEPS - 1,
        1,
    )
    assert engine.request_ids == [f"{key}:{N_STEPS - 1}"]
    assert "<passages>" in engine.requests[0].prompt
    assert prompt_memory(engine.requests[0]) == memory_after(len(FACTS))
    (answer,) = corpus.store.answers(RUN_ID, 2)
    assert (answer["chain_key"], answer["answer"]) == (key, ANSWER)


def test_an_answered_chain_is_skipped_while_its_unfinished_sibling_resumes(
    corpus: CorpusRun,
) -> None:
    corpus.questions = (Question("q0", QUESTION), Question("q1", OTHER_QUESTION))
    keys = [corpus.chain_key(QUESTION), corpus.chain_key(OTHER_QUESTION)]
    # One chain at a time: the first runs to its answer, the second is killed in its 2nd call.
    with pytest.raises(EngineCrash):
        corpus.attempt(crash_on(N_STEPS + 2), max_active_chains=1, longest_first=False)
    checkpoints = {key: corpus.store.load_checkpoint(key) for key in keys}
    answered = next(key for key in keys if checkpoints[key] == ANSWERED)
    (unfinished,) = set(keys) - {answered}
    assert checkpoints[unfinished] == Checkpoint(ChainStatus.RUNNING, 1, memory_after(1))
    before = steps_written(corpus.store_url)

    engine = FactEngine()
    results = {row["chain_key"]: row for row in corpus.attempt(engine)}
    assert results[answered]["status"] == "skipped"
    assert (results[unfinished]["status"], results[unfinished]["start_step"]) == ("done", 1)
    assert engine.request_ids == [f"{unfinished}:{step}" for step in range(1, N_STEPS)]
    assert_one_row_per_step(corpus.store_url, keys, before)
    answers = list(corpus.store.answers(RUN_ID, 2))
    assert [(a["question_id"], a["status"], a["answer"]) for a in answers] == [
        ("q0", "done", ANSWER),
        ("q1", "done", ANSWER),
    ]
    (only,) = corpus.store.answers(RUN_ID, 2, chain_keys=[unfinished])
    assert only["chain_key"] == unfinished


def test_an_answer_whose_evidence_a_crash_cut_off_gets_it_on_the_rerun(corpus: CorpusRun) -> None:
    corpus.questions = (Question("q0", QUESTION), Question("q1", OTHER_QUESTION))
    keys = [corpus.chain_key(QUESTION), corpus.chain_key(OTHER_QUESTION)]
    with pytest.raises(EngineCrash):
        corpus.attempt(crash_on(N_STEPS + 2), max_active_chains=1, longest_first=False)
    answered = next(key for key in keys if corpus.store.load_checkpoint(key) == ANSWERED)
    with sa.create_engine(corpus.store_url).begin() as connection:  # as if killed just before
        connection.execute(sa.delete(groundings).where(groundings.c.chain_key == answered))
    assert corpus.store.load_checkpoint(answered) == replace(ANSWERED, has_evidence=False)

    results = {row["chain_key"]: row for row in corpus.attempt(FactEngine())}
    assert results[answered]["status"] == "skipped"
    assert corpus.store.load_checkpoint(answered) == ANSWERED
    answers = {a["chain_key"]: a for a in corpus.store.answers(RUN_ID, 2)}
    assert answers[answered]["grounding_reason"] and answers[answered]["grounded"] is not None


def test_a_failed_chain_is_retried_from_its_checkpoint_on_the_next_attempt(
    corpus: CorpusRun,
) -> None:
    key = corpus.chain_key(QUESTION)
    (failed,) = corpus.attempt(FactEngine(fail_on_call=3))
    assert failed["status"] == "failed" and failed["error"].startswith("EngineError: ")
    assert corpus.store.load_checkpoint(key) == Checkpoint(ChainStatus.FAILED, 2, memory_after(2))
    (answer,) = corpus.store.answers(RUN_ID, 1)
    assert answer["status"] == "failed" and answer["error"].startswith("EngineError: ")
    before = steps_written(corpus.store_url)

    engine = FactEngine()
    (retried,) = corpus.attempt(engine)
    assert (retried["status"], retried["start_step"], retried["error"]) == ("done", 2, None)
    assert engine.request_ids == [f"{key}:{step}" for step in range(2, N_STEPS)]
    assert prompt_memory(engine.requests[0]) == memory_after(2)
    assert_one_row_per_step(corpus.store_url, [key], before)
    (answer,) = corpus.store.answers(RUN_ID, 2)
    assert (answer["status"], answer["answer"], answer["error"]) == ("done", ANSWER, None)


# --- Serve jobs: JobRun on a replica's job worker, with a StateStore ----------------------------


@dataclass
class Replica:
    """An API replica's job machinery (as serving.app.ApiServer builds it) on a fake engine."""

    store: StateStore
    engine: FactEngine

    def __post_init__(self) -> None:
        policy = UriPolicy(ServingConfig().uris)
        loader = DocumentLoader(DocumentFetcher(policy, max_bytes=1 << 20))
        metrics = ServingMetrics("replica", self.store.count_jobs_by_status)
        preparer = DocumentPreparer(WordTokenizer(), 16384)
        self.worker = JobWorker(self.store, loader, preparer, self.engine, JobsConfig(), metrics)

    @property
    def owner(self) -> str:
        return self.worker.owner

    def claim(self, lease_s: float = 30) -> list[str]:
        return self.store.claim_jobs(self.owner, lease_s, 10)

    def run(self, job_id: str) -> None:
        job = self.store.load_job_input(job_id)
        assert job is not None
        asyncio.run(JobRun(self.worker, job).run())


@pytest.fixture
def jobs_url(tmp_path: Path) -> str:
    return f"sqlite:///{tmp_path / 'jobs.sqlite'}"


@pytest.fixture
def job_store(jobs_url: str) -> Iterator[StateStore]:
    store = StateStore(jobs_url)
    store.migrate()
    yield store
    store.close()


def new_job(store: StateStore, *questions: str) -> str:
    method = METHOD.identity()  # as serving.app.ApiServer records it
    job = NewJob("facts.txt", "upload:facts.txt", questions, method, data=RECORD.encode())
    return store.create_job(job)


def memory_events(store: StateStore, job_id: str) -> list[tuple[int, int]]:
    """(question index, step) of each `memory` event, in order."""
    events = store.events_after(job_id, 0)
    return [(e.data["question_index"], e.data["step"]) for e in events if e.kind == "memory"]


def end_events(store: StateStore, job_id: str) -> list[str]:
    return [e.data["status"] for e in store.events_after(job_id, 0) if e.kind == "end"]


@pytest.mark.parametrize("crash_on_call", range(1, N_STEPS + 1))
def test_a_job_whose_replica_died_in_step_k_resumes_there_on_another_replica(
    job_store: StateStore, jobs_url: str, crash_on_call: int
) -> None:
    done = crash_on_call - 1
    job_id = new_job(job_store, QUESTION)
    key = job_chain_key(job_id, 0)
    dying = Replica(job_store, crash_on(crash_on_call))
    assert dying.claim(lease_s=-1) == [job_id]  # a lease already run out: the replica is gone
    with pytest.raises(EngineCrash):
        dying.run(job_id)
    stopped = job_store.get_job(job_id)
    assert stopped is not None and stopped.status == "running"
    assert [(c.step, c.memory, c.status) for c in stopped.chains] == [
        (done, memory_after(done), ChainStatus.RUNNING if done else ChainStatus.PENDING)
    ]
    assert stopped.chains[0].answer_record()["status"] == "pending"  # as the API shows it
    before = steps_written(jobs_url)

    other = Replica(job_store, FactEngine())
    assert other.claim() == [job_id]
    other.run(job_id)
    assert other.engine.request_ids == [f"{key}:{step}" for step in range(done, N_STEPS)]
    assert prompt_memory(other.engine.requests[0]) == (memory_after(done) or INITIAL_MEMORY)
    job = job_store.get_job(job_id)
    assert job is not None and job.status == "succeeded"
    assert [chain.answer for chain in job.chains] == [ANSWER]
    assert_one_row_per_step(jobs_url, [key], before)
    assert memory_events(job_store, job_id) == [(0, step) for step in range(N_STEPS - 1)]
    assert end_events(job_store, job_id) == ["succeeded"]


@pytest.mark.parametrize("lost_to", ["another replica", "the client cancelling"])
def test_a_replica_that_lost_the_lease_writes_nothing_more(
    job_store: StateStore, jobs_url: str, lost_to: str
) -> None:
    job_id = new_job(job_store, QUESTION)
    key = job_chain_key(job_id, 0)
    other = Replica(job_store, FactEngine())

    def lose_the_lease(request: GenerationRequest, call: int) -> None:
        if call == 3:  # steps 0 and 1 are checkpointed; step 2 is under way
            if lost_to == "another replica":
                assert other.claim() == [job_id]
            else:
                assert job_store.cancel_job(job_id)

    stalled = Replica(job_store, FactEngine(before_reply=lose_the_lease))
    assert stalled.claim(lease_s=-1) == [job_id]  # it stalled past its lease
    stalled.run(job_id)  # returns without ending the job: it is no longer this replica's
    assert stalled.engine.request_ids == [f"{key}:{step}" for step in range(3)]
    before = steps_written(jobs_url)
    assert sorted(before) == [(key, 0), (key, 1)]  # step 2's reply came too late to be written
    assert memory_events(job_store, job_id) == [(0, 0), (0, 1)]

    if lost_to == "another replica":
        other.run(job_id)
        assert other.engine.request_ids == [f"{key}:{step}" for step in range(2, N_STEPS)]
        assert_one_row_per_step(jobs_url, [key], before)
        assert memory_events(job_store, job_id) == [(0, step) for step in range(N_STEPS - 1)]
        assert end_events(job_store, job_id) == ["succeeded"]
    else:
        assert other.claim() == []  # a cancelled job is not taken up again
        assert steps_written(jobs_url) == before
        assert end_events(job_store, job_id) == ["cancelled"]


def test_an_unavailable_engine_leaves_the_job_to_resume_and_answered_chains_are_not_rerun(
    job_store: StateStore, jobs_url: str
) -> None:
    job_id = new_job(job_store, QUESTION, OTHER_QUESTION)
    keys = [job_chain_key(job_id, 0), job_chain_key(job_id, 1)]
    last_call = f"{keys[1]}:{N_STEPS - 1}"  # the second chain's answer
    first = Replica(job_store, unavailable_in(last_call))
    assert first.claim(lease_s=-1) == [job_id]
    first.run(job_id)
    job = job_store.get_job(job_id)
    assert job is not None and job.status == "running"  # not finished: not the job's fault
    assert [(c.status, c.step) for c in job.chains] == [
        (ChainStatus.DONE, N_STEPS),
        (ChainStatus.RUNNING, N_STEPS - 1),
    ]
    before = steps_written(jobs_url)

    second = Replica(job_store, FactEngine())
    assert second.claim() == [job_id]
    second.run(job_id)
    assert second.engine.request_ids == [last_call]
    assert prompt_memory(second.engine.requests[0]) == memory_after(len(FACTS))
    job = job_store.get_job(job_id)
    assert job is not None and job.status == "succeeded"
    assert [(c.status, c.answer) for c in job.chains] == [
        (ChainStatus.DONE, ANSWER),
        (ChainStatus.DONE, ANSWER),
    ]
    assert_one_row_per_step(jobs_url, keys, before)
    assert end_events(job_store, job_id) == ["succeeded"]


def test_a_chain_that_fails_by_itself_fails_its_job_for_good(
    job_store: StateStore, jobs_url: str
) -> None:
    job_id = new_job(job_store, QUESTION)
    replica = Replica(job_store, FactEngine(fail_on_call=3))
    assert replica.claim() == [job_id]
    replica.run(job_id)
    job = job_store.get_job(job_id)
    assert job is not None and job.status == "failed" and job.finished
    assert job.error is not None and "EngineError" in job.error
    assert [(c.status, c.step) for c in job.chains] == [(ChainStatus.FAILED, 2)]
    assert job.chains[0].answer_record()["status"] == "error"  # as the API shows it
    assert Replica(job_store, FactEngine()).claim(lease_s=-1) == []
    assert sorted(steps_written(jobs_url)) == [
        (job_chain_key(job_id, 0), 0),
        (job_chain_key(job_id, 0), 1),
    ]
    assert end_events(job_store, job_id) == ["failed"]


def test_a_job_begun_under_other_prompts_fails_saying_so_and_runs_no_further_step(
    job_store: StateStore, jobs_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    job_id = new_job(job_store, QUESTION)
    dying = Replica(job_store, crash_on(2))
    assert dying.claim(lease_s=-1) == [job_id]
    with pytest.raises(EngineCrash):
        dying.run(job_id)
    before = steps_written(jobs_url)
    templates = get_template_set(METHOD.template)
    reworded = replace(templates, update=templates.update.replace("Please", "Kindly"))
    assert reworded.digest != templates.digest
    monkeypatch.setitem(TEMPLATE_SETS, METHOD.template, reworded)  # the server was upgraded

    upgraded = Replica(job_store, FactEngine())
    assert upgraded.claim() == [job_id]
    asyncio.run(upgraded.worker._run(job_id))
    job = job_store.get_job(job_id)
    assert job is not None and job.status == "failed" and job.finished
    assert job.error is not None
    assert f"{templates.digest}" in job.error and "submit it again" in job.error
    assert upgraded.engine.request_ids == []
    assert steps_written(jobs_url) == before
    assert end_events(job_store, job_id) == ["failed"]


def test_an_answer_given_before_an_interruption_keeps_its_evidence(job_store: StateStore) -> None:
    job_id = new_job(job_store, QUESTION, OTHER_QUESTION)
    first = Replica(job_store, unavailable_in(f"{job_chain_key(job_id, 1)}:{N_STEPS - 1}"))
    assert first.claim(lease_s=-1) == [job_id]
    first.run(job_id)
    second = Replica(job_store, FactEngine())
    assert second.claim() == [job_id]
    second.run(job_id)
    job = job_store.get_job(job_id)
    assert job is not None and job.status == "succeeded"
    assert [chain.grounding_reason is not None for chain in job.chains] == [True, True]
