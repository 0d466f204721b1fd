"""The Ray Data job end to end, on real parts: real files from the corpora, a real S3 server,
PostgreSQL and SQLite, and the real vLLM engine on the small test model. (A run killed with
kill -9 and resumed is tests/test_incremental.py's.)

Engine settings are tiny (documents of a few hundred tokens, 512-token chunks, 24-token
memories) so the whole file runs in minutes on two cores; the engine tests share one Ray session.
"""

from __future__ import annotations

import contextlib
import html
import io
import json
import os
import re
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
from typing import TYPE_CHECKING, Any
from urllib.parse import unquote, urlparse

import duckdb
import pandas as pd
import psutil
import pyarrow.fs as pafs
import pyarrow.parquet as pq
import pytest
import sqlalchemy as sa
import yaml

from connectors.engines.factory import EngineSpec
from connectors.results import ResultWriter, RunIdentity
from connectors.state.records import DocumentChanges, DocumentRecord, RunProgress, StepCheckpoint
from connectors.state.store import StateStore
from operators.core.chain import StepRecord
from operators.core.document import PlannedChain
from operators.parsing import parse_document
from pipeline.cli.flags import method_config
from pipeline.cli.main import build_parser, main
from pipeline.cli.run import spec_from_arguments
from pipeline.job import JobError, JobSpec, load_job_spec, run_job
from pipeline.job.plan import derive_archive_key, derive_job_key, plan_job
from pipeline.stages.run import Question, RunContext
from serving.config import config_from_mapping, load_config
from tests.conftest import TEST_MODEL, assert_clean_terminal

if TYPE_CHECKING:
    from connectors.seaweedfs import S3Server

pytest_plugins = ["tests.services"]

ENGINE = {
    "model": TEST_MODEL,
    "max_model_len": 2048,
    "enforce_eager": True,
    "cpu_kvcache_space_gib": 1,
}
METHOD = {"chunk_size": 512, "max_memory_tokens": 24, "max_answer_tokens": 24}
QUESTION = "What is this document about?"
# The template a model runs when none is named, written out rather than read from operators.config
# so that a changed default fails here.
MEASURED_DEFAULT_TEMPLATES = {
    "qwen2.5-coder-0.5b-instruct": "verified-quotes",
    "qwen2.5-coder-1.5b-instruct": "segment-first",
    "smollm2-135m-instruct": "segment-first",
}
# Ray runs its workers at nice 15. The engine's actor runs at 0 whatever the session says
# (ENGINE_ACTOR_ENV_VARS); the module's session sets 0 for every worker so that read and parse
# tasks do not wait behind other work on a shared machine.
WORKER_NICENESS = ("RAY_worker_niceness", "0")
RAY_WORKER_NICENESS = 15  # Ray's default
BAD_PDF_REASONS = {
    "encrypted-userpw-openpassword.pdf": "password required",
    "encrypted-aes256-userpw-baz.pdf": "password required",
    "broken-invalid-pages-unreadablemetadata.pdf": "damaged PDF",
    "scanned-image-only-grumman-1974.pdf": "no text layer",
}


def job(**fields: Any) -> JobSpec:
    return JobSpec.from_dict({"engine": ENGINE, "method": METHOD, **fields})


def excerpt_of_text(corpora: Path, chars: int) -> str:
    return (corpora / "text" / "rfc2616-http-1.1.txt").read_text()[:chars]


def excerpt_of_log(corpora: Path, lines: int) -> str:
    with (corpora / "logs" / "Apache" / "Apache_2k.log").open() as log:
        return "".join(log.readline() for _ in range(lines))


def one_page_pdf(corpora: Path) -> bytes:
    """Page 2 of a real contract, as a PDF of its own."""
    from pypdf import PdfReader, PdfWriter

    contract = next((corpora / "pdfs" / "contracts").glob("Photronics*.pdf"))
    writer = PdfWriter()
    writer.add_page(PdfReader(contract).pages[1])
    buffer = io.BytesIO()
    writer.write(buffer)
    return buffer.getvalue()


# --- the spec, without an engine -------------------------------------------------------------


def test_spec_errors_name_the_key_and_what_is_allowed() -> None:
    with pytest.raises(JobError, match=r"unknown key 'modle' in engine \(allowed: kind, model"):
        JobSpec.from_dict({"sources": ["a"], "output": "o", "engine": {"modle": "x"}})
    with pytest.raises(JobError, match=r"unknown key 'question' \(allowed: sources, output"):
        JobSpec.from_dict({"sources": ["a"], "output": "o", "question": "Q?"})
    with pytest.raises(JobError, match=r"method\.chunk_size: Input should be a valid integer"):
        JobSpec.from_dict({"sources": ["a"], "output": "o", "method": {"chunk_size": "big"}})
    with pytest.raises(JobError, match=r"concurrency\.actors: .* greater than or equal to 1"):
        JobSpec.from_dict({"sources": ["a"], "output": "o", "concurrency": {"actors": 0}})
    with pytest.raises(JobError, match="output is required"):
        JobSpec.from_dict({"sources": ["a"]})
    spec = JobSpec.from_dict({"sources": "docs", "output": "o", "questions": "Why?"})
    assert spec.sources == ("docs",) and spec.questions == ("Why?",)


