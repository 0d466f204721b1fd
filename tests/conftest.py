"""Shared fixtures. Real services (S3, PostgreSQL) live in `tests/services.py`; the real vLLM
engine on the small default test model is started once per session here."""

from __future__ import annotations

import asyncio
import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")

pytest_plugins = ["tests.services"]


def pytest_configure(config: pytest.Config) -> None:
    from tests.processes import end_session_on_sigterm

    end_session_on_sigterm()


# The files whose tests take minutes (`pytest --durations`), heaviest first. `make test` runs the
# suite on two workers, a file at a time each (`--dist loadfile --no-loadscope-reorder`); these
# go first, so the many short files fill the end and both workers finish together.
MINUTES_FIRST = (
    "test_job.py",
    "test_engines.py",
    "test_serving.py",
    "test_cli.py",
    "test_training_run.py",
    "test_evidence.py",
    "test_training_tasks.py",
    "test_serve_processes.py",
    "test_incremental.py",
    "test_evaluation.py",
    "test_training_ray_learner.py",
    "test_collection_job.py",
    "test_airflow_dag.py",
    "test_credentials.py",
)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """A test on the shared engine is an `engine` test, marked or not (`make test-fast` leaves
    them out). The files of `MINUTES_FIRST` run first, in its order; the rest keep theirs."""
    for item in items:
        if "vllm_engine" in getattr(item, "fixturenames", ()):
            item.add_marker(pytest.mark.engine)
    rank = {name: place for place, name in enumerate(MINUTES_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(MINUTES_FIRST)))


REPO = Path(__file__).resolve().parents[1]
CORPORA = REPO.parent / "shared" / "corpora"
TEST_MODEL = os.environ.get("MEMSTREAM_TEST_MODEL", "smollm2-135m-instruct")


@pytest.fixture(scope="session")
def corpora() -> Path:
    if not CORPORA.is_dir():
        pytest.fail(f"the shared corpora are missing: expected them at {CORPORA}")
    return CORPORA


@pytest.fixture(scope="session")
def test_model_path() -> str:
    from connectors.engines import models

    return models.resolve(TEST_MODEL)


@pytest.fixture(scope="session")
def tokenizer(test_model_path: str):  # type: ignore[no-untyped-def]
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(test_model_path)


@pytest.fixture(scope="session")
def event_loop_runner():  # type: ignore[no-untyped-def]
    """One event loop for the whole session, so the shared engine's background tasks live on."""
    runner = asyncio.Runner()
    yield runner
    runner.close()


@pytest.fixture(scope="session")
def vllm_engine(test_model_path: str, event_loop_runner):  # type: ignore[no-untyped-def]
    from connectors.engines.hardware import resolve_dtype
    from connectors.engines.vllm_local import VLLMEngine, VLLMEngineConfig

    config = VLLMEngineConfig(
        model=test_model_path,
        max_model_len=4096,
        dtype=resolve_dtype("auto"),  # by the hardware, or $MEMSTREAM_DTYPE
        enforce_eager=True,
        cpu_kvcache_space_gib=1,
    )
    engine = event_loop_runner.run(_start(VLLMEngine, config))
    yield engine
    event_loop_runner.run(engine.shutdown())


async def _start(factory, config):  # type: ignore[no-untyped-def]
    return factory(config)


# What Ray, vLLM, torch and transformers print while memstream starts and runs an engine; a
# command's terminal shows none of it, and its log file holds it.
LIBRARY_NOISE = (
    "Triton not available",
    "FutureWarning",
    "torch.distributed.reduce_op",
    "NUMA binding",
    "core_worker.cc",
    "constructor arguments in the object store",
    "Token authentication is enabled",
    "Loading safetensors",
    "Traceback",
)


def assert_clean_terminal(stdout: str, stderr: str) -> Path:
    """No library output on the terminal; returns the log file the command named, which must
    hold some of it (else the check above could not fail)."""
    for noise in LIBRARY_NOISE:
        assert noise not in stdout and noise not in stderr, f"{noise!r} reached the terminal"
    named = [line for line in stderr.splitlines() if line.startswith("logs of Ray, vLLM")]
    assert len(named) == 1, stderr[-2000:]
    log = Path(named[0].rsplit(": ", 1)[1])
    logged = log.read_text(errors="replace")
    assert any(noise in logged for noise in LIBRARY_NOISE[:8]), logged[-2000:]
    return log


@contextmanager
def local_ray() -> Iterator[None]:
    """A Ray session for a module's jobs, with four logical CPUs: a job that failed may leave
    its memory-stage actor (one CPU) alive for a while, and with two the next job's read tasks
    would wait for it. Its workers run at nice 0 (Ray's 15 would starve them behind anything
    else on a shared machine) and inherit the environment as it is now (start it after the
    fixtures that set AWS_* variables)."""
    import ray

    with pytest.MonkeyPatch.context() as env:
        env.setenv("RAY_worker_niceness", "0")
        ray.init(num_cpus=4, include_dashboard=False, logging_level="WARNING")
    try:
        yield
    finally:
        ray.shutdown()
