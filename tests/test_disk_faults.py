"""A full disk under the job's output (issue 18): the Parquet export of `run_job`, and of
`memstream run`, meets ENOSPC on a small tmpfs that the test mounts at the output folder (as
root), while the state store (SQLite) lives elsewhere. The engine is the fake engine behind
a real OpenAI-compatible server on loopback (tests/chat_server.py).

Expected: the job stops with one line that names the output and the cause and says the answers
are kept; the run is marked failed; nothing the failed export wrote is left to fill the disk or
to pass for a result; once the disk is bigger, a rerun of the same spec asks the model nothing
and writes complete tables. `memstream run` keeps its log file under the output folder, on the
same disk: when the log is what fills it, the command still ends with that one line."""

from __future__ import annotations

import errno
import os
import re
import sqlite3
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pyarrow.parquet as pq
import pytest
import yaml

from connectors.engines.fake import FACT
from connectors.state.schema import FAILED
from pipeline.cli.flags import EXIT_USAGE
from pipeline.job import JobError, JobSpec, run_job
from tests.chat_server import FactChatServer, fact_job_fields, write_reports
from tests.conftest import local_ray
from tests.test_storage_faults import assert_complete, local_parquet

pytestmark = pytest.mark.server

REPORTS = 8
# Measured with pyarrow 26 (a tmpfs counts whole 4 KiB pages): the answers table of the job
# below takes 5 pages (17.6 kB), the trajectory 3 (9 kB), errors and superseded 1 each. 24 KiB
# holds the answers, not the trajectory: the disk fills up in the middle of the export.
FULL_DISK_KIB = 24
ROOMY_DISK_KIB = 16 * 1024
NO_SPACE = "No space left on device"
KEPT = "the answers are kept in the state store: run the job again to export them"


class Tmpfs:
    """A tmpfs this test mounts at `path` and unmounts (lazily, if something still holds it)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.mounted = False

    def mount(self, size_kib: int) -> None:
        self.path.mkdir(parents=True, exist_ok=True)
        mount = ["mount", "-t", "tmpfs", "-o", f"size={size_kib}k", "tmpfs", str(self.path)]
        result = subprocess.run(mount, capture_output=True, text=True, check=False)
        if result.returncode != 0:
            reason = f"cannot mount a tmpfs at {self.path}: {result.stderr.strip()}"
            if os.environ.get("CI"):
                pytest.fail(reason)
            pytest.skip(reason)
        self.mounted = True

    def resize(self, size_kib: int) -> None:
        remount = ["mount", "-o", f"remount,size={size_kib}k", str(self.path)]
        subprocess.run(remount, capture_output=True, text=True, check=True)

    def used_bytes(self) -> int:
        stats = os.statvfs(self.path)
        return (stats.f_blocks - stats.f_bfree) * stats.f_frsize

    def files_bytes(self) -> int:
        """The space its files take (tmpfs gives whole pages)."""
        return sum(path.stat().st_blocks * 512 for path in self.path.rglob("*") if path.is_file())

    def unmount(self) -> None:
        if not self.mounted:
            return
        path = str(self.path)
        if subprocess.run(["umount", path], capture_output=True, check=False).returncode != 0:
            subprocess.run(["umount", "-l", path], capture_output=True, check=True)
        self.mounted = False


@pytest.fixture
def small_disk(tmp_path: Path) -> Iterator[Tmpfs]:
    """The job's output folder, not yet mounted (the test chooses the size); always unmounted."""
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root: these tests run as root on CI and the dev box")
    disk = Tmpfs(tmp_path / "out")
    try:
        yield disk
    finally:
        disk.unmount()


@pytest.fixture(scope="module")
def ray_session() -> Iterator[None]:
    with local_ray():
        yield


@pytest.fixture
def chat_server() -> Iterator[FactChatServer]:
    server = FactChatServer().start()
    yield server
    server.stop()


def job_fields(server: FactChatServer, tmp_path: Path, output: Path) -> dict[str, Any]:
    """The job as a user writes it, its state store outside the output folder, so that only the
    export meets the full disk."""
    return fact_job_fields(
        server,
        [str(tmp_path / "inputs")],
        str(output),
        state_store=f"sqlite:///{tmp_path / 'state.sqlite'}",
    )


def run_status(tmp_path: Path, run_id: str) -> str:
    with sqlite3.connect(f"file:{tmp_path / 'state.sqlite'}?mode=ro", uri=True) as connection:
        (status,) = connection.execute(
            "SELECT status FROM runs WHERE run_id = ?", (run_id,)
        ).fetchone()
    return str(status)


def failed_run_folder(message: str, output: Path) -> Path:
    """The run's folder, as the one line of the failure names it."""
    pattern = rf"cannot write the results to {re.escape(str(output))}/(run-[\w-]+)/"
    named = re.match(pattern, message)
    assert named, message
    return output / named.group(1)