def test_template_defaults_to_the_models_best_measured_and_an_explicit_one_wins() -> None:
    def job(**fields: Any) -> JobSpec:
        return JobSpec.from_dict({"sources": ["a"], "output": "o", **fields})

    qwen, rl_memagent = "qwen2.5-coder-0.5b-instruct", "BytedTsinghua-SIA/RL-MemAgent-14B"
    assert job().engine.model == qwen and job().method.template == "verified-quotes"
    assert job(engine={"model": qwen}).method.template == "verified-quotes"
    assert job(engine={"model": "smollm2-135m-instruct"}).method.template == "segment-first"
    larger = job(engine={"model": "qwen2.5-coder-1.5b-instruct"})
    assert larger.method.template == "segment-first"
    assert job(engine={"model": rl_memagent}).method.template == "memagent-reference"
    assert job(engine={"model": "/models/my-finetune"}).method.template == "memagent-reference"
    explicit = job(engine={"model": qwen}, method={"template": "extractive", "chunk_size": 900})
    assert explicit.method.template == "extractive" and explicit.method.chunk_size == 900
    served = config_from_mapping({"engine": {"model": rl_memagent}, "method": {"chunk_size": 900}})
    assert served.method.template == "memagent-reference" and served.method.chunk_size == 900
    served_by_default = load_config(None)
    assert served_by_default.engine.model == qwen
    assert served_by_default.method.template == "verified-quotes"
    asked = build_parser().parse_args(["ask", "doc.txt", "-q", "Q?", "--model", qwen])
    assert method_config(asked).template == "verified-quotes"
    asked = build_parser().parse_args(["ask", "doc.txt", "-q", "Q?", "--template", "extractive"])
    assert method_config(asked).template == "extractive"


def test_yaml_paths_are_relative_to_the_file_and_flags_win(tmp_path: Path) -> None:
    (tmp_path / "questions.txt").write_text("Who signed it?\nWhen?\n")
    job_file = tmp_path / "job.yaml"
    job_file.write_text(
        yaml.safe_dump(
            {
                "sources": ["docs", "s3://bucket/prefix", {"type": "local", "path": "more"}],
                "questions_file": "questions.txt",
                "schema": {"party": "Who is the other party?"},
                "output": "out",
                "engine": {"model": "m1", "enforce_eager": True},
                "method": {"chunk_size": 1000},
            }
        )
    )
    spec = load_job_spec(job_file)
    assert spec.sources == (
        str(tmp_path / "docs"),
        "s3://bucket/prefix",
        {"type": "local", "path": str(tmp_path / "more")},
    )
    assert spec.output.uri == str(tmp_path / "out")
    from pipeline.job.plan import resolve_questions

    assert resolve_questions(spec) == (
        Question("q0", "Who signed it?"),
        Question("q1", "When?"),
        Question("party", "Who is the other party?"),
    )

    import argparse

    from pipeline.cli.run import register

    parser = argparse.ArgumentParser()
    register(parser.add_subparsers(dest="command"))
    arguments = parser.parse_args(
        ["run", str(job_file), "--model", "m2", "--chunk-size", "300", "--actors", "2"]
    )
    overridden = spec_from_arguments(arguments)
    assert overridden.engine.model == "m2" and overridden.engine.enforce_eager
    assert overridden.method.chunk_size == 300 and overridden.concurrency.actors == 2
    flags_only = parser.parse_args(["run", "--input", "a", "--input", "b", "-q", "Q?"])
    with pytest.raises(Exception, match="--output"):
        spec_from_arguments(flags_only)


def test_the_example_job_is_valid() -> None:
    spec = load_job_spec(Path(__file__).resolve().parents[1] / "examples" / "job.yaml")
    assert spec.questions and spec.concurrency.actors == 1


def test_summary_table_shows_counts_throughput_and_outputs() -> None:
    from rich.console import Console

    from pipeline.cli.run import summary_table
    from pipeline.job import RunSummary

    summary = RunSummary(
        run_id="run-x",
        attempt=2,
        documents=8,
        documents_answered=5,
        documents_failed=3,
        chains=10,
        chains_done=9,
        chains_failed=1,
        chains_resumed=2,
        chains_skipped=4,
        errors=3,
        prompt_tokens=9000,
        completion_tokens=1000,
        elapsed_s=100.0,
        busy_s=50.0,
        outputs={"answers": "/out/run-x/answers.parquet"},
        state_store="sqlite:////out/memstream-state.sqlite",
        changes=DocumentChanges("run-w", new=2, changed=1, unchanged=5, removed=1),
    )
    console = Console(record=True, width=120)
    console.print(summary_table(summary))
    text = console.export_text()
    assert "run-x (attempt 2)" in text and "/out/run-x/answers.parquet" in text
    assert re.search(r"new, changed, unchanged, removed +│ +2, 1, 5, 1", text)
    assert re.search(r"compared with +│ +run-w", text)
    assert "200 tokens/s, 0.100 chains/s" in text  # 10,000 tokens, 5 chains in 50 s
    assert not summary.ok


def test_progress_off_a_terminal_is_a_line_when_it_changed_and_the_last_one_always() -> None:
    from rich.console import Console

    from pipeline.cli.progress import progress_bar

    console = Console(file=io.StringIO())
    readings = [RunProgress(0, 9, 0, 2), RunProgress(4, 9, 0, 2), RunProgress(9, 9, 2, 2)]
    with progress_bar(console) as report:
        for reading in [*readings, readings[-1]]:
            report(reading)
    assert console.file.getvalue().splitlines() == [  # type: ignore[attr-defined]
        "model calls 0/9, chains answered 0/2, 0 s",
        "model calls 9/9, chains answered 2/2, 0 s",
    ]


def test_the_progress_bar_shows_the_documents_read_only_with_collections() -> None:
    from rich.console import Console

    from pipeline.cli.progress import progress_bar

    def shown(reading: RunProgress) -> str:
        console = Console(file=io.StringIO(), force_terminal=True, width=200)
        with progress_bar(console) as report:
            report(reading)
        return console.file.getvalue()  # type: ignore[attr-defined]

    assert "chains answered 0/1 documents read 1/3" in shown(RunProgress(3, 8, 0, 1, 1, 3))
    assert "documents read" not in shown(RunProgress(3, 8, 0, 1))


