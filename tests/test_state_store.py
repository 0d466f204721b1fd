"""The state store's schema life: Alembic migrations (a new database, a database made before
migrations existed, a second run) and the Serve job claim, which never hands a job to two
replicas, on SQLite and PostgreSQL."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest
import sqlalchemy as sa

from connectors.state import schema
from connectors.state.records import NewJob
from connectors.state.store import StateStore

TABLES = {table.name for table in schema.metadata.sorted_tables}


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
    assert alembic_revision(url) == ["0001"]


def test_a_database_made_before_migrations_keeps_its_rows_and_gains_the_missing_tables(
    tmp_path: Path,
) -> None:
    url = f"sqlite:///{tmp_path / 'old.sqlite'}"
    engine = sa.create_engine(url)
    # What a Serve job store of the previous version created: its own tables and the chains'.
    old_tables = [schema.jobs, schema.events, schema.chains, schema.steps]
    schema.metadata.create_all(engine, tables=old_tables)
    with engine.begin() as connection:
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
    assert alembic_revision(url) == ["0001"]


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
