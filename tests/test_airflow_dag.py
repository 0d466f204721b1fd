"""infra/airflow: the nightly DAG loads with Airflow installed, and `airflow dags test` runs its
task end to end on a tiny job, in a subprocess with its own AIRFLOW_HOME and SQLite metadata DB.

The end-to-end job's engine is the `openai` kind pointed at `tests.chat_server`, a real HTTP
server that answers as the fake engine does: these tests check the DAG's mechanics (Airflow runs
the task, the task runs `pipeline.job.run_job` with Ray, the summary reaches XCom, the tables are
written), not a model's answers.
"""

from __future__ import annotations

import json
import os
import signal
import sqlite3
import subprocess
import sys
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import pyarrow.parquet as pq
import pytest

from pipeline.job import load_job_spec
from tests.chat_server import FactChatServer

REPO = Path(__file__).resolve().parents[1]
DAGS = REPO / "infra" / "airflow"
AIRFLOW = Path(sys.executable).with_name("airflow")
# Airflow and Ray start-up take most of it: about 2.5 minutes on 2 shared cores.
DAGS_TEST_TIMEOUT_S = 240

# Airflow reads its home when imported: keep it out of the user's ~/airflow.
os.environ.setdefault("AIRFLOW_HOME", tempfile.mkdtemp(prefix="airflow-home-"))
os.environ.setdefault("AIRFLOW__CORE__LOAD_EXAMPLES", "False")
import airflow  # noqa: E402,F401  (after AIRFLOW_HOME: it is read on import)


@pytest.fixture
def airflow_home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("AIRFLOW_HOME", str(tmp_path))
    monkeypatch.setenv("AIRFLOW__CORE__LOAD_EXAMPLES", "False")
    monkeypatch.setenv("AIRFLOW__CORE__UNIT_TEST_MODE", "True")
    return tmp_path


def load_dag():  # type: ignore[no-untyped-def]
    from airflow.dag_processing.dagbag import DagBag

    bag = DagBag(dag_folder=str(DAGS))
    assert bag.import_errors == {}
    return bag.dags["memstream_nightly"]


def test_the_dag_loads(airflow_home: Path) -> None:
    dag = load_dag()
    assert [t.task_id for t in dag.tasks] == ["run"]
    assert dag.max_active_runs == 1
    assert dag.tasks[0].retries == 2
    assert dag.params["prefix"].startswith("s3://")


def test_the_dag_job_file_is_a_job() -> None:
    spec = load_job_spec(
        DAGS / "job.yaml", {"sources": ["s3://b/p/"], "output": {"uri": "s3://b/o/"}}
    )
    assert spec.sources == ("s3://b/p/",)


# --- `airflow dags test` in a subprocess --------------------------------------------------------


def airflow_env(home: Path, job_file: Path) -> dict[str, str]:
    """The environment of an Airflow CLI of its own: its home, SQLite metadata DB (Airflow's
    default in its home), this DAG folder, this checkout's packages, the job file."""
    return {
        **os.environ,
        "AIRFLOW_HOME": str(home),
        "AIRFLOW__CORE__LOAD_EXAMPLES": "False",
        "AIRFLOW__CORE__DAGS_FOLDER": str(DAGS),
        "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]),
        "HF_HUB_OFFLINE": "1",
        "MEMSTREAM_JOB": str(job_file),
    }


def airflow_cli(args: list[str], env: Mapping[str, str], log: Path, timeout_s: float) -> int:
    """Runs `airflow ARGS` in its own session, its output in `log`; on timeout, kills the whole
    session (Airflow's CLI, its task, Ray's processes) and fails with the log's tail."""
    with log.open("wb") as output:
        process = subprocess.Popen(
            [str(AIRFLOW), *args],
            stdout=output,
            stderr=subprocess.STDOUT,
            env=dict(env),
            start_new_session=True,
        )
        try:
            return process.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()
            pytest.fail(f"airflow {args[0]} {args[1]} did not end in {timeout_s} s:\n{tail(log)}")


def tail(log: Path, lines: int = 80) -> str:
    # dag.test() logs "No tasks to run" every second while a task waits out its retry delay.
    text = [line for line in log.read_text(errors="replace").splitlines() if "No tasks" not in line]
    return "\n".join(text[-lines:])