def test_job_key_is_stable_and_follows_what_changes_the_answers() -> None:
    spec = job(sources=["docs"], output="out", questions=[QUESTION])
    questions = (Question("q0", QUESTION),)
    job_key = derive_job_key(spec, questions)
    assert job_key == derive_job_key(
        job(sources=["docs"], output="out", questions=[QUESTION]), questions
    )
    more_actors = job(sources=["docs"], output="out", concurrency={"actors": 3})
    assert derive_job_key(more_actors, questions) == job_key
    other_method = job(sources=["docs"], output="out", method={**METHOD, "chunk_size": 256})
    assert derive_job_key(other_method, questions) != job_key
    assert derive_job_key(spec, (Question("q0", "Other?"),)) != job_key
    in_bf16 = job(sources=["docs"], output="out", engine={**ENGINE, "dtype": "bfloat16"})
    assert derive_job_key(in_bf16, questions) != job_key
    looked_up = job(sources=["docs"], output="out", engine={**ENGINE, "prompt_lookup_tokens": 4})
    assert derive_job_key(looked_up, questions) != job_key
    # the archive is what a run reads and where it writes, whatever it computes
    assert derive_archive_key(in_bf16) == derive_archive_key(other_method)
    assert derive_archive_key(spec) != derive_archive_key(job(sources=["docs"], output="out2"))
    assert derive_archive_key(spec) != derive_archive_key(job(sources=["docs2"], output="out"))


def test_a_chain_key_names_its_dtype_so_a_resumed_chain_never_mixes_dtypes() -> None:
    spec = job(sources=["docs"], output="out", questions=[QUESTION])
    contexts = [
        RunContext("run", 1, "sqlite://", replace(spec.engine, dtype=dtype), spec.method, ())
        for dtype in ("float32", "bfloat16", "float32")
    ]
    keys = [context.chain_key("sha", QUESTION) for context in contexts]
    assert keys[0] == keys[2] != keys[1]
    engine = replace(spec.engine, dtype="float32", prompt_lookup_tokens=4)
    looked_up = replace(contexts[0], engine=engine)
    assert looked_up.chain_key("sha", QUESTION) not in keys


def test_unreadable_sources_and_outputs_fail_before_anything_runs(tmp_path: Path) -> None:
    with pytest.raises(JobError, match="no input files"):
        plan_job(job(sources=[str(tmp_path / "missing")], output=str(tmp_path / "out")))
    with pytest.raises(JobError, match="unknown source type"):
        plan_job(job(sources=[{"type": "ftp"}], output=str(tmp_path / "out")))
    (tmp_path / "doc.txt").write_text("text")
    blocked = tmp_path / "blocked"
    blocked.write_text("a file where the output folder should be")
    with pytest.raises(JobError, match="cannot write"):
        plan_job(job(sources=[str(tmp_path / "doc.txt")], output=str(blocked)))


def test_chunk_that_cannot_fit_the_model_fails_early(tmp_path: Path) -> None:
    (tmp_path / "doc.txt").write_text("text")
    spec = job(
        sources=[str(tmp_path / "doc.txt")],
        output=str(tmp_path / "out"),
        questions=[QUESTION],
        method={**METHOD, "chunk_size": 2000},
    )
    with pytest.raises(JobError, match=r"lower the chunk size \(method\.chunk_size"):
        plan_job(spec)


def test_sources_are_one_ray_read_and_every_input_ends_read_or_in_errors(
    tmp_path: Path, sqlite_url: str
) -> None:
    """Local files, SQL rows and a Parquet dataset through the job's read (Ray read tasks list
    and fetch; the driver holds no list of items) and its read stage: each input becomes a
    document or an errors row with its reason, never both, never neither."""
    import pyarrow as pa
    import ray

    from connectors import open_source
    from pipeline.job.graph import read_sources
    from pipeline.stages.read import ReadParseStage

    folder = tmp_path / "docs"
    folder.mkdir()
    (folder / "a.txt").write_text("first document")
    (folder / "a.txt.questions.json").write_text("{not json")
    (folder / "empty.txt").write_text("   ")
    (folder / "b.md").write_text("# second document")
    database = sqlite_url.replace("memstream.db", f"{uuid.uuid4().hex}.db")
    with sa.create_engine(database).begin() as connection:
        connection.exec_driver_sql("CREATE TABLE rows (id int, body text, q text)")
        connection.exec_driver_sql(
            "INSERT INTO rows VALUES (1, 'row one', 'Q?'), (2, 'row two', '[1]'), (3, '', NULL)"
        )
    pq.write_table(
        pa.table({"id": [7, 8], "text": ["seven", "eight"]}), tmp_path / "d.parquet",
        row_group_size=1,
    )  # fmt: skip
    sources = [
        open_source(str(folder)),
        open_source({"type": "sql", "url": database, "query": "SELECT id, body, q FROM rows",
                     "text_column": "body", "questions_column": "q"}),
        open_source({"type": "dataset", "path": str(tmp_path / "d.parquet")}),
    ]  # fmt: skip
    store = StateStore(f"sqlite:///{tmp_path / 'state.sqlite'}")
    store.migrate()
    attempt = store.begin_run("run-read", {}).attempt
    spec = job(sources=["x"], output=str(tmp_path / "out"))
    run = RunContext("run-read", attempt, store.url, spec.engine, spec.method, ())
    started = not ray.is_initialized()
    if started:
        ray.init(num_cpus=2, include_dashboard=False, logging_level="WARNING")
    try:
        dataset = read_sources(sources, read_tasks=2)
        parsed = dataset.map_batches(
            ReadParseStage(sources, run), batch_format="pyarrow", batch_size=1
        ).materialize()
        documents = parsed.take_all()
        # one document a block: each reaches the memory stage as a task of its own
        blocks = parsed.iter_batches(batch_size=None, batch_format="pyarrow")
        assert max(block.num_rows for block in blocks) == 1
    finally:
        if started:
            ray.shutdown()
    inputs = {(folder / name).as_uri() for name in ("a.txt", "empty.txt", "b.md")}
    inputs |= {f"{next(iter(sources[1].documents())).uri[:-2]}#{n}" for n in (1, 2, 3)}
    inputs |= {f"{(tmp_path / 'd.parquet').as_uri()}#{n}" for n in (7, 8)}
    read = {document["uri"]: document["text"] for document in documents}
    failed = {row["source_uri"]: row["message"] for row in store.errors("run-read", attempt)}
    assert set(read) | set(failed) == inputs and not set(read) & set(failed)
    assert read[(folder / "b.md").as_uri()] == "# second document"
    assert "not valid JSON" in failed[(folder / "a.txt").as_uri()]
    assert failed[(folder / "empty.txt").as_uri()] == "empty document"
    assert "questions must be text" in failed[f"{next(iter(sources[1].documents())).uri[:-2]}#2"]
    assert len(read) == 4 and len(failed) == 4
    store.close()


