"""`open_checked_engine` on the fake engine: an engine that passes its check is handed over
open; one that fails it, or whose check is interrupted, is shut down before the error goes on."""

from __future__ import annotations

import asyncio

import pytest

from connectors.engines.factory import EngineSpec, open_checked_engine
from connectors.engines.fake import FactEngine
from operators.engine import EngineUnhealthy

SPEC = EngineSpec(model="fake-model", dtype="float32")


def test_an_engine_that_passes_its_check_is_handed_over_open() -> None:
    engine = FactEngine()
    assert asyncio.run(open_checked_engine(SPEC, lambda spec: engine)) is engine
    assert not engine.shut_down


def test_an_engine_that_fails_its_check_is_shut_down_and_says_why() -> None:
    engine = FactEngine()
    engine.unhealthy = "cannot reach http://127.0.0.1:1/v1; is the server running?"
    with pytest.raises(EngineUnhealthy, match="is the server running"):
        asyncio.run(open_checked_engine(SPEC, lambda spec: engine))
    assert engine.shut_down


def test_an_engine_whose_check_is_interrupted_is_shut_down() -> None:
    class Hanging(FactEngine):
        async def check(self) -> None:
            await asyncio.Event().wait()

    engine = Hanging()

    async def interrupted() -> None:
        opening = asyncio.create_task(open_checked_engine(SPEC, lambda spec: engine))
        await asyncio.sleep(0)
        opening.cancel()
        await opening

    with pytest.raises(asyncio.CancelledError):
        asyncio.run(interrupted())
    assert engine.shut_down
