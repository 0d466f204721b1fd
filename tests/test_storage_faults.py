"""The S3 server and the state database failing in the middle of a job (issue 18, item 1):
`run_job` through Ray Data and the Parquet export, on a SeaweedFS of this module's own that the
tests stop and start again, on SQLite files they remove or lock from another process, and on
the session's PostgreSQL, which they restart. The engine is the fake engine behind a real
OpenAI-compatible server on loopback (tests/chat_server.py): the faults are not in it.

Expected: a short outage is ridden out (S3: the retries of connectors.output; PostgreSQL: the
store's reconnection); a long one, a removed file or a lock held past the busy timeout stops the
job with one line (JobError), and a rerun finishes it, each answer once."""

from __future__ import annotations

import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pandas as pd
import pyarrow.fs as pafs
import pyarrow.parquet as pq
import pytest
import sqlalchemy as sa

from connectors.engines.fake import FACT
from connectors.state.records import RunProgress
from pipeline.job import JobError, JobSpec, RunSummary, run_job
from tests.chat_server import FactChatServer, fact_job, reports, write_reports
from tests.conftest import local_ray

if TYPE_CHECKING:
    from connectors.seaweedfs import SeaweedFS
    from tests.services import PostgresServer

pytestmark = pytest.mark.server

FAULT_AT_REQUEST = 3  # model calls answered before the fault


@pytest.fixture(scope="module")
def ray_session(restartable_s3: SeaweedFS) -> Iterator[None]:
    """Started after the S3 server, so its workers have the AWS_* variables."""
    with local_ray():
        yield


@pytest.fixture
def chat_server() -> Iterator[FactChatServer]:
    server = FactChatServer().start()
    yield server
    server.stop()


def assert_complete(summary: RunSummary, facts: dict[str, set[str]], read: Callable[[str], Any]):  # type: ignore[no-untyped-def]
    """Every report answered once, with all its facts, each chain's steps once and in order."""
    assert summary.ok and summary.chains_done == len(facts)
    answers = read(summary.outputs["answers"])
    trajectory = read(summary.outputs["trajectory"])
    assert sorted(answers.name) == sorted(facts) and (answers.status == "done").all()
    for row in answers.itertuples():
        assert set(FACT.findall(row.answer)) == facts[row.name], row.answer
        steps = trajectory[trajectory.chain_key == row.chain_key].step.tolist()
        assert sorted(steps) == list(range(row.n_segments + 1)), steps


def local_parquet(uri: str) -> pd.DataFrame:
    return pd.read_parquet(uri)


# --- S3 ------------------------------------------------------------------------------------------


def s3_reports(weed: SeaweedFS) -> tuple[str, dict[str, set[str]]]:
    """The reports as objects under a new bucket's in/ prefix: (bucket, each one's facts)."""
    bucket = f"faults-{uuid.uuid4().hex[:10]}"
    client = weed.server.client()
    client.create_bucket(Bucket=bucket)
    for name, (text, _) in reports().items():
        client.put_object(Bucket=bucket, Key=f"in/{name}", Body=text.encode())
    return bucket, {name: facts for name, (_, facts) in reports().items()}


def s3_parquet(weed: SeaweedFS) -> Callable[[str], pd.DataFrame]:
    filesystem = pafs.S3FileSystem(endpoint_override=weed.server.endpoint_url)
    return lambda uri: pq.read_table(uri.removeprefix("s3://"), filesystem=filesystem).to_pandas()


class Outage:
    """Stops the S3 server when `when(progress)` first holds (in the job's progress callback)
    and, unless `restart_after_s` is None, starts it again that many seconds later."""

    def __init__(
        self,
        weed: SeaweedFS,
        when: Callable[[RunProgress], bool],
        restart_after_s: float | None,
    ) -> None:
        self.weed, self.when, self.restart_after_s = weed, when, restart_after_s
        self.stopped_at: float | None = None
        self.back_at: float | None = None
        self._restart: threading.Thread | None = None

    def __call__(self, progress: RunProgress) -> None:
        if self.stopped_at is not None or not self.when(progress):
            return
        self.weed.stop()
        self.stopped_at = time.time()
        if self.restart_after_s is not None:
            self._restart = threading.Thread(target=self._start_later)
            self._restart.start()

    def _start_later(self) -> None:
        assert self.restart_after_s is not None
        time.sleep(self.restart_after_s)
        self.weed.start()
        self.back_at = time.time()

    def wait(self) -> None:
        if self._restart is not None:
            self._restart.join()


