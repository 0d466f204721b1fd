"""The state store's schema life: Alembic migrations (a new database, a database made before
migrations existed, one at the first revision with rows, a second run; the migrated schema is
`schema.py`'s), the Serve job claim, which never hands a job to two replicas, the run lock,
which never lets two runs hold one archive, and a chain continued from another over the same
first segments (a grown collection) with the previous run's document it is found by, on SQLite
and PostgreSQL."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import threading
import time
from dataclasses import replace
from pathlib import Path

import pytest
import sqlalchemy as sa
from alembic import command
from alembic.autogenerate import compare_metadata
from alembic.config import Config
from alembic.migration import MigrationContext

from connectors.state import locks, schema
from connectors.state.database import MIGRATIONS
from connectors.state.records import (
    Checkpoint,
    DocumentRecord,
    LockHolder,
    NewJob,
    StepCheckpoint,
)
from connectors.state.store import StateStore
from operators.core.chain import ChainStatus, StepKind, StepRecord
from operators.core.document import PlannedChain
from operators.core.segmentation import Segment

TABLES = {table.name for table in schema.metadata.sorted_tables}
HEAD = "0003"


def migrate_to(url: str, revision: str) -> None:
    config = Config()
    config.set_main_option("script_location", str(MIGRATIONS))
    engine = sa.create_engine(url)
    with engine.begin() as connection:
        config.attributes["connection"] = connection
        command.upgrade(config, revision)
    engine.dispose()


def alembic_revision(url: str) -> list[str]:
    with sa.create_engine(url).connect() as connection:
        return list(
            connection.execute(sa.text("SELECT version_num FROM alembic_version")).scalars()
        )


def test_a_new_database_gets_every_table_at_the_newest_revision(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'new' / 'state.sqlite'}"
    store = StateStore(url)
    store.migrate()
    store.migrate()  # a second replica or run: nothing to do
    store.close()
    tables = set(sa.inspect(sa.create_engine(url)).get_table_names())
    assert tables == TABLES | {"alembic_version"}
    assert alembic_revision(url) == [HEAD]


def test_a_database_made_before_migrations_keeps_its_rows_and_gains_the_missing_tables(
    tmp_path: Path,
) -> None:
    url = f"sqlite:///{tmp_path / 'old.sqlite'}"
    engine = sa.create_engine(url)
    # What a Serve job store of the previous version created: its own tables and the chains'.
    old_tables = [schema.jobs, schema.events, schema.chains, schema.steps]
    schema.metadata.create_all(engine, tables=old_tables)
    with engine.begin() as connection:
        connection.exec_driver_sql("ALTER TABLE chains DROP COLUMN answered_in_run")  # newer
        connection.exec_driver_sql("ALTER TABLE steps DROP COLUMN reread_spans")  # newer
        connection.execute(
            sa.insert(schema.jobs).values(
                job_id="j1", status="queued", name="a.txt", source="upload:a.txt",
                questions='["Q?"]', method="{}", created_at=1.0, updated_at=1.0,
            )
        )  # fmt: skip
    engine.dispose()

    store = StateStore(url)
    store.migrate()
    job = store.get_job("j1")
    store.close()
    assert job is not None and job.questions == ("Q?",)
    assert set(sa.inspect(sa.create_engine(url)).get_table_names()) == TABLES | {"alembic_version"}
    assert alembic_revision(url) == [HEAD]


@pytest.mark.parametrize("database", ["sqlite", pytest.param("postgres", marks=pytest.mark.server)])
def test_replicas_claiming_at_once_never_get_the_same_job(
    database: str, request: pytest.FixtureRequest
) -> None:
    url = request.getfixturevalue(f"{database}_url")
    setup = StateStore(url)
    setup.migrate()
    new = NewJob("a.txt", "upload:a.txt", ("Q?",), {}, data=b"text")
    created = {setup.create_job(new) for _ in range(40)}
    claimed: dict[str, list[str]] = {}
    start = threading.Barrier(4)

    def replica(owner: str) -> None:
        store = StateStore(url)
        start.wait()
        mine: list[str] = []
        while batch := store.claim_jobs(owner, 60, 3):
            mine.extend(batch)
        claimed[owner] = mine
        store.close()

    threads = [threading.Thread(target=replica, args=(f"replica-{i}",)) for i in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=120)
    every_claim = [job for jobs in claimed.values() for job in jobs]
    ours = [job for job in every_claim if job in created]
    assert sorted(ours) == sorted(created)  # each job exactly once
    assert len(ours) == len(set(ours))
    setup.close()


def test_the_migrated_schema_is_the_one_the_code_uses(empty_store_url: str) -> None:
    StateStore(empty_store_url).migrate()
    engine = sa.create_engine(empty_store_url)
    with engine.connect() as connection:
        differences = compare_metadata(MigrationContext.configure(connection), schema.metadata)
    engine.dispose()
    assert differences == []


def test_a_database_at_the_first_revision_keeps_its_runs_and_answers(empty_store_url: str) -> None:
    """Revision 0002 on a database of 0001 with a finished run: the run's id was its job key,
    and its answered chains were answered by it."""
    migrate_to(empty_store_url, "0001")
    engine = sa.create_engine(empty_store_url)
    with engine.begin() as connection:
        connection.exec_driver_sql(
            "INSERT INTO runs (run_id, attempt, status, created_at, started_at)"
            " VALUES ('run-0123456789ab', 1, 'done', 1.0, 1.0)"
        )
        for key, status in (("k-done", "done"), ("k-failed", "failed")):
            connection.exec_driver_sql(
                "INSERT INTO chains (chain_key, run_id, doc_id, source_uri, question_id, question,"
                " status, step, n_segments, n_tokens, prompt_tokens, completion_tokens,"
                f" compute_s, created_at, updated_at) VALUES ('{key}', 'run-0123456789ab', 'd',"
                f" 'file:///a', 'q0', 'Q?', '{status}', 1, 1, 9, 0, 0, 0.0, 1.0, 1.0)"
            )
    StateStore(empty_store_url).migrate()
    with engine.connect() as connection:
        run = connection.execute(sa.select(schema.runs)).mappings().one()
        chains = sa.select(schema.chains.c.chain_key, schema.chains.c.answered_in_run)
        answered_in = {key: run_id for key, run_id in connection.execute(chains)}
    engine.dispose()
    assert alembic_revision(empty_store_url) == [HEAD]
    assert (run["job_key"], run["archive_key"], run["status"]) == ("run-0123456789ab", None, "done")
    assert answered_in == {"k-done": "run-0123456789ab", "k-failed": None}
    # the job's next run is numbered after it
    begun = StateStore(empty_store_url).begin_run(
        None, {}, job_key="run-0123456789ab", archive_key="archive-x"
    )
    assert (begun.run_id, begun.attempt, begun.previous_run_id) == ("run-0123456789ab-2", 1, None)


def test_a_database_at_the_second_revision_keeps_its_steps_and_gains_reread_spans(
    empty_store_url: str,
) -> None:
    """Revision 0003 on a database of 0002: its steps stay, with no re-read passages."""
    migrate_to(empty_store_url, "0002")
    engine = sa.create_engine(empty_store_url)
    with engine.begin() as connection:
        connection.exec_driver_sql(
            "INSERT INTO steps (chain_key, step, kind, memory_after, prompt_tokens,"
            " completion_tokens, latency_s, created_at)"
            " VALUES ('k', 0, 'final', 'A', 1, 1, 0.1, 1.0)"
        )
    StateStore(empty_store_url).migrate()
    with engine.connect() as connection:
        row = connection.execute(sa.select(schema.steps)).mappings().one()
    engine.dispose()
    assert alembic_revision(empty_store_url) == [HEAD]
    assert (row["memory_after"], row["reread_spans"]) == ("A", None)


# --- a chain continued from another (a grown collection) ----------------------------------------

QUESTION = "What changed?"


def piece(index: int, char_start: int) -> Segment:
    return Segment("d", index, 10 * index, 10 * index + 10, char_start, char_start + 40, "text")


def plan_chain(store: StateStore, run_id: str, uri: str, chain_key: str, n_segments: int) -> None:
    record = DocumentRecord(run_id, 1, uri, uri, uri, "0" * 64, "collection", None, (), {},
                            10 * n_segments, n_segments)  # fmt: skip
    store.plan_document(record, [PlannedChain(chain_key, "q0", QUESTION)])


def update_step(
    chain_key: str, step: int, segment: Segment, quotes: tuple[str, ...] = ()
) -> StepCheckpoint:
    """Update step `step` of the chain over `segment`, as `pipeline.resume` records it."""
    record = StepRecord(
        chain_key, step, StepKind.UPDATE.value, segment.index, segment.token_start,
        segment.token_end, segment.char_start, segment.char_end, f"memory {step + 1}",
        100 + step, 10 + step, "stop", 0.5 + step, rejected_quotes=quotes,
    )  # fmt: skip
    return StepCheckpoint(record, step + 1, f"memory {step + 1}", False, None, None)


def step_rows(store: StateStore, run_id: str) -> list[dict[str, object]]:
    """The run's trajectory rows (with their rejected quotes) but for whose chain they are."""
    mine = ("run_id", "chain_key", "doc_id", "source_uri")
    return [
        {name: value for name, value in row.items() if name not in mine}
        for row in store.trajectory(run_id, 1)
    ]


