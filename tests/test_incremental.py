"""Incremental runs, on real parts: the state store on SQLite and PostgreSQL, and `run_job` with
real Ray Data, real files and the real Parquet export. The engine is an OpenAI-compatible HTTP
server in this process that replies as connectors/engines/fake.py's `FactEngine` does (no model), so
what reached the engine is known: each document's lines hold facts named after it.

The rules: every run has its own run id; a run after a crash resumes the unfinished run; a run
computes only new and changed documents and carries the other answers forward
(`answered_in_run`); the previous run's rows of a changed or removed document name the run that
superseded them, and its tables stay as they were; the summary counts new, changed, unchanged and
removed documents; two runs over one archive never overlap.
"""

from __future__ import annotations

import json
import os
import signal
import sqlite3
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import pandas as pd
import pytest
import sqlalchemy as sa
import yaml

from connectors.engines.factory import EngineSpec
from connectors.engines.fake import FACT
from connectors.state import locks
from connectors.state.records import DocumentChanges, DocumentRecord, ErrorRecord
from connectors.state.schema import run_chains, runs
from connectors.state.store import StateStore
from operators.core.document import PlannedChain
from operators.core.templates import TEMPLATE_SETS, get_template_set
from pipeline.job import JobSpec, run_job
from pipeline.job.plan import derive_archive_key
from pipeline.stages.run import RunContext
from tests.chat_server import FactChatServer
from tests.conftest import TEST_MODEL
from tests.services import schema_of_its_own
from tests.test_job import assert_complete_trajectories, kill_processes_marked

QUESTION = "Which facts does the record hold?"
# Segments of two dozen tokens that end at a space, so no fact is cut in two.
METHOD = {
    "template": "memagent-reference",
    "chunk_size": 24,
    "snap_window": 10,
    "max_memory_tokens": 64,
    "max_answer_tokens": 32,
}


# --- the store: which run an invocation works on, and what it supersedes --------------------


def begin(store: StateStore, job_key: str = "run-job", archive_key: str = "archive-a") -> Any:
    return store.begin_run(None, {}, job_key=job_key, archive_key=archive_key)


def test_each_run_has_its_own_id_and_only_an_unfinished_run_of_the_same_job_resumes(
    migrated_store: StateStore,
) -> None:
    store = migrated_store
    first = begin(store)
    assert (first.run_id, first.attempt, first.previous_run_id) == ("run-job-1", 1, None)
    store.finish_run(first.run_id, "failed")
    assert begin(store) == replace(first, attempt=2)  # the failed run resumes
    assert begin(store) == replace(first, attempt=3)  # killed while "running": resumes too
    store.finish_run(first.run_id, "done")
    second = begin(store)
    assert (second.run_id, second.attempt, second.previous_run_id) == ("run-job-2", 1, "run-job-1")
    store.finish_run(second.run_id, "done_with_errors")
    # another job over the same archive (another model, say): compared with the same archive's
    # last finished run; its unfinished run is abandoned when the first job runs again
    other = begin(store, job_key="run-other")
    assert (other.run_id, other.previous_run_id) == ("run-other-1", "run-job-2")
    third = begin(store)
    assert (third.run_id, third.previous_run_id) == ("run-job-3", "run-job-2")
    with store.reader.connect() as connection:
        status = connection.execute(sa.select(runs.c.status).where(runs.c.run_id == "run-other-1"))
        assert status.scalar_one() == "abandoned"
    # another archive has runs of its own; a named run is that run, attempt after attempt
    assert begin(store, archive_key="archive-b").previous_run_id is None
    named = store.begin_run("nightly-2026-12-02", {}, job_key="run-job", archive_key="archive-a")
    assert (named.attempt, named.previous_run_id) == (1, "run-job-2")
    assert store.begin_run("nightly-2026-12-02", {}).attempt == 2


def plan(store: StateStore, run_id: str, uri: str, content: str, *chains: tuple[str, str]) -> None:
    """Records a document of the run's first attempt, with chains (question id, chain key)."""
    record = DocumentRecord(run_id, 1, uri, f"id-{uri}", uri, content, "text", None, [], {}, 9, 1)
    store.plan_document(record, [PlannedChain(key, qid, f"{qid}?") for qid, key in chains])


