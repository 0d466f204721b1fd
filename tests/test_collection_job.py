"""Questions over a collection in the corpus job: a job's `collections` read their members in
order, as one chain per question, through the job's stages (read + parse, the collection
stage, the memory stage) on the fake engine and its word tokenizer and a SQLite store, as
tests/test_hostile_inputs.py runs them; the grouping Ray Data does between them
(`groupby("collection")`) is one table here (one test reads its members from S3, SeaweedFS).
`run_job` on Ray with local files is the last test.

The rules: one answers row per (collection, question), named after the collection, whose
evidence names the member it is in; members are read in the order asked; an unchanged
collection is answered once, a changed member runs its chain anew; a member that cannot be
parsed is an errors row and the collection is answered without it, saying so.
"""

from __future__ import annotations

import asyncio
import atexit
import json
import os
import re
import sqlite3
import uuid
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any, NamedTuple

import pandas as pd
import pytest

from connectors.base import Source
from connectors.engines.factory import EngineSpec
from connectors.engines.fake import EngineCrash, FactEngine, WordTokenizer, tagged
from connectors.local import LocalSource
from connectors.seaweedfs import S3Server
from connectors.sql import SqlSource
from connectors.state.records import Checkpoint, DocumentRecord
from connectors.state.store import StateStore
from operators.config import ConfigError, MethodConfig, check_context_fit
from operators.core.chain import ChainStatus
from operators.core.collection import Member, order_members, with_longest_header
from operators.core.document import PlannedChain, documents_table
from operators.core.segmentation import Segment
from pipeline.job import JobError, JobSpec, run_job
from pipeline.job.plan import (
    derive_job_key,
    fetch_order_fields,
    resolve_collections,
    resolve_questions,
)
from pipeline.stages.collection import CollectionMembers, CollectionStage
from pipeline.stages.memory import MemoryStage
from pipeline.stages.read import ReadParseStage
from pipeline.stages.run import CollectionPlan, Question, RunContext
from pipeline.stages.segment import SegmentStage

QUESTION = "Which quarter's report names a fact?"
METHOD = MethodConfig(
    template="memagent-reference", chunk_size=16, max_memory_tokens=64, max_answer_tokens=32
)
SPEC = EngineSpec(model="fake-model", dtype="float32")
REPORTS = {
    "2023-q1.txt": "The first quarter report has revenue figures only and no named item.",
    "2023-q2.txt": "The second quarter report says fact-iphone grew plainly.",
    "2023-q3.txt": "The third quarter report has costs and no named item either.",
}


def quarters(order_by: str = "listed", *globs: str) -> CollectionPlan:
    return CollectionPlan(
        "quarters", order_by, globs or ("2023-q*.txt",), None, (Question("q0", QUESTION),)
    )


class StagesRun(NamedTuple):
    answers: dict[str, dict[str, Any]]  # by name: a document's, or the collection's
    errors: dict[str, dict[str, Any]]
    results: list[dict[str, Any]]  # the memory stage's rows
    engine: FactEngine | None  # the engine opened, if any


def run_stages(
    folder: Path,
    store_url: str,
    run_id: str,
    collections: tuple[CollectionPlan, ...],
    questions: tuple[Question, ...] = (),
    engine: FactEngine | None = None,
    spec: EngineSpec = SPEC,
    source: Source | None = None,
    archive: str | None = None,
) -> StagesRun:
    """The job's stages over a folder (or `source`), the collection branch beside the
    documents' one; the memory stage opens `engine`, else a new FactEngine. A crash of the
    engine (EngineCrash) comes out of here as it would kill the process. With `archive`, the
    run is one of the runs over that archive key: compared with the previous one (what it
    supersedes) and finished, as `run_job` does."""
    from pipeline.stages import run as run_module

    store = StateStore(store_url)
    store.migrate()
    attempt = store.begin_run(run_id, {"test": "collections"}, archive_key=archive).attempt
    context = RunContext(
        run_id, attempt, store_url, spec, METHOD, questions, collections=collections
    )
    source = source or LocalSource([str(folder)])
    parsed = ReadParseStage([source], context, keep_failed=True)(
        documents_table(source.documents())
    )
    tokenizer = WordTokenizer()
    planned = [
        SegmentStage(context, tokenizer_factory=lambda spec: tokenizer)(parsed),
        CollectionStage(context, tokenizer_factory=lambda spec: tokenizer)(
            CollectionMembers(collections)(parsed)
        ),
    ]
    opened: list[FactEngine] = []

    def open_engine(spec: EngineSpec) -> FactEngine:
        opened.append(engine or FactEngine())
        return opened[-1]

    stage = MemoryStage(context, max_active_chains=8, engine_factory=open_engine)
    try:
        results = [row for table in planned for row in asyncio.run(stage(table)).to_pylist()]
    finally:
        stage.close()
        atexit.unregister(stage.close)
    if archive is not None:
        store.supersede_previous(run_id, attempt)
        store.finish_run(run_id, "done")
    answers = {row["name"]: row for row in store.answers(run_id, attempt)}
    errors = {row["name"]: row for row in store.errors(run_id, attempt)}
    store.close()
    run_module.open_store(store_url).close()
    return StagesRun(answers, errors, results, opened[0] if opened else None)


