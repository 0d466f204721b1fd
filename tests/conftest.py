"""Shared fixtures. Real services (S3, PostgreSQL) live in `tests/services.py`; the real vLLM
engine on the small default test model is started once per session here."""

from __future__ import annotations

import asyncio
import os
from pathlib import Path

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")

pytest_plugins = ["tests.services"]

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
    from pipeline import models

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
    from pipeline.engines.hardware import resolve_dtype
    from pipeline.engines.vllm_local import VLLMEngine, VLLMEngineConfig

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