def test_a_run_supersedes_the_changed_removed_and_answered_anew_rows_of_the_previous(
    migrated_store: StateStore,
) -> None:
    store = migrated_store
    first = begin(store)
    plan(store, first.run_id, "file:///same", "sha-same", ("q0", "same-0"), ("q1", "same-1"))
    plan(store, first.run_id, "file:///edited", "sha-old", ("q0", "edited-old"))
    plan(store, first.run_id, "file:///gone", "sha-gone", ("q0", "gone"))
    plan(store, first.run_id, "file:///broken-now", "sha-b", ("q0", "broken"))
    store.finish_run(first.run_id, "done")
    assert store.supersede_previous(first.run_id, 1) == DocumentChanges(new=4)

    second = begin(store)
    # q1 of the same document is asked in other words: another chain
    plan(store, second.run_id, "file:///same", "sha-same", ("q0", "same-0"), ("q1", "same-1b"))
    plan(store, second.run_id, "file:///edited", "sha-new", ("q0", "edited-new"))
    plan(store, second.run_id, "file:///added", "sha-added", ("q0", "added"))
    store.record_error(ErrorRecord(second.run_id, 1, "file:///broken-now", "parse", "E", "bad"))
    changes = store.supersede_previous(second.run_id, 1)
    assert changes == DocumentChanges(first.run_id, new=1, changed=1, unchanged=1, removed=1)
    assert store.supersede_previous(second.run_id, 1) == changes  # idempotent

    rows = store.superseded(second.run_id, 1)
    superseded = {(row["source_uri"], row["question_id"]): row for row in rows}
    assert {key: row["change"] for key, row in superseded.items()} == {
        ("file:///edited", "q0"): "changed",
        ("file:///gone", "q0"): "removed",
        ("file:///same", "q1"): "answered anew",
    }  # a document that cannot be read now is not superseded: nothing replaced its answers
    assert {row["run_id"] for row in superseded.values()} == {first.run_id}
    assert {row["superseded_by"] for row in superseded.values()} == {second.run_id}
    with store.reader.connect() as connection:
        marked = connection.execute(
            sa.select(run_chains.c.run_id, run_chains.c.source_uri, run_chains.c.superseded_by)
        ).all()
    assert {(uri, by) for run, uri, by in marked if run == second.run_id} == {
        ("file:///same", None), ("file:///edited", None), ("file:///added", None),
    }  # fmt: skip


def test_model_template_and_question_are_each_part_of_a_chain_key() -> None:
    spec = EngineSpec(model="m", dtype="float32")
    run = RunContext("run", 1, "sqlite://", spec, JobSpec.from_dict(
        {"sources": ["a"], "output": "o", "method": METHOD}).method, ())  # fmt: skip
    key = run.chain_key("sha", QUESTION)
    assert run.chain_key("sha", QUESTION) == key
    assert run.chain_key("sha", "Another question?") != key
    assert run.chain_key("other-sha", QUESTION) != key
    assert replace(run, engine=replace(spec, model="m2")).chain_key("sha", QUESTION) != key
    segment_first = replace(run.method, template="segment-first")
    assert replace(run, method=segment_first).chain_key("sha", QUESTION) != key


def test_a_reworded_template_set_is_another_chain_key(monkeypatch: pytest.MonkeyPatch) -> None:
    spec = EngineSpec(model="m", dtype="float32")
    method = JobSpec.from_dict({"sources": ["a"], "output": "o", "method": METHOD}).method
    run = RunContext("run", 1, "sqlite://", spec, method, ())
    key = run.chain_key("sha", QUESTION)
    templates = get_template_set(method.template)
    reworded = replace(templates, final=templates.final.replace("Please", "Kindly"))
    monkeypatch.setitem(TEMPLATE_SETS, method.template, reworded)
    assert reworded.digest != templates.digest
    assert run.chain_key("sha", QUESTION) != key