# --- the state store, on SQLite and PostgreSQL ------------------------------------------------


@pytest.fixture(params=["sqlite_url", pytest.param("postgres_url", marks=pytest.mark.server)])
def store(request: pytest.FixtureRequest) -> Iterator[StateStore]:
    url = request.getfixturevalue(request.param)
    if request.param == "postgres_url":  # one cluster per session: give each test a schema
        schema = f"s{uuid.uuid4().hex[:10]}"
        with sa.create_engine(url).begin() as connection:
            connection.exec_driver_sql(f"CREATE SCHEMA {schema}")
        url = f"{url}?options=-csearch_path%3D{schema}"
    else:
        url = url.replace("memstream.db", f"{uuid.uuid4().hex}.db")
    store = StateStore(url)
    store.migrate()
    yield store
    store.close()


def document(run_id: str, attempt: int, uri: str) -> DocumentRecord:
    return DocumentRecord(
        run_id, attempt, uri, f"id-{uri}", uri, "sha", "text", None, [], {}, 100, 2
    )


def step(
    key: str,
    index: int,
    *,
    final: bool = False,
    rejected: tuple[str, ...] = (),
    reread: tuple[tuple[int, int], ...] = (),
) -> StepCheckpoint:
    record = StepRecord(
        chain_id=key,
        step=index,
        kind="final" if final else "update",
        segment_index=None if final else index,
        token_start=None if final else index * 50,
        token_end=None if final else index * 50 + 50,
        char_start=None if final else index * 200,
        char_end=None if final else index * 200 + 200,
        output=f"memory {index}",
        prompt_tokens=100,
        completion_tokens=10,
        finish_reason="stop",
        latency_s=0.5,
        rejected_quotes=rejected,
        reread_spans=reread,
    )
    return StepCheckpoint(
        record,
        next_step=index + 1,
        memory=f"memory {min(index, 1)}",
        done=final,
        answer="42" if final else None,
        raw_response="Therefore, the answer is 42" if final else None,
    )


def test_store_checkpoints_resume_and_export_one_row_per_question(
    store: StateStore, tmp_path: Path
) -> None:
    attempt = store.begin_run("run-a", {"what": "test"}).attempt
    assert attempt == 1
    chains = [PlannedChain("key-1", "q0", "Q1?"), PlannedChain("key-2", "q1", "Q2?")]
    assert store.plan_document(document("run-a", 1, "file:///a"), chains) == {
        "key-1": "pending",
        "key-2": "pending",
    }
    store.mark_running("key-1")
    store.record_step(step("key-1", 0))
    store.record_step(step("key-1", 1))
    checkpoint = store.load_checkpoint("key-1")
    assert (checkpoint.status, checkpoint.step, checkpoint.memory) == ("running", 2, "memory 1")
    # two chains of two segments: three calls each, two done
    assert store.progress("run-a", 1) == RunProgress(2, 6, 0, 2)

    # a crash, then a rerun: a new attempt re-plans the same chains and keeps their progress
    assert store.begin_run("run-a", {"what": "test"}).attempt == 2
    statuses = store.plan_document(document("run-a", 2, "file:///a"), chains)
    assert statuses == {"key-1": "running", "key-2": "pending"}
    store.record_step(step("key-1", 1, rejected=("not in the section",)))  # written twice: one row
    store.record_step(step("key-1", 2, final=True, reread=((10, 20), (400, 450))))
    store.mark_failed("key-2", "EngineError: boom")
    store.mark_failed("key-1", "too late: it is done")

    answers = list(store.answers("run-a", 2))
    assert [(a["question_id"], a["status"], a["answer"]) for a in answers] == [
        ("q0", "done", "42"),
        ("q1", "failed", None),
    ]
    assert answers[0]["prompt_tokens"] == 300 and answers[0]["compute_s"] == 1.5
    assert [row["step"] for row in store.trajectory("run-a", 2)] == [0, 1, 2]
    assert list(store.answers("run-a", 1)) == []  # the first attempt's rows moved on
    assert store.chain_status_counts("run-a", 2) == {"done": 1, "failed": 1}
    assert store.progress("run-a", 2) == RunProgress(3, 6, 1, 2)
    assert store.document_counts("run-a", 2) == (1, 0)
    assert 0.5 <= store.busy_window("run-a", 2, since=0) < 60

    filesystem, base = pafs.LocalFileSystem(), str(tmp_path / "out")
    writer = ResultWriter(filesystem, base, "run-a")
    from operators.config import MethodConfig

    tables = writer.export_tables(
        store, RunIdentity("run-a", 2, "m", "vllm", "float32", MethodConfig())
    )
    assert {name: table.rows for name, table in tables.items()} == {
        "answers": 2,
        "trajectory": 3,
        "errors": 0,
        "superseded": 0,  # a run of its own: no previous run over an archive
    }
    query = f"SELECT step, rejected_quotes FROM '{tables['trajectory'].uri}' ORDER BY step"
    assert duckdb.sql(query).fetchall() == [(0, []), (1, ["not in the section"]), (2, [])]
    query = f"SELECT step, reread_spans FROM '{tables['trajectory'].uri}' ORDER BY step"
    assert duckdb.sql(query).fetchall() == [(0, []), (1, []), (2, [[10, 20], [400, 450]])]
    query = f"SELECT question_id, sampling.top_p, dtype FROM '{tables['answers'].uri}'"
    assert duckdb.sql(query).df().values.tolist() == [
        ["q0", 1.0, "float32"],
        ["q1", 1.0, "float32"],
    ]