def test_a_chain_continues_where_another_stood_after_the_same_first_segments(
    migrated_store: StateStore,
) -> None:
    store, a, b = migrated_store, "a" * 64, "b" * 64
    read = [piece(0, 0), piece(1, 40), piece(2, 80)]
    plan_chain(store, "run-1", "collection:c", a, 3)
    for step, segment in enumerate(read):
        quotes = ("a line it did not find",) if step == 1 else ()
        assert store.record_step(update_step(a, step, segment, quotes))
    grown = [*read[:2], piece(2, 81)]  # the third segment is another one now
    plan_chain(store, "run-2", "collection:c", b, 3)

    assert not store.continue_chain("c" * 64, a, grown[:2])  # no such chain
    assert not store.continue_chain(b, a, [])
    shifted = [read[0], replace(read[1], char_end=read[1].char_end + 1)]
    assert not store.continue_chain(b, a, shifted)  # not the segments A read
    assert not store.continue_chain(b, a, grown)  # A read another third segment
    assert not store.continue_chain(b, a, read[1:])  # not the first segments
    assert store.load_checkpoint(b) == Checkpoint(ChainStatus.PENDING, 0, None)
    assert store.carried_steps(b, a) == 0

    assert store.continue_chain(b, a, grown[:2])
    assert store.load_checkpoint(b) == Checkpoint(ChainStatus.PENDING, 2, "memory 2")
    carried = step_rows(store, "run-2")
    assert carried == step_rows(store, "run-1")[:2]
    assert carried[1]["rejected_quotes"] == '["a line it did not find"]'
    assert store.carried_steps(b, a) == 2
    assert store.carried_steps(a, b) == 2  # the same rows either way
    with store.reader.connect() as connection:
        totals = connection.execute(
            sa.select(
                schema.chains.c.prompt_tokens,
                schema.chains.c.completion_tokens,
                schema.chains.c.compute_s,
            ).where(schema.chains.c.chain_key == b)
        ).one()
    assert tuple(totals) == (100 + 101, 10 + 11, pytest.approx(0.5 + 1.5))
    assert not store.continue_chain(b, a, grown[:2])  # it has run steps now

    # it goes on from there as after a crash: its own third step is no copy
    assert store.record_step(update_step(b, 2, grown[2]))
    assert store.carried_steps(b, a) == 2
    assert [row["char_start"] for row in step_rows(store, "run-2")] == [0, 40, 81]