# --- run_job, with real Ray and an HTTP engine that replies as FactEngine -----------------------


class FactServer(FactChatServer):
    """The fact chat server (tests/chat_server.py), and which documents it was sent."""

    def documents_read(self) -> set[str]:
        """The documents whose facts were in the sections sent since the last call."""
        prompts, self.prompts = self.prompts, []
        return {
            fact.removeprefix("fact-").rstrip("0123456789")
            for prompt in prompts
            for fact in FACT.findall(prompt.split("<section>")[-1] if "<section>" in prompt else "")
        }


@pytest.fixture(scope="module")
def fact_server() -> Iterator[FactServer]:
    with FactServer() as server:
        yield server


@pytest.fixture(scope="module")
def ray_session() -> Iterator[None]:
    import ray

    ray.init(num_cpus=2, include_dashboard=False, logging_level="WARNING")
    yield
    ray.shutdown()


def record(name: str, lines: int = 3, first: int = 0) -> str:
    """A record whose every line holds a fact named after it: fact-<name><i>."""
    return "".join(
        f"Line {i} of the {name} record says fact-{name}{i} plainly.\n"
        for i in range(first, first + lines)
    )


def facts_of(name: str, *numbers: int) -> set[str]:
    return {f"fact-{name}{i}" for i in numbers}


def nightly(
    folder: Path, output: Path, server: FactServer, state_store: str | None, **fields: Any
) -> dict[str, Any]:
    return {
        "sources": [str(folder)],
        "output": str(output),
        "questions": [QUESTION],
        "engine": {"kind": "openai", "base_url": server.base_url, "model": server.model,
                   "tokenizer": TEST_MODEL, "max_model_len": 4096},
        "method": METHOD,
        "state_store": state_store,
        "concurrency": {"read_tasks": 1},
        **fields,
    }  # fmt: skip


def tables(summary: Any) -> dict[str, pd.DataFrame]:
    return {
        name: pd.read_parquet(summary.outputs[name]).set_index("name", drop=False)
        for name in ("answers", "superseded")
    }


def answered_facts(answers: pd.DataFrame, name: str) -> set[str]:
    return set(FACT.findall(answers.loc[name, "answer"]))


@pytest.fixture
def state_store(request: pytest.FixtureRequest) -> str | None:
    """The job's state store: its default (SQLite beside the output), or PostgreSQL."""
    if request.param == "default":
        return None
    return schema_of_its_own(request.getfixturevalue("postgres_url"))