def test_progress_counts_the_members_each_collection_chain_has_read(store: StateStore) -> None:
    attempt = store.begin_run("run-c", {"what": "test"}).attempt

    def collection(uri: str, cut: bool) -> DocumentRecord:
        metadata: dict[str, Any] = {"members": ["m1", "m2", "m3"], "member_sha256": ["s"] * 3}
        if cut:  # the segments of each member, in reading order
            metadata["member_segments"] = [2, 1, 2]
        return DocumentRecord("run-c", attempt, uri, "c", uri, "c" * 64, "collection", None,
                              [], metadata, 100, 5)  # fmt: skip

    chains = [PlannedChain("key-c0", "q0", "Q1?"), PlannedChain("key-c1", "q1", "Q2?")]
    store.plan_document(collection("collection:c", cut=True), chains)
    store.plan_document(
        document("run-c", attempt, "file:///a"), [PlannedChain("key-a", "q0", "Q?")]
    )
    # a document alone counts no member; two chains of 3 members: 6 planned, none read
    assert store.progress("run-c", attempt) == RunProgress(0, 15, 0, 3, 0, 6)

    store.mark_running("key-c0")
    store.record_step(step("key-c0", 0))
    assert store.progress("run-c", attempt).members_done == 0  # half of the first member
    store.record_step(step("key-c0", 1))
    assert store.progress("run-c", attempt) == RunProgress(2, 15, 0, 3, 1, 6)  # 1 of 3
    store.record_step(step("key-c0", 2))  # the second member's one segment
    for index in range(5):
        store.record_step(step("key-c1", index))
    store.record_step(step("key-c1", 5, final=True))  # answered: every member read
    assert store.progress("run-c", attempt) == RunProgress(9, 15, 1, 3, 2 + 3, 6)

    # a collection of the same content shares its chains: it counts them by its original's cut
    store.plan_document(collection("collection:same", cut=False), chains)
    assert store.progress("run-c", attempt) == RunProgress(18, 27, 2, 5, 10, 12)