def assert_nothing_misleading_left(folder: Path) -> None:
    """What the failed export left: whole tables only (each one readable), no manifest (the
    run's results are not all there) and no partial file filling the disk."""
    left = sorted(path.name for path in folder.iterdir())
    assert "manifest.json" not in left and not [n for n in left if n.endswith(".partial")], left
    for name in left:
        pq.read_metadata(folder / name)


def test_a_full_disk_during_the_parquet_export_fails_the_job_then_a_rerun_exports(
    ray_session: None, chat_server: FactChatServer, small_disk: Tmpfs, tmp_path: Path
) -> None:
    facts = write_reports(tmp_path / "inputs", count=REPORTS)
    spec = JobSpec.from_dict(job_fields(chat_server, tmp_path, small_disk.path))
    small_disk.mount(FULL_DISK_KIB)

    with pytest.raises(JobError) as failure:
        run_job(spec)
    message = str(failure.value)
    assert "\n" not in message and NO_SPACE in message and message.endswith(KEPT), message
    folder = failed_run_folder(message, small_disk.path)
    assert run_status(tmp_path, folder.name) == FAILED
    # the disk filled up in the middle of the export: the answers table fit, the trajectory not
    assert (folder / "answers.parquet").exists() and not (folder / "trajectory.parquet").exists()
    assert_nothing_misleading_left(folder)
    assert small_disk.used_bytes() == small_disk.files_bytes()  # no removed file holds space
    asked = chat_server.chat_requests
    assert chat_server.answered == asked > 0

    small_disk.resize(ROOMY_DISK_KIB)
    rerun = run_job(spec)
    assert rerun.run_id == folder.name and rerun.attempt == 2
    assert rerun.chains_skipped == len(facts) and chat_server.chat_requests == asked
    assert_complete(rerun, facts, local_parquet)
    assert Path(rerun.outputs["manifest"]).exists()


def memstream_run(job_file: Path, ray_address: str) -> subprocess.CompletedProcess[str]:
    command = [sys.executable, "-m", "pipeline.cli.main", "run", str(job_file)]
    return subprocess.run(
        [*command, "--ray-address", ray_address],
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
        stdin=subprocess.DEVNULL,
    )


LOG_LINE = b"a library that has a lot to say, and says it to stderr\n"
LOGGING_DISK_KIB = 1024


def fill_the_log(disk: Tmpfs) -> None:
    """Appends to `memstream run`'s log file until the disk is full: the log is what fills it."""
    (log,) = disk.path.glob("logs/run-*.log")
    descriptor = os.open(log, os.O_WRONLY | os.O_APPEND)
    try:
        while True:
            os.write(descriptor, LOG_LINE * 64)
    except OSError as error:
        assert error.errno == errno.ENOSPC, error
    finally:
        os.close(descriptor)


def test_memstream_run_whose_log_fills_the_disk_ends_with_one_line_then_a_rerun_exports(
    ray_session: None, chat_server: FactChatServer, small_disk: Tmpfs, tmp_path: Path
) -> None:
    """`memstream run` points its stdout and stderr (where Ray, the workers and the libraries
    print) at a log file under the output folder. Here that log fills the disk at the first
    model call: whatever is printed after is lost, and the export meets the full disk."""
    import ray

    facts = write_reports(tmp_path / "inputs", count=REPORTS)
    job_file = tmp_path / "job.yaml"
    job_file.write_text(yaml.safe_dump(job_fields(chat_server, tmp_path, small_disk.path)))
    address = ray.get_runtime_context().gcs_address
    small_disk.mount(LOGGING_DISK_KIB)
    chat_server.before_reply = lambda request: fill_the_log(small_disk) if request == 1 else None

    result = memstream_run(job_file, address)
    assert small_disk.used_bytes() == LOGGING_DISK_KIB * 1024  # the log filled the disk
    assert result.returncode == EXIT_USAGE, result.stderr[-3000:]
    assert "Traceback" not in result.stderr and "Traceback" not in result.stdout
    (line,) = [line for line in result.stderr.splitlines() if "error" in line.lower()]
    assert line.startswith("memstream: error: cannot write the results to "), line
    assert NO_SPACE in line and KEPT in line, line
    assert f"(log: {small_disk.path}/logs/run-" in line, line
    folder = failed_run_folder(line.removeprefix("memstream: error: "), small_disk.path)
    assert run_status(tmp_path, folder.name) == FAILED
    assert_nothing_misleading_left(folder)
    asked = chat_server.chat_requests
    chat_server.before_reply = None

    small_disk.resize(ROOMY_DISK_KIB)
    rerun = memstream_run(job_file, address)
    assert rerun.returncode == 0, rerun.stderr[-3000:]
    assert chat_server.chat_requests == asked
    answers = local_parquet(str(folder / "answers.parquet"))
    assert sorted(answers.name) == sorted(facts) and (answers.status == "done").all()
    for row in answers.itertuples():
        assert set(FACT.findall(row.answer)) == facts[row.name], row.answer
    assert (folder / "manifest.json").exists()