def test_a_run_finds_a_document_as_the_previous_finished_run_over_its_archive_had_it(
    migrated_store: StateStore,
) -> None:
    store = migrated_store

    def record(run_id: str, attempt: int, uri: str, sha: str) -> DocumentRecord:
        metadata = {"members": ["m1", "m2"], "member_sha256": ["1" * 64, "2" * 64]}
        return DocumentRecord(run_id, attempt, uri, f"doc-{sha}", uri, sha * 64, "collection",
                              None, ("a note", "another"), metadata, 20, 2)  # fmt: skip

    assert store.begin_run("run-1", {}, archive_key="archive").attempt == 1
    store.plan_document(record("run-1", 1, "collection:kept", "1"), [])
    store.plan_document(record("run-1", 1, "collection:dropped", "2"), [])
    assert store.begin_run("run-1", {}, archive_key="archive").attempt == 2  # a second attempt
    store.plan_document(record("run-1", 2, "collection:kept", "3"), [])
    store.finish_run("run-1", "done")
    assert store.previous_document("run-1", "collection:kept") is None  # the archive's first
    assert store.begin_run("run-2", {}, archive_key="archive").previous_run_id == "run-1"
    store.plan_document(record("run-2", 1, "collection:kept", "4"), [])
    store.begin_run("other", {}, archive_key="another archive")
    store.finish_run("other", "done")

    assert store.previous_document("run-2", "collection:kept") == record(
        "run-1", 2, "collection:kept", "3"
    )
    assert store.previous_document("run-2", "collection:dropped") is None  # not in its last attempt
    assert store.previous_document("run-2", "collection:never") is None
    assert store.previous_document("no-such-run", "collection:kept") is None
    store.supersede_previous("run-2", 1)
    store.finish_run("run-2", "done")
    assert store.begin_run("run-3", {}, archive_key="archive").previous_run_id == "run-2"
    assert store.previous_document("run-3", "collection:kept") == record(
        "run-2", 1, "collection:kept", "4"
    )


# --- the run lock -------------------------------------------------------------------------------


def holder(owner: str, *, pid: int | None = None, host: str = "") -> LockHolder:
    now = time.time()
    return LockHolder(owner, host or socket.gethostname(), pid or os.getpid(), now, now + 60)


def never_gone(holder: LockHolder) -> bool:
    return False