def headers_read(engine: FactEngine) -> list[str]:
    """The document header of each update step, in the order the chain read them."""
    return [
        line
        for request in engine.requests
        for line in request.prompt.splitlines()
        if line.startswith("## Document ")
    ]


@pytest.fixture
def reports(tmp_path: Path) -> Path:
    folder = tmp_path / "reports"
    folder.mkdir()
    for name, text in REPORTS.items():
        (folder / name).write_text(text)
    return folder


@pytest.fixture
def store_url(tmp_path: Path) -> str:
    return f"sqlite:///{tmp_path / 'state.sqlite'}"


def test_a_collection_question_is_one_answers_row_whose_evidence_names_its_member(
    reports: Path, store_url: str
) -> None:
    run = run_stages(reports, store_url, "run-1", (quarters(),))

    assert set(run.answers) == {"quarters"} and not run.errors
    row = run.answers["quarters"]
    assert row["source_uri"] == "collection:quarters" and row["question_id"] == "q0"
    assert row["status"] == "done" and "fact-iphone" in row["answer"]
    documents = {item.get("document") for item in json.loads(row["evidence"])}
    assert documents == {"doc 2: 2023-q2.txt"}, row["evidence"]
    assert [r["status"] for r in run.results] == ["done"]


def test_members_are_read_in_the_order_asked(reports: Path, store_url: str) -> None:
    listed = quarters("listed", "2023-q3.txt", "2023-q1.txt", "*.txt")
    run = run_stages(reports, store_url, "run-1", (listed,))
    assert run.engine is not None
    firsts = [h for h in headers_read(run.engine) if "continued" not in h]
    assert firsts == [
        "## Document 1 of 3: 2023-q3.txt",
        "## Document 2 of 3: 2023-q1.txt",
        "## Document 3 of 3: 2023-q2.txt",
    ]

    by_name = run_stages(reports, store_url, "run-2", (quarters("name", "*q3*", "*"),))
    assert by_name.engine is not None
    assert [h for h in headers_read(by_name.engine) if "continued" not in h] == [
        "## Document 1 of 3: 2023-q1.txt",
        "## Document 2 of 3: 2023-q2.txt",
        "## Document 3 of 3: 2023-q3.txt",
    ]

    for age, name in enumerate(["2023-q2.txt", "2023-q3.txt", "2023-q1.txt"]):
        os.utime(reports / name, (1_700_000_000 + age * 86_400,) * 2)
    by_mtime = run_stages(reports, store_url, "run-3", (quarters("mtime"),))
    assert by_mtime.engine is not None
    assert [h for h in headers_read(by_mtime.engine) if "continued" not in h] == [
        "## Document 1 of 3: 2023-q2.txt (modified 2023-11-14)",
        "## Document 2 of 3: 2023-q3.txt (modified 2023-11-15)",
        "## Document 3 of 3: 2023-q1.txt (modified 2023-11-16)",
    ]
    # Three orders, three chains: the order is part of what a chain reads, so of its key.
    keys = {r.answers["quarters"]["chain_key"] for r in (run, by_name, by_mtime)}
    assert len(keys) == 3


