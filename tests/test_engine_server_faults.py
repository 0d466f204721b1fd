"""An OpenAI-compatible server that goes down, gets slow or answers 500 in the middle of a job
(issue 18, item 1): `run_job` with the openai engine against a real HTTP server on loopback
(tests/chat_server.py, answering as the fake engine does), through Ray Data and the Parquet
export. Expected: the adapter's timeouts and retries with backoff, within a bounded time; the
chains that met the fault end as failed answers rows with the reason; the job returns its
summary (never a hang); a rerun once the server is healthy resumes the failed chains from their
checkpoints and finishes the run, each answer once."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pandas as pd
import pytest

from connectors.engines.fake import FACT
from connectors.engines.openai_http import call_deadline_s
from pipeline.job import JobError, run_job
from tests.chat_server import FactChatServer, fact_job, write_reports
from tests.conftest import local_ray

TIMEOUT_S, MAX_RETRIES = 1.0, 2
SERVER_LIMITS = {"timeout_s": TIMEOUT_S, "max_retries": MAX_RETRIES}
FAULT_AT_REQUEST = 3  # the first two model calls are answered, then the fault starts
# The chain's reason for each fault, as the answers row's `error` has it.
REASONS = {
    "down": r"EngineError: cannot reach http://127\.0\.0\.1:\d+/v1 .*is the server running\?",
    "500": r"answered 500 \(3 attempts\): the fault server fails on purpose$",
    "slow": r"did not answer within the timeout of 1 s \(3 attempts\); is the server overloaded",
    "trickle": r"gave no complete answer within 7\.5 s \(3 attempts of timeout 1 s",
}
# Attempts the server sees for each call that fails: every retry, except when it is down
# (refused: it never sees them) or trickles (the call's deadline ends the first attempt).
ATTEMPTS_SEEN = {"down": 0, "500": 3, "slow": 3, "trickle": 1}
# Longer than any of these jobs takes on a loaded 2-core machine, shorter than the 3 minutes a
# trickling server would hold a call without its deadline: what tells ending from hanging.
HANG_S = 150


@pytest.fixture(scope="module")
def ray_session() -> Iterator[None]:
    with local_ray():
        yield


@pytest.fixture
def chat_server() -> Iterator[FactChatServer]:
    server = FactChatServer(slow_s=3 * TIMEOUT_S).start()
    yield server
    server.stop()


def test_the_call_deadline_is_every_attempt_and_the_backoff_between() -> None:
    assert call_deadline_s(TIMEOUT_S, MAX_RETRIES) == 3 * (1.0 + 1.0) + 0.5 + 1.0
    assert call_deadline_s(600, 5) == 6 * (5 + 600) + 0.5 + 1 + 2 + 4 + 8


def test_a_server_down_at_the_start_fails_the_job_before_anything_runs(
    chat_server: FactChatServer, tmp_path: Path
) -> None:
    write_reports(tmp_path / "inputs")
    chat_server.stop()
    started = time.monotonic()
    with pytest.raises(JobError, match=r"cannot reach http://127\.0\.0\.1:\d+/v1 .*server running"):
        run_job(
            fact_job(chat_server, [str(tmp_path / "inputs")], str(tmp_path / "out"), SERVER_LIMITS)
        )
    assert time.monotonic() - started < HANG_S
    assert not (tmp_path / "out" / "memstream-state.sqlite").exists()  # no run was begun


@pytest.mark.parametrize("fault", ["down", "500", "slow", "trickle"])
def test_server_fault_mid_run_gives_failed_rows_then_a_rerun_finishes(
    ray_session: None, chat_server: FactChatServer, tmp_path: Path, fault: str
) -> None:
    facts = write_reports(tmp_path / "inputs")
    spec = fact_job(chat_server, [str(tmp_path / "inputs")], str(tmp_path / "out"), SERVER_LIMITS)

    def inject(request: int) -> None:
        if request != FAULT_AT_REQUEST:
            return
        if fault == "down":  # this request is answered; the port is closed behind it
            threading.Thread(target=chat_server.stop).start()
        else:
            chat_server.fault = fault  # type: ignore[assignment]

    chat_server.before_reply = inject
    started = time.monotonic()
    summary = run_job(spec)
    elapsed = time.monotonic() - started

    assert summary.chains == 2 and summary.chains_failed >= 1 and not summary.ok
    assert summary.chains_done + summary.chains_failed == summary.chains
    assert summary.documents == 2 and summary.errors == 0
    answers = pd.read_parquet(summary.outputs["answers"])
    failed = answers[answers.status == "failed"]
    assert len(failed) == summary.chains_failed
    for error in failed.error:
        assert pd.Series([error]).str.contains(REASONS[fault]).all(), error
    if fault != "down":
        faulty = chat_server.chat_requests - chat_server.answered
        assert faulty == summary.chains_failed * ATTEMPTS_SEEN[fault]
    # Each failing call ended by its deadline (7.5 s): without one, a trickling server holds
    # each attempt for a minute. A bound on hanging, generous for a loaded machine: not a speed.
    assert elapsed < HANG_S, f"the job took {elapsed:.0f} s"

    # The failed chains that had written a step before the fault: each document is its own
    # task, so one chain may have made every call before the other began.
    first_steps = pd.read_parquet(summary.outputs["trajectory"])
    checkpointed = set(failed.chain_key) & set(first_steps.chain_key)
    assert checkpointed  # the fault came at the third call: some failed chain had steps

    chat_server.before_reply, chat_server.fault = None, None
    if fault == "down":
        chat_server.start()
    rerun = run_job(spec)
    # The faulty run ended (with failed rows), so the rerun is a new run of the same job: its
    # failed chains resume from their checkpoints, the answered ones are carried forward.
    assert rerun.ok and rerun.chains_done == 2 and rerun.changes.unchanged == 2
    assert rerun.chains_resumed == len(checkpointed)  # from their checkpoints, not step 0
    answers = pd.read_parquet(rerun.outputs["answers"])
    trajectory = pd.read_parquet(rerun.outputs["trajectory"])
    assert len(answers) == 2 and (answers.status == "done").all()
    for row in answers.itertuples():
        assert set(FACT.findall(row.answer)) == facts[row.name], row.answer
        steps = trajectory[trajectory.chain_key == row.chain_key].step.tolist()
        assert sorted(steps) == list(range(row.n_segments + 1)), steps