@pytest.mark.parametrize(
    "state_store", ["default", pytest.param("postgres", marks=pytest.mark.server)], indirect=True
)
def test_a_growing_archive_computes_only_new_and_changed_documents(
    ray_session: None,
    fact_server: FactServer,
    state_store: str | None,
    tmp_path: Path,
    caplog: pytest.LogCaptureFixture,
) -> None:
    archive, output = tmp_path / "archive", tmp_path / "out"
    archive.mkdir()
    for name in ("alpha", "bravo", "charlie"):
        (archive / f"{name}.txt").write_text(record(name))
    spec = JobSpec.from_dict(nightly(archive, output, fact_server, state_store))
    fact_server.documents_read()

    first = run_job(spec)
    assert first.ok and fact_server.documents_read() == {"alpha", "bravo", "charlie"}
    assert first.changes == DocumentChanges(new=3)
    assert first.run_id.endswith("-1") and first.attempt == 1
    before = tables(first)
    assert (before["answers"].answered_in_run == first.run_id).all()
    assert answered_facts(before["answers"], "bravo.txt") == facts_of("bravo", 0, 1, 2)
    assert before["superseded"].empty

    # the archive grows by a document, one changes (a line added), one goes
    (archive / "delta.txt").write_text(record("delta"))
    (archive / "bravo.txt").write_text(record("bravo", 4))
    (archive / "charlie.txt").unlink()
    second = run_job(spec)
    assert fact_server.documents_read() == {"bravo", "delta"}  # all that reached the engine
    assert (second.run_id, second.attempt) == (first.run_id[:-2] + "-2", 1)
    assert second.changes == DocumentChanges(first.run_id, new=1, changed=1, unchanged=1, removed=1)
    assert (second.documents, second.chains_done, second.chains_skipped) == (3, 3, 1)
    after = tables(second)
    answers = after["answers"]
    assert sorted(answers.name) == ["alpha.txt", "bravo.txt", "delta.txt"]
    assert (answers.run_id == second.run_id).all()
    assert answers.answered_in_run.to_dict() == {
        "alpha.txt": first.run_id, "bravo.txt": second.run_id, "delta.txt": second.run_id,
    }  # fmt: skip
    carried = answers.loc["alpha.txt", "raw_response"]
    assert carried == before["answers"].loc["alpha.txt", "raw_response"]
    assert answered_facts(answers, "bravo.txt") == facts_of("bravo", 0, 1, 2, 3)
    superseded = after["superseded"]
    assert superseded.change.to_dict() == {"bravo.txt": "changed", "charlie.txt": "removed"}
    assert (superseded.run_id == first.run_id).all()
    assert (superseded.superseded_by == second.run_id).all()
    assert superseded.loc["bravo.txt", "answer"] == before["answers"].loc["bravo.txt", "answer"]
    # the first run's tables are its history, as they were
    assert tables(first)["answers"].equals(before["answers"])
    manifest = json.loads(Path(second.outputs["manifest"]).read_text())
    assert manifest["previous_run_id"] == first.run_id
    assert [manifest["counts"][f"documents_{what}"] for what in
            ("new", "changed", "unchanged", "removed")] == [1, 1, 1, 1]  # fmt: skip

    # an unchanged archive, while another process holds it: the run waits, then computes nothing
    store = StateStore(state_store or f"sqlite:///{output / 'memstream-state.sqlite'}")
    holding, release = threading.Event(), threading.Event()

    def hold() -> None:
        with locks.holding(store, derive_archive_key(spec)):
            holding.set()
            release.wait(60)

    def waiting() -> list[str]:
        return [r.getMessage() for r in caplog.records if "waiting for it" in r.getMessage()]

    def release_once_waited_for() -> None:
        deadline = time.monotonic() + 120
        while not waiting() and time.monotonic() < deadline:
            time.sleep(0.1)
        released_at.append(time.time())
        release.set()

    released_at: list[float] = []
    holder = threading.Thread(target=hold)
    holder.start()
    assert holding.wait(30)
    threading.Thread(target=release_once_waited_for).start()
    with caplog.at_level("WARNING", logger="connectors.state.locks"):
        third = run_job(spec)
    holder.join(30)
    store.close()
    assert len(waiting()) == 1 and "same sources and output" in waiting()[0]
    with store.reader.connect() as connection:
        began = sa.select(runs.c.started_at).where(runs.c.run_id == third.run_id)
        assert connection.execute(began).scalar_one() >= released_at[0]
    assert fact_server.documents_read() == set() and third.prompt_tokens == 0
    assert third.changes == DocumentChanges(second.run_id, unchanged=3)
    assert third.chains_skipped == 3 and third.ok
    assert tables(third)["answers"].answered_in_run.to_dict() == answers.answered_in_run.to_dict()
    assert tables(third)["superseded"].empty

    # another question is new work for every document, though none changed
    reworded = JobSpec.from_dict(
        nightly(archive, output, fact_server, state_store, questions=["Which facts are there?"])
    )
    fourth = run_job(reworded)
    assert fact_server.documents_read() == {"alpha", "bravo", "delta"}
    assert fourth.changes == DocumentChanges(third.run_id, unchanged=3)
    assert not fourth.run_id.startswith(first.run_id[:-2])  # another job: another key
    assert set(tables(fourth)["superseded"].change) == {"answered anew"}


RUN_IN_SUBPROCESS = (
    "import sys\n"
    "from pipeline.job import load_job_spec, run_job\n"
    "run_job(load_job_spec(sys.argv[1]))\n"
)