def test_an_unchanged_collection_is_answered_once_and_a_changed_member_reruns_it(
    reports: Path, store_url: str
) -> None:
    first = run_stages(reports, store_url, "run-1", (quarters(),))
    again = run_stages(reports, store_url, "run-2", (quarters(),))
    assert again.engine is None and again.results == []  # nothing reached the memory stage
    carried = again.answers["quarters"]
    assert carried["chain_key"] == first.answers["quarters"]["chain_key"]
    assert carried["answered_in_run"] == "run-1" and carried["answer"]

    (reports / "2023-q3.txt").write_text("The third quarter report adds fact-ipad plainly.")
    changed = run_stages(reports, store_url, "run-3", (quarters(),))
    assert changed.engine is not None
    row = changed.answers["quarters"]
    assert row["chain_key"] != carried["chain_key"] and row["answered_in_run"] == "run-3"
    assert "fact-ipad" in row["answer"] and "fact-iphone" in row["answer"]


def test_a_collection_chain_killed_in_step_k_resumes_there(reports: Path, store_url: str) -> None:
    crashing = FactEngine(fail_on_call=3, failure=EngineCrash("killed in call 3"))
    with pytest.raises(EngineCrash):
        run_stages(reports, store_url, "run-1", (quarters(),), engine=crashing)
    resumed = run_stages(reports, store_url, "run-1", (quarters(),))  # attempt 2
    (result,) = resumed.results
    assert (result["status"], result["start_step"], result["steps_run"]) == ("done", 2, 2)
    assert resumed.engine is not None
    # its first step read the memory checkpointed after doc 2, not the initial one
    assert "fact-iphone" in str(tagged(resumed.engine.requests[0].prompt, "memory"))
    assert "fact-iphone" in resumed.answers["quarters"]["answer"]


def test_progress_says_how_many_members_a_stopped_chain_has_read(
    reports: Path, store_url: str
) -> None:
    import io

    from rich.console import Console

    from pipeline.cli.progress import progress_lines

    crashing = FactEngine(fail_on_call=2, failure=EngineCrash("killed in call 2"))
    with pytest.raises(EngineCrash):  # after the first member's one segment
        run_stages(reports, store_url, "run-1", (quarters(),), engine=crashing)
    with sqlite3.connect(store_url.removeprefix("sqlite:///")) as connection:
        query = "SELECT metadata FROM documents WHERE parser = 'collection'"
        (metadata,) = [json.loads(text) for (text,) in connection.execute(query)]
    connection.close()
    assert metadata["member_segments"] == [1, 1, 1]  # each member's segments, in order
    store = StateStore(store_url)
    progress = store.progress("run-1", 1)
    assert (progress.steps_done, progress.members_done, progress.members_planned) == (1, 1, 3)
    out = io.StringIO()
    progress_lines(Console(file=out, width=200))(progress)
    assert out.getvalue().startswith("model calls 1/4, chains answered 0/1, documents read 1/3, ")

    run_stages(reports, store_url, "run-1", (quarters(),))  # attempt 2 reads the rest
    assert store.progress("run-1", 2) == replace(
        progress, steps_done=4, chains_done=1, members_done=3
    )
    store.close()


def without_chain(row: dict[str, Any]) -> dict[str, Any]:
    """A trajectory row but for the run and the chain it is listed under."""
    return {name: value for name, value in row.items() if name not in ("run_id", "chain_key")}