def migrated_home(tmp_path: Path, job_file: Path) -> dict[str, str]:
    home = tmp_path / "airflow-home"
    home.mkdir()
    env = airflow_env(home, job_file)
    log = tmp_path / "airflow-db-migrate.log"
    assert airflow_cli(["db", "migrate"], env, log, timeout_s=120) == 0, tail(log)
    return env


def dags_test(env: Mapping[str, str], conf: Mapping[str, str], log: Path) -> int:
    args = ["dags", "test", "memstream_nightly", "--conf", json.dumps(dict(conf))]
    return airflow_cli(args, env, log, timeout_s=DAGS_TEST_TIMEOUT_S)


def metadata(env: Mapping[str, str], query: str) -> list[tuple[Any, ...]]:
    with sqlite3.connect(Path(env["AIRFLOW_HOME"]) / "airflow.db") as db:
        return db.execute(query).fetchall()


def test_airflow_dags_test_runs_the_task_end_to_end_and_pushes_the_summary_to_xcom(
    tmp_path: Path,
) -> None:
    docs = tmp_path / "docs"
    docs.mkdir()
    filler = "The committee met and adjourned. " * 60
    for name, fact in [("a.txt", "fact-amber"), ("b.txt", "fact-cobalt")]:
        (docs / name).write_text(f"{filler}\nThe code word is {fact}.\n{filler}")
    output = tmp_path / "out"
    log = tmp_path / "airflow-dags-test.log"
    with FactChatServer() as server:
        job_file = tmp_path / "job.yaml"
        job_file.write_text(
            "sources: [s3://replaced-by-the-dag-params/]\n"
            "questions: ['Which code word does the document give?']\n"
            "output: {uri: s3://replaced-by-the-dag-params/}\n"
            "engine: {kind: openai, model: smollm2-135m-instruct, served_model: "
            f"{server.model}, base_url: '{server.base_url}'}}\n"
            "method: {chunk_size: 200}\n"
        )
        env = migrated_home(tmp_path, job_file)
        returncode = dags_test(env, {"prefix": str(docs), "output": str(output)}, log)
        completions = server.answered
    assert returncode == 0, tail(log)
    assert metadata(env, "SELECT state FROM dag_run WHERE dag_id = 'memstream_nightly'") == [
        ("success",)
    ]
    ((xcom,),) = metadata(
        env,
        "SELECT value FROM xcom WHERE dag_id = 'memstream_nightly' AND task_id = 'run' "
        "AND key = 'return_value'",
    )
    summary = json.loads(xcom)
    assert summary["ok"] is True
    assert (summary["documents"], summary["chains"], summary["chains_done"]) == (2, 2, 2)
    # Every model call of the run reached the server: two segments or more per document,
    # an update per segment and a final answer per chain.
    assert completions >= 6 and completions == len(pq.read_table(summary["outputs"]["trajectory"]))
    answers = pq.read_table(summary["outputs"]["answers"], columns=["name", "answer", "run_id"])
    assert sorted((row["name"], row["answer"]) for row in answers.to_pylist()) == [
        ("a.txt", "fact-amber"),
        ("b.txt", "fact-cobalt"),
    ]
    assert set(answers.column("run_id").to_pylist()) == {summary["run_id"]}
    assert Path(summary["outputs"]["answers"]).parent == output / summary["run_id"]


def test_a_job_file_that_is_not_a_job_fails_the_run_at_once_without_retries(
    tmp_path: Path,
) -> None:
    """The DAG's two retries wait 10 minutes each: `dags test` would wait them out too, for the
    same broken file."""
    job_file = tmp_path / "job.yaml"
    job_file.write_text(
        "sources: [s3://b/p/]\nquestions: ['Who?']\noutput: {uri: s3://b/o/}\nengine: {kind: tgi}\n"
    )
    env = migrated_home(tmp_path, job_file)
    log = tmp_path / "airflow-dags-test.log"
    returncode = dags_test(env, {"prefix": str(tmp_path), "output": str(tmp_path / "out")}, log)
    assert returncode == 1 and "DagRun failed" in log.read_text(), tail(log)
    assert "engine.kind: Input should be 'vllm' or 'openai'" in log.read_text()
    assert metadata(
        env, "SELECT state, try_number FROM task_instance WHERE dag_id = 'memstream_nightly'"
    ) == [("failed", 1)]