def stopped_by(outage: Outage, spec: JobSpec, progress_interval_s: float) -> str:
    """The one line of the JobError that the outage (with no restart) stops the job with; the
    server is started again after."""
    try:
        with pytest.raises(JobError) as failure:
            run_job(spec, on_progress=outage, progress_interval_s=progress_interval_s)
    finally:
        outage.weed.start()
    message = str(failure.value)
    assert "\n" not in message
    return message


def at_start(progress: RunProgress) -> bool:
    return True


def all_answered(progress: RunProgress) -> bool:
    return progress.chains_planned > 0 and progress.chains_done == progress.chains_planned


def s3_job(
    chat_server: FactChatServer,
    weed: SeaweedFS,
    bucket: str,
    output: str | dict[str, Any],
    tmp_path: Path,
    max_attempts: int | None = None,
) -> JobSpec:
    source: dict[str, Any] = {
        "type": "s3",
        "uri": f"s3://{bucket}/in/",
        "endpoint_url": weed.server.endpoint_url,
    }
    if max_attempts is not None:
        source["max_attempts"] = max_attempts
    return fact_job(
        chat_server, [source], output, state_store=f"sqlite:///{tmp_path / 'state.sqlite'}"
    )


def test_short_s3_outage_while_reading_is_retried(
    ray_session: None, restartable_s3: SeaweedFS, chat_server: FactChatServer, tmp_path: Path
) -> None:
    bucket, facts = s3_reports(restartable_s3)
    outage = Outage(restartable_s3, at_start, restart_after_s=2)
    spec = s3_job(chat_server, restartable_s3, bucket, str(tmp_path / "out"), tmp_path)
    try:
        summary = run_job(spec, on_progress=outage, progress_interval_s=0.01)
    finally:
        outage.wait()  # the server is back for the next test, whatever this one did
    assert outage.stopped_at is not None and outage.back_at is not None
    assert_complete(summary, facts, local_parquet)
    assert summary.errors == 0


def test_short_s3_outage_during_the_parquet_export_is_retried(
    ray_session: None, restartable_s3: SeaweedFS, chat_server: FactChatServer, tmp_path: Path
) -> None:
    bucket, facts = s3_reports(restartable_s3)
    outage = Outage(restartable_s3, all_answered, restart_after_s=2)
    output = {"uri": f"s3://{bucket}/out", "s3_endpoint_url": restartable_s3.server.endpoint_url}
    spec = s3_job(chat_server, restartable_s3, bucket, output, tmp_path)
    try:
        summary = run_job(spec, on_progress=outage, progress_interval_s=0.2)
    finally:
        outage.wait()
    assert outage.stopped_at is not None and outage.back_at is not None
    assert_complete(summary, facts, s3_parquet(restartable_s3))


def test_long_s3_outage_during_the_export_fails_the_job_then_a_rerun_exports(
    ray_session: None, restartable_s3: SeaweedFS, chat_server: FactChatServer, tmp_path: Path
) -> None:
    bucket, facts = s3_reports(restartable_s3)
    outage = Outage(restartable_s3, all_answered, restart_after_s=None)
    output = {
        "uri": f"s3://{bucket}/out",
        "s3_endpoint_url": restartable_s3.server.endpoint_url,
        "s3_max_attempts": 2,
    }
    spec = s3_job(chat_server, restartable_s3, bucket, output, tmp_path, max_attempts=2)
    message = stopped_by(outage, spec, progress_interval_s=0.2)
    assert message.startswith(f"cannot write the results to s3://{bucket}/out/run-")
    assert message.endswith(
        "the answers are kept in the state store: run the job again to export them"
    )
    calls = chat_server.chat_requests
    rerun = run_job(spec)
    assert rerun.attempt == 2 and rerun.chains_skipped == len(facts)
    assert chat_server.chat_requests == calls  # nothing asked again
    assert_complete(rerun, facts, s3_parquet(restartable_s3))


def test_long_s3_outage_while_reading_fails_the_job_then_a_rerun_finishes(
    ray_session: None, restartable_s3: SeaweedFS, chat_server: FactChatServer, tmp_path: Path
) -> None:
    bucket, facts = s3_reports(restartable_s3)
    outage = Outage(restartable_s3, at_start, restart_after_s=None)
    spec = s3_job(
        chat_server, restartable_s3, bucket, str(tmp_path / "out"), tmp_path, max_attempts=2
    )
    message = stopped_by(outage, spec, progress_interval_s=0.01)
    # refused, or answered 500 by a SeaweedFS half-way through stopping: one line either way
    unreachable = message.startswith(f"cannot reach S3 for s3://{bucket}/in/")
    assert unreachable or message.startswith(f"S3 error on s3://{bucket}/in/"), message
    assert "\n" not in message and (not unreachable or "after 2 attempts" in message)
    rerun = run_job(spec)
    assert rerun.attempt == 2
    assert_complete(rerun, facts, local_parquet)
    assert rerun.errors == 0  # the outage left no document in errors