def test_sqlite_store_takes_concurrent_writers(sqlite_url: str) -> None:
    url = sqlite_url.replace("memstream.db", "concurrent.db")
    StateStore(url).migrate()
    chains = [PlannedChain(f"key-{i}", f"q{i}", "Q?") for i in range(4)]
    StateStore(url).plan_document(document("run-c", 1, "file:///c"), chains)
    failures: list[BaseException] = []

    def write_chain(index: int) -> None:
        writer = StateStore(url)  # as if in another actor
        try:
            for position in range(25):
                writer.record_step(step(f"key-{index}", position))
        except BaseException as error:
            failures.append(error)

    threads = [threading.Thread(target=write_chain, args=(i,)) for i in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert not failures
    with sqlite3.connect(url.removeprefix("sqlite:///")) as connection:
        assert connection.execute("PRAGMA journal_mode").fetchone() == ("wal",)
        assert connection.execute("SELECT count(*) FROM steps").fetchone() == (100,)


# --- the job, with the real engine --------------------------------------------------------------


@pytest.fixture(scope="module")
def ray_session(s3_server: S3Server) -> Iterator[None]:
    """One Ray session for the module's engine tests. Started after the S3 fixture, so its
    workers inherit the S3 credentials it puts in the environment."""
    import ray

    with pytest.MonkeyPatch.context() as env:
        env.setenv(*WORKER_NICENESS)
        ray.init(num_cpus=2, include_dashboard=False, logging_level="WARNING")
    yield
    ray.shutdown()


@pytest.fixture
def local_inputs(corpora: Path, tmp_path: Path) -> Path:
    """A text, a log and a good one-page PDF cut from the corpora, and every bad PDF."""
    folder = tmp_path / "inputs"
    folder.mkdir()
    (folder / "rfc2616-excerpt.txt").write_text(excerpt_of_text(corpora, 4000))
    (folder / "rfc2616-excerpt.txt.questions.txt").write_text("Which protocol is described?\n")
    (folder / "apache-excerpt.log").write_text(excerpt_of_log(corpora, 12))
    (folder / "contract-page.pdf").write_bytes(one_page_pdf(corpora))
    for bad in sorted((corpora / "pdfs" / "bad").glob("*.pdf")):
        (folder / bad.name).write_bytes(bad.read_bytes())
    return folder


@pytest.mark.engine
def test_local_job_answers_every_document_or_says_why(
    ray_session: None, local_inputs: Path, tmp_path: Path
) -> None:
    output = tmp_path / "out"
    summary = run_job(job(sources=[str(local_inputs)], questions=[QUESTION], output=str(output)))
    assert summary.attempt == 1

    inputs = {
        p.as_uri() for p in local_inputs.iterdir() if not p.name.endswith(".txt.questions.txt")
    }
    answers = duckdb.sql(f"SELECT * FROM '{summary.outputs['answers']}'").df()
    errors = pd.read_parquet(summary.outputs["errors"])
    trajectory = pd.read_parquet(summary.outputs["trajectory"])
    assert set(answers.source_uri) | set(errors.source_uri) == inputs
    assert not set(answers.source_uri) & set(errors.source_uri)

    reasons = dict(zip(errors.name, errors.message, strict=True))
    assert reasons.keys() == BAD_PDF_REASONS.keys()
    for name, reason in BAD_PDF_REASONS.items():
        assert reason in reasons[name]
    assert set(errors.stage) == {"parse"}

    assert not answers.duplicated(["source_uri", "question_id"]).any()
    assert len(answers) == 5  # four documents, one of them with its own second question
    assert (answers.status == "done").all() and answers.raw_response.str.len().min() > 0
    own = answers[answers.question_id == "d0"]
    assert own.name.tolist() == ["rfc2616-excerpt.txt"]
    assert own.question.tolist() == ["Which protocol is described?"]
    recovered = answers[answers.name == "corrupted-zen_of_python.pdf"].iloc[0]
    assert any("recovered" in warning for warning in recovered.parse_warnings)
    assert (answers.model == TEST_MODEL).all()
    default_template = MEASURED_DEFAULT_TEMPLATES.get(TEST_MODEL, "memagent-reference")
    assert (answers.template == default_template).all()
    assert answers.timings.map(lambda t: t["compute_s"] > 0).all()

    assert_complete_trajectories(answers, trajectory)
    assert_evidence_points_into_the_source(answers)
    assert_report_shows_the_run(Path(summary.outputs["answers"]).parent, answers, errors)
    assert summary.documents == 8 and summary.documents_answered == 4
    assert summary.documents_failed == 4 and summary.errors == 4
    assert summary.chains == summary.chains_done == 5 and summary.chains_failed == 0
    assert summary.tokens == trajectory.prompt_tokens.sum() + trajectory.completion_tokens.sum()
    manifest = json.loads(Path(summary.outputs["manifest"]).read_text())
    assert manifest["counts"]["answers_rows"] == 5 and manifest["run_id"] == summary.run_id

    # the next run over the unchanged inputs: a run of its own, every answer carried forward
    rerun = run_job(job(sources=[str(local_inputs)], questions=[QUESTION], output=str(output)))
    assert rerun.run_id != summary.run_id and rerun.attempt == 1
    assert rerun.chains_skipped == 5 and rerun.prompt_tokens == 0
    assert (rerun.changes.previous_run_id, rerun.changes.unchanged) == (summary.run_id, 4)
    again = duckdb.sql(f"SELECT * FROM '{rerun.outputs['answers']}'").df()
    assert (again.answered_in_run == summary.run_id).all() and (again.run_id == rerun.run_id).all()
    by_chain = ["source_uri", "question_id"]
    assert again.sort_values(by_chain).raw_response.tolist() == (
        answers.sort_values(by_chain).raw_response.tolist()
    )


@pytest.mark.engine
def test_a_grown_corpus_computes_only_its_new_and_changed_documents_with_the_real_engine(
    ray_session: None, corpora: Path, tmp_path: Path
) -> None:
    """Two nightly runs with the real engine: between them a document is added and one changes;
    the second run computes those two only and carries the third's answer forward."""
    inputs = tmp_path / "inputs"
    inputs.mkdir()
    (inputs / "rfc.txt").write_text(excerpt_of_text(corpora, 2000))
    (inputs / "apache.log").write_text(excerpt_of_log(corpora, 6))
    spec = job(sources=[str(inputs)], questions=[QUESTION], output=str(tmp_path / "out"))
    first = run_job(spec)
    assert first.ok and first.changes.new == 2
    before = pd.read_parquet(first.outputs["answers"]).set_index("name")

    (inputs / "contract-page.pdf").write_bytes(one_page_pdf(corpora))
    (inputs / "apache.log").write_text(excerpt_of_log(corpora, 10))
    second = run_job(spec)
    assert second.ok and (second.attempt, second.chains_skipped) == (1, 1)
    assert second.changes == DocumentChanges(first.run_id, new=1, changed=1, unchanged=1)
    answers = pd.read_parquet(second.outputs["answers"])
    trajectory = pd.read_parquet(second.outputs["trajectory"])
    assert_complete_trajectories(answers, trajectory)
    by_name = answers.set_index("name")
    assert by_name.answered_in_run.to_dict() == {
        "rfc.txt": first.run_id, "apache.log": second.run_id, "contract-page.pdf": second.run_id,
    }  # fmt: skip
    assert by_name.loc["rfc.txt", "raw_response"] == before.loc["rfc.txt", "raw_response"]
    computed = trajectory[trajectory.source_uri != by_name.loc["rfc.txt", "source_uri"]]
    assert second.prompt_tokens == computed.prompt_tokens.sum()  # the engine read no more
    superseded = pd.read_parquet(second.outputs["superseded"])
    assert superseded[["name", "change", "run_id"]].values.tolist() == [
        ["apache.log", "changed", first.run_id]
    ]
    assert superseded.chain_key.tolist() == [before.loc["apache.log", "chain_key"]]


def assert_report_shows_the_run(folder: Path, answers: pd.DataFrame, errors: pd.DataFrame) -> None:
    """`memstream report` on the run folder: a page with every chain, question and error."""
    assert main(["report", str(folder)]) == 0
    page = (folder / "report.html").read_text()
    assert page.count('<section class="chain"') == len(answers)
    for text in [*answers.question, *answers.name, *errors.name]:
        assert html.escape(text) in page, text


def assert_evidence_points_into_the_source(answers: pd.DataFrame) -> None:
    """Every answered chain says whether it is grounded and why; each evidence item quotes the
    parsed source exactly at its offsets, with its page for PDFs."""
    assert answers.grounded.notna().all() and answers.grounding_reason.str.len().min() > 0
    for row in answers.itertuples():
        parsed = parse_document(Path(unquote(urlparse(row.source_uri).path)).read_bytes(), row.name)
        for item in row.evidence:
            assert parsed.text[item["char_start"] : item["char_end"]] == item["quote"], row.name
            if parsed.page_starts:
                assert 1 <= item["page"] <= parsed.pages
            else:
                assert item["page"] is None


def assert_complete_trajectories(answers: pd.DataFrame, trajectory: pd.DataFrame) -> None:
    """Each chain has steps 0..n_segments once: n updates, then the final answer."""
    assert not trajectory.duplicated(["source_uri", "question_id", "step"]).any()
    for answer in answers.itertuples():
        steps = trajectory[
            (trajectory.source_uri == answer.source_uri)
            & (trajectory.question_id == answer.question_id)
        ].sort_values("step")
        assert steps.step.tolist() == list(range(answer.n_segments + 1)), answer.name
        assert steps.kind.tolist() == ["update"] * answer.n_segments + ["final"]
        assert steps.memory_after.iloc[-1] == answer.raw_response
        if answer.n_segments:
            assert steps.memory_after.iloc[-2] == answer.final_memory
            assert steps.token_start.iloc[0] == 0
            assert steps.token_end.iloc[-2] == answer.n_tokens


@pytest.mark.engine
@pytest.mark.server
def test_s3_and_sql_in_s3_out_with_a_postgres_state_store(
    ray_session: None, s3_server: S3Server, postgres_url: str, corpora: Path
) -> None:
    bucket = f"job-{uuid.uuid4().hex[:10]}"
    client = s3_server.client()
    client.create_bucket(Bucket=bucket)
    client.put_object(Bucket=bucket, Key="in/rfc.txt", Body=excerpt_of_text(corpora, 1500).encode())
    client.put_object(Bucket=bucket, Key="in/contract-page.pdf", Body=one_page_pdf(corpora))
    table = f"docs_{uuid.uuid4().hex[:8]}"
    with sa.create_engine(postgres_url).begin() as connection:
        connection.exec_driver_sql(f"CREATE TABLE {table} (id int PRIMARY KEY, body text)")
        connection.execute(
            sa.text(f"INSERT INTO {table} VALUES (1, :log), (2, :empty)"),
            {"log": excerpt_of_log(corpora, 8), "empty": "   "},
        )
    spec = job(
        sources=[
            {"type": "s3", "uri": f"s3://{bucket}/in/", "endpoint_url": s3_server.endpoint_url},
            {"type": "sql", "url": postgres_url, "query": f"SELECT id, body FROM {table}",
             "text_column": "body"},
        ],
        questions=[QUESTION],
        output={"uri": f"s3://{bucket}/out", "s3_endpoint_url": s3_server.endpoint_url},
        state_store=postgres_url,
    )  # fmt: skip
    summary = run_job(spec)

    filesystem = pafs.S3FileSystem(endpoint_override=s3_server.endpoint_url)
    prefix = f"{bucket}/out/{summary.run_id}"
    assert summary.outputs["answers"] == f"s3://{prefix}/answers.parquet"
    answers = pq.read_table(f"{prefix}/answers.parquet", filesystem=filesystem).to_pandas()
    errors = pq.read_table(f"{prefix}/errors.parquet", filesystem=filesystem).to_pandas()
    trajectory = pq.read_table(f"{prefix}/trajectory.parquet", filesystem=filesystem).to_pandas()
    assert sorted(answers.name) == ["1.txt", "contract-page.pdf", "rfc.txt"]
    assert (answers.status == "done").all()
    assert errors[["name", "message"]].values.tolist() == [["2.txt", "empty document"]]
    assert ":***@" in summary.state_store  # the password never shows
    assert_complete_trajectories(answers, trajectory)
    with filesystem.open_input_stream(f"{prefix}/manifest.json") as stream:
        manifest = json.loads(stream.read())
    assert manifest["counts"]["documents"] == 4 and manifest["counts"]["chains_done"] == 3
    # the store holds each step of the run's chains once, and the trajectory shows every one
    chain_steps = sa.text("SELECT chain_key, step FROM steps WHERE chain_key IN :keys").bindparams(
        sa.bindparam("keys", expanding=True)
    )
    with sa.create_engine(postgres_url).connect() as connection:
        stored = connection.execute(chain_steps, {"keys": sorted(set(answers.chain_key))}).all()
    exported = zip(trajectory.chain_key, trajectory.step, strict=True)
    assert sorted(map(tuple, stored)) == sorted((key, int(step)) for key, step in exported)


# --- `memstream run` as a user runs it -----------------------------------------------------------


@pytest.mark.engine
def test_memstream_run_shows_progress_and_leaves_no_process_behind(
    corpora: Path, tmp_path: Path
) -> None:
    (tmp_path / "rfc.txt").write_text(excerpt_of_text(corpora, 3000))
    marker = uuid.uuid4().hex
    command = [
        sys.executable, "-m", "pipeline.cli.main", "run", "--input", str(tmp_path / "rfc.txt"),
        "--question", QUESTION, "--output", str(tmp_path / "out"),
        "--model", TEST_MODEL, "--enforce-eager", "--kv-cache-gib", "1", "--max-model-len", "2048",
        "--chunk-size", "300", "--max-memory-tokens", "24", "--max-answer-tokens", "24",
    ]  # fmt: skip
    # Ray's own worker niceness, as a user's run has it.
    environment = {k: v for k, v in os.environ.items() if k != WORKER_NICENESS[0]}
    environment["MEMSTREAM_TEST_RUN"] = marker
    try:
        niceness: set[tuple[str, int]] = set()  # (title, nice) of each process seen
        stdout, stderr = tmp_path / "stdout.txt", tmp_path / "stderr.txt"
        with stdout.open("w") as out, stderr.open("w") as err:
            process = subprocess.Popen(command, env=environment, stdout=out, stderr=err)
            deadline = time.monotonic() + 900
            while process.poll() is None and time.monotonic() < deadline:
                niceness |= niceness_of(processes_marked(marker))
                time.sleep(0.5)
        process.kill()  # when past the deadline
        result = subprocess.CompletedProcess(
            command, process.wait(), stdout.read_text(), stderr.read_text()
        )
        assert result.returncode == 0, result.stderr[-3000:]
        # The engine is the run's work: it runs at nice 0, Ray's task workers at Ray's 15.
        engine = {nice for title, nice in niceness if title.startswith("VLLM::")}
        assert engine == {0}, niceness
        ray_workers = {nice for title, nice in niceness if title.startswith("ray::")}
        assert RAY_WORKER_NICENESS in ray_workers, niceness
        assert "model calls" in result.stderr and "chains answered 1/1" in result.stderr
        assert "answered" in result.stdout
        log = assert_clean_terminal(result.stdout, result.stderr)
        assert log.parent == tmp_path / "out" / "logs"
        (answers_file,) = (tmp_path / "out").glob("*/answers.parquet")
        answers = pd.read_parquet(answers_file)
        assert answers.status.tolist() == ["done"] and answers.raw_response.str.len().min() > 0
        deadline = time.monotonic() + 60
        while (left := processes_marked(marker)) and time.monotonic() < deadline:
            time.sleep(1)
        assert not left, f"processes left running after the job: {left}"
    finally:
        kill_processes_marked(marker)


def processes_marked(marker: str) -> list[int]:
    """Processes started with the marker in their environment (Ray workers and engine
    processes are in process groups of their own)."""
    needle = f"MEMSTREAM_TEST_RUN={marker}".encode()
    marked = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            if needle in (entry / "environ").read_bytes().split(b"\0"):
                marked.append(int(entry.name))
        except OSError:
            continue
    return marked


def niceness_of(pids: list[int]) -> set[tuple[str, int]]:
    """Each process's title (as `ps` shows it) and nice value."""
    seen = set()
    for pid in pids:
        with contextlib.suppress(psutil.Error):
            process = psutil.Process(pid)
            seen.add((process.name(), process.nice()))
    return seen


def kill_processes_marked(marker: str) -> None:
    """SIGKILLs what a run left behind, found by the marker in their environment."""
    for _ in range(20):
        marked = processes_marked(marker)
        if not marked:
            return
        for pid in marked:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        time.sleep(0.5)


@pytest.mark.engine
def test_hostile_documents_through_the_real_job(ray_session: None, tmp_path: Path) -> None:
    """The hostile corpus of tests/test_hostile_inputs.py through `run_job` with the real
    engine, Ray Data and the Parquet export: answers + errors = inputs, the duplicate answered
    once, every refusal with its reason."""
    from tests.test_hostile_inputs import LIMITS, hostile_files

    folder = tmp_path / "hostile"
    folder.mkdir()
    expected = {name: hostile.outcome for name, hostile in hostile_files().items()}
    for name, hostile in hostile_files().items():
        (folder / name).write_bytes(hostile.content)
    limits = {
        "max_chars": LIMITS.max_chars,
        "max_tokens": LIMITS.max_tokens,
        "max_pdf_pages": LIMITS.max_pdf_pages,
        "max_expanded_bytes": LIMITS.max_expanded_bytes,
    }
    # One read + segment task at a time: the copy is planned after the original, so it finds
    # it (two tasks planning both at the same instant may both run the chain).
    spec = job(
        sources=[str(folder)],
        questions=[QUESTION],
        output=str(tmp_path / "out"),
        limits=limits,
        concurrency={"read_tasks": 1},
    )
    summary = run_job(spec)
    answers = pd.read_parquet(summary.outputs["answers"])
    errors = pd.read_parquet(summary.outputs["errors"])
    assert set(answers.name) | set(errors.name) == set(expected)
    assert not set(answers.name) & set(errors.name)
    assert len(answers) + len(errors) == len(expected)
    reasons = dict(zip(errors.name, errors.message, strict=True))
    for name, outcome in expected.items():
        if outcome not in ("answered", "duplicate"):
            assert outcome in reasons[name], (name, reasons[name])
    rows = answers.set_index("name")
    assert (rows.status == "done").all()
    copy, original = rows.loc["same-content-copy.txt"], rows.loc["original.txt"]
    assert copy.chain_key == original.chain_key and copy.raw_response == original.raw_response
    assert any("duplicate of" in warning for warning in copy.parse_warnings)
    assert any("instructions to the model" in w for w in rows.loc["injection.txt"].parse_warnings)
    trajectory = pd.read_parquet(summary.outputs["trajectory"])
    assert not trajectory.duplicated(["chain_key", "source_uri", "step"]).any()


def test_the_summary_names_dtype_and_mode_only_for_an_engine_that_has_them() -> None:
    local = EngineSpec(model="m", dtype="float32", enforce_eager=True)
    assert local.describe() == "vllm m, float32, eager"
    server = EngineSpec(kind="openai", model="m", base_url="http://user:secret@127.0.0.1:1/v1")
    assert server.describe() == "openai m (an OpenAI-compatible server)"