def test_a_run_lock_has_one_holder_until_released_or_its_lease_runs_out(
    migrated_store: StateStore,
) -> None:
    first = holder("first")
    assert migrated_store.try_lock("archive-a", first, never_gone) is None
    assert migrated_store.try_lock("archive-a", first, never_gone) is None  # its own: still its
    assert migrated_store.try_lock("archive-a", holder("second"), never_gone) == first
    assert migrated_store.try_lock("archive-b", holder("second"), never_gone) is None  # another
    assert not migrated_store.renew_lock("archive-a", "second", time.time() + 60)
    assert migrated_store.renew_lock("archive-a", "first", time.time() - 1)  # a lease run out
    assert migrated_store.try_lock("archive-a", holder("third"), never_gone) is None
    assert not migrated_store.renew_lock("archive-a", "first", time.time() + 60)  # taken over
    migrated_store.release_lock("archive-a", "first")  # not its holder: nothing happens
    assert migrated_store.try_lock("archive-a", holder("fourth"), never_gone).owner == "third"
    migrated_store.release_lock("archive-a", "third")
    assert migrated_store.try_lock("archive-a", holder("fourth"), never_gone) is None


def test_a_lock_whose_holder_died_on_this_host_is_taken_over_at_once(
    migrated_store: StateStore,
) -> None:
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, text=True, check=True)  # fmt: skip
    dead_holder = holder("dead", pid=int(dead.stdout))
    assert migrated_store.try_lock("archive-a", dead_holder, never_gone) is None
    alive = holder("alive")
    assert migrated_store.try_lock("archive-a", holder("next"), locks.is_gone) is None
    assert migrated_store.try_lock("archive-a", alive, locks.is_gone).owner == "next"
    # a holder on another host is trusted until its lease runs out
    far = holder("far", pid=1, host="elsewhere")
    assert migrated_store.try_lock("archive-b", far, never_gone) is None
    assert migrated_store.try_lock("archive-b", alive, locks.is_gone).owner == "far"


def test_a_second_holder_waits_with_one_line_until_the_first_releases(
    migrated_store: StateStore, caplog: pytest.LogCaptureFixture
) -> None:
    order: list[str] = []
    first_holds, release = threading.Event(), threading.Event()

    def first() -> None:
        with locks.holding(migrated_store, "archive-a", poll_s=0.05):
            order.append("first in")
            first_holds.set()
            release.wait(30)
            order.append("first out")

    thread = threading.Thread(target=first)
    thread.start()
    assert first_holds.wait(30)
    threading.Timer(1.0, release.set).start()
    with (
        caplog.at_level("WARNING", logger="connectors.state.locks"),
        locks.holding(migrated_store, "archive-a", poll_s=0.05),
    ):
        order.append("second in")
    thread.join(30)
    assert order == ["first in", "first out", "second in"]
    waiting = [r.getMessage() for r in caplog.records if "waiting for it to finish" in r.message]
    assert len(waiting) == 1 and f"pid {os.getpid()} on {socket.gethostname()}" in waiting[0]


def test_a_held_lock_is_renewed_while_its_holder_runs(migrated_store: StateStore) -> None:
    with locks.holding(migrated_store, "archive-a", lease_s=0.4) as mine:
        time.sleep(1.0)  # past the first lease: renewed every 0.1 s
        assert migrated_store.try_lock("archive-a", holder("other"), never_gone).owner == mine.owner
    assert migrated_store.try_lock("archive-a", holder("other"), never_gone) is None


@pytest.mark.server
def test_a_connection_dropped_mid_call_is_opened_again_and_the_call_run_again(
    postgres_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    """As in a PostgreSQL restart or failover: the server ends the backend under a call's
    transaction (pg_terminate_backend, "terminating connection due to administrator command");
    the store runs the call again on a new connection, and its write is there once."""
    from tests.services import schema_of_its_own

    store = StateStore(schema_of_its_own(postgres_url))
    store.migrate()
    job_id = store.create_job(NewJob("a.txt", "upload:a.txt", ("Q?",), {}, data=b"text"))
    admin = sa.create_engine(postgres_url)
    ended: list[int] = []

    @sa.event.listens_for(store.writer, "before_cursor_execute")
    def end_the_backend_once(connection, cursor, statement, *_):  # type: ignore[no-untyped-def]
        if not ended and statement.lstrip().upper().startswith("UPDATE"):
            pid = connection.exec_driver_sql("SELECT pg_backend_pid()").scalar()
            with admin.connect() as other:
                other.execute(sa.text("SELECT pg_terminate_backend(:pid)"), {"pid": pid})
            ended.append(pid)

    assert store.cancel_job(job_id)
    assert ended, "no backend was ended: the test did not reach the fault"
    assert "running cancel_job again" in caplog.text
    assert store.get_job(job_id).status == "cancelled"
    store.close()
    admin.dispose()