def test_a_grown_collection_continues_from_the_memory_after_its_last_member(
    reports: Path, store_url: str
) -> None:
    third = reports / "2023-q3.txt"
    third.unlink()
    first = run_stages(reports, store_url, "run-1", (quarters(),), archive="reports")
    before = first.answers["quarters"]
    assert before["status"] == "done" and "fact-iphone" in before["final_memory"]

    third.write_text(REPORTS["2023-q3.txt"])  # one more quarter, after the last one in order
    grown = run_stages(reports, store_url, "run-2", (quarters(),), archive="reports")
    assert grown.engine is not None
    requests, read = grown.engine.requests, headers_read(grown.engine)
    # its model calls: the third member's segments, then the answer
    assert read and all(header.startswith("## Document 3 of 3: 2023-q3.txt") for header in read)
    assert len(requests) == len(read) + 1
    # from the memory run-1 ended the second member with
    assert tagged(requests[0].prompt, "memory") == before["final_memory"]
    row = grown.answers["quarters"]
    assert row["chain_key"] != before["chain_key"] and row["answered_in_run"] == "run-2"
    assert row["status"] == "done" and "fact-iphone" in row["answer"]
    carried = before["n_segments"]  # run-1's update steps
    (result,) = grown.results
    assert (result["start_step"], result["steps_run"]) == (carried, len(requests))
    assert json.loads(row["warnings"]) == [
        f"continued from run run-1: members 1-2 unchanged, the {carried} steps that read them "
        "carried over from its chain (q0); read from member 3 of 3"
    ]

    store = StateStore(store_url)
    old, new = list(store.trajectory("run-1", 1)), list(store.trajectory("run-2", 1))
    # the new chain's trajectory is whole: run-1's steps over the first members, as they were
    assert [r["step"] for r in new] == list(range(row["n_segments"] + 1))
    assert [without_chain(r) for r in new[:carried]] == [without_chain(r) for r in old[:carried]]
    assert {r["chain_key"] for r in new} == {row["chain_key"]}
    superseded = [(r["chain_key"], r["change"]) for r in store.superseded("run-2", 1)]
    assert superseded == [(before["chain_key"], "changed")]
    store.close()

    # unchanged since: answered once, and its rows still say what was carried over
    again = run_stages(reports, store_url, "run-3", (quarters(),), archive="reports")
    assert again.engine is None and again.answers["quarters"]["answered_in_run"] == "run-2"
    assert again.answers["quarters"]["warnings"] == row["warnings"]


def test_a_change_earlier_in_the_order_reads_again_from_the_changed_member(
    reports: Path, store_url: str
) -> None:
    first = run_stages(reports, store_url, "run-1", (quarters(),), archive="reports")
    assert first.engine is not None
    after_first = [
        r["memory_after"]
        for r, header in zip(
            StateStore(store_url).trajectory("run-1", 1), headers_read(first.engine), strict=False
        )
        if header.startswith("## Document 1 of 3")
    ][-1]

    (reports / "2023-q2.txt").write_text("The second quarter report says fact-ipad grew plainly.")
    second = run_stages(reports, store_url, "run-2", (quarters(),), archive="reports")
    assert second.engine is not None
    read = headers_read(second.engine)
    assert read[0] == "## Document 2 of 3: 2023-q2.txt"
    assert not any(header.startswith("## Document 1 of") for header in read)
    assert tagged(second.engine.requests[0].prompt, "memory") == after_first
    row = second.answers["quarters"]
    assert "fact-ipad" in row["answer"] and "fact-iphone" not in row["answer"]
    assert "member 1 unchanged" in row["warnings"] and "read from member 2 of 3" in row["warnings"]

    (reports / "2023-q1.txt").write_text("The first quarter report names fact-mac at once.")
    third = run_stages(reports, store_url, "run-3", (quarters(),), archive="reports")
    assert third.engine is not None
    (result,) = third.results
    assert (result["start_step"], result["steps_run"]) == (0, result["n_steps"])
    assert headers_read(third.engine)[0] == "## Document 1 of 3: 2023-q1.txt"
    assert json.loads(third.answers["quarters"]["warnings"]) == []
    assert "fact-mac" in third.answers["quarters"]["answer"]


def test_a_chain_is_continued_only_over_the_segments_its_predecessor_read(
    reports: Path, store_url: str
) -> None:
    first = run_stages(reports, store_url, "run-1", (quarters(),))
    from_key = first.answers["quarters"]["chain_key"]
    store = StateStore(store_url)
    read = [
        Segment("d", r["segment_index"], r["token_start"], r["token_end"], r["char_start"],
                r["char_end"], "")
        for r in store.trajectory("run-1", 1) if r["kind"] == "update"
    ]  # fmt: skip
    record = DocumentRecord("run-1", 1, "collection:other", "other", "other", "0" * 64,
                            "collection", None, (), {}, 10, len(read) + 1)  # fmt: skip
    store.plan_document(record, [PlannedChain("k" * 64, "q0", QUESTION)])
    shifted = [replace(piece, char_end=piece.char_end + 1) for piece in read[:2]]
    assert not store.continue_chain("k" * 64, from_key, shifted)
    assert not store.continue_chain("k" * 64, from_key, read[1:3])  # not its first segments
    assert store.load_checkpoint("k" * 64) == Checkpoint(ChainStatus.PENDING, 0, None)
    assert store.continue_chain("k" * 64, from_key, read[:2])
    memory = list(store.trajectory("run-1", 1))[1]["memory_after"]
    assert store.load_checkpoint("k" * 64) == Checkpoint(ChainStatus.PENDING, 2, memory)
    assert store.carried_steps("k" * 64, from_key) == 2
    assert not store.continue_chain("k" * 64, from_key, read[:2])  # it has run steps now
    store.close()