def test_a_run_killed_mid_way_is_resumed_by_the_next_and_the_one_after_is_new(
    ray_session: None, fact_server: FactServer, tmp_path: Path
) -> None:
    archive, output = tmp_path / "archive", tmp_path / "out"
    archive.mkdir()
    for name in ("echo", "foxtrot"):
        (archive / f"{name}.txt").write_text(record(name, 6))
    job_file = tmp_path / "job.yaml"
    job_file.write_text(yaml.safe_dump(nightly(archive, output, fact_server, None)))
    first = run_job(JobSpec.from_dict(nightly(archive, output, fact_server, None)))
    (archive / "golf.txt").write_text(record("golf", 6))
    (archive / "echo.txt").write_text(record("echo", 7))
    fact_server.documents_read()

    state = output / "memstream-state.sqlite"
    marker = uuid.uuid4().hex
    fact_server.delay_s = 0.3
    log = (tmp_path / "killed-run.log").open("wb")
    killed = subprocess.Popen(
        [sys.executable, "-c", RUN_IN_SUBPROCESS, str(job_file)],
        env={**os.environ, "MEMSTREAM_TEST_RUN": marker},
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    try:
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline and steps_of_unfinished_chains(state) < 2:
            assert killed.poll() is None, (tmp_path / "killed-run.log").read_text()[-3000:]
            time.sleep(0.2)
    finally:
        os.killpg(killed.pid, signal.SIGKILL)
        killed.wait()
        kill_processes_marked(marker)
        log.close()
        fact_server.delay_s = 0.0
    with sqlite3.connect(state) as connection:
        ((killed_run, status),) = connection.execute(
            "SELECT run_id, status FROM runs WHERE run_id != ?", (first.run_id,)
        ).fetchall()
    assert status == "running"  # as a kill -9 leaves it
    written_before = steps_written(state)

    resumed = run_job(JobSpec.from_dict(nightly(archive, output, fact_server, None)))
    assert (resumed.run_id, resumed.attempt) == (killed_run, 2)
    assert resumed.chains_resumed >= 1 and resumed.ok
    assert resumed.changes == DocumentChanges(first.run_id, new=1, changed=1, unchanged=1)
    answers = tables(resumed)["answers"]
    assert answers.answered_in_run.to_dict() == {
        "echo.txt": killed_run, "foxtrot.txt": first.run_id, "golf.txt": killed_run,
    }  # fmt: skip
    assert answered_facts(answers, "echo.txt") == facts_of("echo", *range(7))
    # Each chain answered once, every step once; the steps the killed run wrote were kept, not
    # redone, so the resumed run read less than its chains' steps hold.
    trajectory = pd.read_parquet(resumed.outputs["trajectory"])
    assert not answers.duplicated(["source_uri", "question_id"]).any()
    assert_complete_trajectories(answers, trajectory)
    assert written_before.items() <= steps_written(state).items()
    ours = answers[answers.answered_in_run == killed_run].source_uri
    computed = trajectory[trajectory.source_uri.isin(ours)]
    assert resumed.prompt_tokens < computed.prompt_tokens.sum()

    after = run_job(JobSpec.from_dict(nightly(archive, output, fact_server, None)))
    assert after.attempt == 1 and after.run_id not in (first.run_id, killed_run)
    assert after.changes == DocumentChanges(killed_run, unchanged=3)


def steps_written(state: Path) -> dict[str, str]:
    """When each step in the store was written, by chain key and step."""
    with sqlite3.connect(f"file:{state}?mode=ro", uri=True) as connection:
        return dict(connection.execute("SELECT chain_key || ':' || step, created_at FROM steps"))


def steps_of_unfinished_chains(state: Path) -> int:
    """Steps written for chains not yet answered (0 before the store exists)."""
    try:
        with sqlite3.connect(f"file:{state}?mode=ro", uri=True) as connection:
            return connection.execute(
                "SELECT count(*) FROM steps JOIN chains USING (chain_key)"
                " WHERE chains.status != 'done'"
            ).fetchone()[0]
    except sqlite3.OperationalError:
        return 0