# --- the state database ---------------------------------------------------------------------


def sqlite_job(chat_server: FactChatServer, tmp_path: Path, store: str) -> JobSpec:
    return fact_job(
        chat_server, [str(tmp_path / "inputs")], str(tmp_path / "out"), state_store=store
    )


def test_sqlite_file_removed_mid_run_fails_the_run_with_one_line(
    ray_session: None, chat_server: FactChatServer, tmp_path: Path
) -> None:
    facts = write_reports(tmp_path / "inputs")
    database = tmp_path / "state.sqlite"
    spec = sqlite_job(chat_server, tmp_path, f"sqlite:///{database}")

    def remove_the_database(request: int) -> None:
        if request == FAULT_AT_REQUEST:
            for path in tmp_path.glob("state.sqlite*"):  # with its -wal and -shm
                path.unlink()

    chat_server.before_reply = remove_the_database
    with pytest.raises(JobError) as failure:
        run_job(spec)
    message = str(failure.value)
    assert "\n" not in message
    assert f"the database file {database} is gone: it was removed while in use" in message
    chat_server.before_reply = None
    rerun = run_job(spec)  # a new database: the run starts over
    assert rerun.attempt == 1
    assert_complete(rerun, facts, local_parquet)


LOCK_HOLDER = """
import sqlite3, sys, time
connection = sqlite3.connect(sys.argv[1], isolation_level=None)
connection.execute("BEGIN EXCLUSIVE")
print("locked", flush=True)
time.sleep(float(sys.argv[2]))
connection.execute("COMMIT")
"""


def hold_write_lock(database: Path, seconds: float) -> subprocess.Popen[str]:
    """Another process that takes the database's write lock for `seconds`; returns once held."""
    holder = subprocess.Popen(
        [sys.executable, "-c", LOCK_HOLDER, str(database), str(seconds)],
        stdout=subprocess.PIPE,
        text=True,
    )
    assert holder.stdout is not None and holder.stdout.readline().strip() == "locked"
    return holder


@pytest.mark.parametrize(("held_s", "recovers"), [(1.0, True), (8.0, False)])
def test_sqlite_locked_by_another_process_waits_its_busy_timeout(
    ray_session: None, chat_server: FactChatServer, tmp_path: Path, held_s: float, recovers: bool
) -> None:
    facts = write_reports(tmp_path / "inputs")
    database = tmp_path / "state.sqlite"
    spec = sqlite_job(chat_server, tmp_path, f"sqlite:///{database}?timeout=3")
    holders: list[subprocess.Popen[str]] = []

    def lock(request: int) -> None:
        if request == FAULT_AT_REQUEST:
            holders.append(hold_write_lock(database, held_s))

    chat_server.before_reply = lock
    try:
        if recovers:
            assert_complete(run_job(spec), facts, local_parquet)
            return
        with pytest.raises(JobError) as failure:
            run_job(spec)
    finally:
        for holder in holders:
            holder.wait(timeout=30)
    message = str(failure.value)
    assert "\n" not in message
    assert (
        "database is locked: another process held its write lock over the busy timeout of 3 s"
        in message
    )
    chat_server.before_reply = None
    rerun = run_job(spec)
    assert rerun.attempt == 2 and rerun.chains_resumed + rerun.chains_skipped == len(facts)
    assert_complete(rerun, facts, local_parquet)


def test_postgres_restart_mid_run_is_waited_for_and_the_run_recovers(
    ray_session: None,
    chat_server: FactChatServer,
    postgres_server: PostgresServer,
    tmp_path: Path,
) -> None:
    facts = write_reports(tmp_path / "inputs")
    schema = f"s{uuid.uuid4().hex[:10]}"
    with sa.create_engine(postgres_server.url).begin() as connection:
        connection.exec_driver_sql(f"CREATE SCHEMA {schema}")
    spec = sqlite_job(
        chat_server, tmp_path, f"{postgres_server.url}?options=-csearch_path%3D{schema}"
    )
    restarted: list[float] = []

    def restart(request: int) -> None:
        if request == FAULT_AT_REQUEST:  # down now, back in 3 s: the next writes meet it down
            postgres_server.stop()
            restarted.append(time.time())

            def start_later() -> None:
                time.sleep(3)
                assert postgres_server.start() is None

            threading.Thread(target=start_later).start()

    chat_server.before_reply = restart
    summary = run_job(spec)
    assert restarted, "the server was not restarted"
    assert_complete(summary, facts, local_parquet)
    assert summary.attempt == 1