def test_document_chain_keys_do_not_change_beside_a_collection(
    reports: Path, store_url: str
) -> None:
    alone = run_stages(reports, store_url, "run-1", (), (Question("q0", QUESTION),))
    beside = run_stages(reports, store_url, "run-2", (quarters(),), (Question("q0", QUESTION),))
    assert set(beside.answers) == {*REPORTS, "quarters"}
    for name in REPORTS:
        assert beside.answers[name]["chain_key"] == alone.answers[name]["chain_key"]
    # the documents were answered in run-1: only the collection's chain ran in run-2
    assert [r["doc_id"] for r in beside.results] == [beside.answers["quarters"]["doc_id"]]


def test_a_member_that_fails_to_parse_is_an_errors_row_and_the_collection_answers(
    reports: Path, store_url: str
) -> None:
    (reports / "2023-q4.pdf").write_bytes(b"%PDF-1.4\nnot a PDF at all\n")
    collection = quarters("name", "2023-q*")
    run = run_stages(reports, store_url, "run-1", (collection,))

    assert set(run.errors) == {"2023-q4.pdf"} and run.errors["2023-q4.pdf"]["stage"] == "parse"
    row = run.answers["quarters"]
    assert row["status"] == "done" and "fact-iphone" in row["answer"]
    warnings = json.loads(row["warnings"])
    assert len(warnings) == 1 and warnings[0].startswith("member 2023-q4.pdf (file://")
    assert "skipped: ParseError" in warnings[0]
    assert run.engine is not None
    assert "## Document 3 of 3: 2023-q3.txt" in headers_read(run.engine)


def test_a_collection_with_no_readable_member_is_an_errors_row(
    reports: Path, store_url: str
) -> None:
    (reports / "broken.pdf").write_bytes(b"%PDF-1.4\nnot a PDF at all\n")
    run = run_stages(reports, store_url, "run-1", (quarters("listed", "*.pdf"),))
    assert run.answers == {} and run.engine is None
    assert run.errors["quarters"]["source_uri"] == "collection:quarters"
    assert run.errors["quarters"]["message"] == "no member could be read"
    assert run.errors["broken.pdf"]["stage"] == "parse"


def test_a_collection_whose_headers_overflow_the_window_is_an_errors_row(
    reports: Path, store_url: str
) -> None:
    """The plan checks the questions alone; each segment of a collection is shown after its
    member's header too, which the collection stage checks before any model call."""

    def needed(questions: list[str]) -> int:
        with pytest.raises(ConfigError) as refused:
            check_context_fit(METHOD, questions, WordTokenizer(), 1)
        return int(re.search(r"needs up to (\d+) tokens", str(refused.value))[1])

    (reports / "2023-q4 with a long name that the model reads before each segment.txt").write_text(
        "The fourth quarter report."
    )
    collection = quarters("name", "2023-q*")
    ordered = order_members(
        [Member(name, name, "") for name in sorted(path.name for path in reports.iterdir())],
        "name",
    )
    window = needed([QUESTION])
    assert needed(with_longest_header([QUESTION], ordered)) > window
    small = replace(SPEC, max_model_len=window)
    run = run_stages(reports, store_url, "run-1", (collection,), spec=small)
    assert run.answers == {} and run.engine is None
    assert run.errors["quarters"]["error_type"] == "TooLong"
    assert "max_model_len" in run.errors["quarters"]["message"]


def filings(tmp_path: Path, filed: dict[str, str | None]) -> SqlSource:
    """The reports as rows of an SQLite table, each with its `filed` column (NULL for None)."""
    database = tmp_path / "filings.sqlite"
    with sqlite3.connect(database) as connection:
        connection.execute("CREATE TABLE filings (id INTEGER, name TEXT, body TEXT, filed TEXT)")
        connection.executemany(
            "INSERT INTO filings VALUES (?, ?, ?, ?)",
            [(i, name, REPORTS[name], filed[name]) for i, name in enumerate(REPORTS, 1)],
        )
    connection.close()
    return SqlSource(
        f"sqlite:///{database}",
        "SELECT id, name, body, filed FROM filings",
        text_column="body",
        name_column="name",
        metadata_columns=["filed"],
    )


def assert_read_by_filing_date(run: StagesRun) -> None:
    """The quarters' collection answered, its members read oldest filing first."""
    assert not run.errors and run.answers["quarters"]["status"] == "done"
    assert run.engine is not None
    assert [h for h in headers_read(run.engine) if "continued" not in h] == [
        "## Document 1 of 3: 2023-q2.txt (filed 2023-02-03)",
        "## Document 2 of 3: 2023-q3.txt (filed 2023-05-05)",
        "## Document 3 of 3: 2023-q1.txt (filed 2023-08-04)",
    ]


def test_members_are_read_in_the_order_of_a_source_field(tmp_path: Path, store_url: str) -> None:
    dates = {"2023-q1.txt": "2023-08-04", "2023-q2.txt": "2023-02-03", "2023-q3.txt": "2023-05-05"}
    source = filings(tmp_path, dict(dates))
    run = run_stages(tmp_path, store_url, "run-1", (quarters("metadata.filed"),), source=source)
    assert_read_by_filing_date(run)
    documents = {item.get("document") for item in json.loads(run.answers["quarters"]["evidence"])}
    assert documents == {"doc 1: 2023-q2.txt, filed 2023-02-03"}


@pytest.mark.server
def test_members_are_read_in_the_order_of_an_s3_objects_user_metadata(
    s3_server: S3Server, tmp_path: Path, store_url: str
) -> None:
    from connectors.s3 import S3Source

    bucket = f"reports-{uuid.uuid4().hex[:12]}"
    client = s3_server.client()
    client.create_bucket(Bucket=bucket)
    dates = {"2023-q1.txt": "2023-08-04", "2023-q2.txt": "2023-02-03", "2023-q3.txt": "2023-05-05"}
    for name, text in REPORTS.items():
        client.put_object(
            Bucket=bucket, Key=f"in/{name}", Body=text.encode(), Metadata={"filed": dates[name]}
        )
    source = S3Source(f"s3://{bucket}/in/", endpoint_url=s3_server.endpoint_url)
    by_field = quarters("metadata.filed")
    fetch_order_fields([source], (quarters("metadata.last_modified"), quarters("name")))
    assert not source.user_metadata  # the listing has what those orders need: no HEAD
    fetch_order_fields([source], (replace(by_field, source=1),))
    assert not source.user_metadata  # another source's collection
    fetch_order_fields([source], (by_field,))
    assert source.user_metadata

    run = run_stages(tmp_path, store_url, "run-1", (by_field,), source=source)
    assert_read_by_filing_date(run)


def test_a_collection_whose_member_lacks_the_order_field_is_an_errors_row(
    tmp_path: Path, store_url: str
) -> None:
    dates = {"2023-q1.txt": "2023-08-04", "2023-q2.txt": None, "2023-q3.txt": "2023-05-05"}
    source = filings(tmp_path, dates)
    by_name = replace(quarters("name"), name="by-name")
    run = run_stages(
        tmp_path, store_url, "run-1", (quarters("metadata.filed"), by_name), source=source
    )
    error = run.errors["quarters"]
    where = (error["source_uri"], error["stage"], error["error_type"])
    assert where == ("collection:quarters", "collection", "NoOrderKey")
    assert error["message"] == "no metadata.filed for 2023-q2.txt"
    # the job goes on: the other collection is answered
    assert set(run.answers) == {"by-name"} and run.answers["by-name"]["status"] == "done"


def test_the_spec_names_collections_and_their_keys() -> None:
    def job(**fields: Any) -> JobSpec:
        return JobSpec.from_dict({"sources": ["a"], "output": "o", **fields})

    spec = job(
        collections=[
            {"name": "aapl", "documents": "*AAPL*.pdf", "order_by": "name", "questions": "Q?"}
        ]
    )
    (collection,) = spec.collections
    assert (collection.documents, collection.questions, collection.source) == (
        ("*AAPL*.pdf",),
        ("Q?",),
        None,
    )
    assert resolve_collections(spec) == (
        CollectionPlan("aapl", "name", ("*AAPL*.pdf",), None, (Question("q0", "Q?"),)),
    )
    assert derive_job_key(spec, ()) != derive_job_key(job(), ())
    # a job without collections keeps its key
    plain = job(questions=["Why?"])
    assert derive_job_key(plain, resolve_questions(plain)) == derive_job_key(
        JobSpec.from_dict({"sources": ["a"], "output": "o", "questions": ["Why?"]}),
        resolve_questions(plain),
    )
    by_field = job(collections=[{"name": "x", "questions": "Q?", "order_by": "metadata.filed"}])
    assert resolve_collections(by_field)[0].order_by == "metadata.filed"
    for refused in ("date", "metadata.", "metadata. ", "Name"):
        with pytest.raises(
            JobError,
            match=r"collections\.0\.order_by: order_by must be one of listed, name, mtime ",
        ):
            job(collections=[{"name": "x", "questions": ["Q?"], "order_by": refused}])
    with pytest.raises(JobError, match=r"collections\.0\.questions: .*at least 1 item"):
        job(collections=[{"name": "x", "questions": []}])
    with pytest.raises(JobError, match="collection names must differ: x named twice"):
        job(collections=[{"name": "x", "questions": "Q?"}, {"name": "x", "questions": "Q?"}])
    with pytest.raises(JobError, match=r"unknown key 'glob' in collections\.0"):
        job(collections=[{"name": "x", "questions": "Q?", "glob": "*"}])


# --- run_job: Ray Data, real files, an HTTP engine that replies as FactEngine -----------------


@pytest.fixture(scope="module")
def ray_session() -> Iterator[None]:
    import ray

    ray.init(num_cpus=2, include_dashboard=False, logging_level="WARNING")
    yield
    ray.shutdown()


def test_run_job_answers_a_collection_beside_its_documents(
    ray_session: None, reports: Path, tmp_path: Path
) -> None:
    from tests.chat_server import FactChatServer
    from tests.conftest import TEST_MODEL

    (reports / "2023-q4.pdf").write_bytes(b"%PDF-1.4\nnot a PDF at all\n")
    output = tmp_path / "out"
    with FactChatServer() as server:
        spec = JobSpec.from_dict(
            {
                "sources": [str(reports)],
                "output": str(output),
                "questions": ["Which fact does the record name?"],
                "collections": [
                    {"name": "quarters", "order_by": "name", "questions": [QUESTION]},
                    {"name": "notes", "documents": "*.md", "questions": [QUESTION]},
                ],
                "engine": {"kind": "openai", "base_url": server.base_url, "model": server.model,
                           "tokenizer": TEST_MODEL, "max_model_len": 4096},
                "method": {"template": "memagent-reference", "chunk_size": 24,
                           "snap_window": 10, "max_memory_tokens": 64, "max_answer_tokens": 32},
                "concurrency": {"read_tasks": 1},
            }
        )  # fmt: skip
        first = run_job(spec)
        answers = pd.read_parquet(first.outputs["answers"]).set_index("name")
        assert sorted(answers.index) == ["2023-q1.txt", "2023-q2.txt", "2023-q3.txt", "quarters"]
        row = answers.loc["quarters"]
        assert row.source_uri == "collection:quarters" and row.status == "done"
        assert "fact-iphone" in row.answer
        assert "2023-q4.pdf" in json.dumps(list(row.parse_warnings))
        errors = pd.read_parquet(first.outputs["errors"]).set_index("name")
        assert sorted(errors.index) == ["2023-q4.pdf", "notes"]
        assert errors.loc["notes", "message"] == "no document matches *.md"
        trajectory = pd.read_parquet(first.outputs["trajectory"])
        assert (trajectory.source_uri == "collection:quarters").any()

        server.prompts.clear()
        second = run_job(spec)
        assert server.prompts == [] and second.chains_done == second.chains == 4
        assert second.chains_skipped == 4
