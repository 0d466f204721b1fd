"""The engine as a Serve deployment, and the client that makes its handle an `Engine`.

Every chain of every request sends its current step to the same engine deployment, so a replica
holds all in-flight steps at once and vLLM batches them (continuous batching) whichever request
they belong to. `max_ongoing_requests` of the deployment bounds how many steps a replica takes.
"""

from __future__ import annotations

import asyncio
from typing import Any

from pipeline.engines.base import Completion, EngineError, GenerationRequest
from pipeline.engines.factory import EngineSpec, open_engine


class EngineUnavailable(EngineError):
    """The engine deployment could not take the call (its replica died, is restarting, or is
    overloaded); the same call may succeed later."""


class EngineServer:
    """One engine (vLLM in process, or an OpenAI-compatible server) serving model calls: the
    body of the engine deployment (see `serving.app`). Its `__init__` and `__del__` are async,
    as Serve allows, so the engine starts and stops on the replica's event loop."""

    async def __init__(self, spec: EngineSpec) -> None:  # type: ignore[misc]
        # Built inside the replica's event loop, where its background tasks must run.
        self._engine = open_engine(spec)
        check = getattr(self._engine, "check", None)
        if check is not None:
            await check()

    async def generate(self, request: GenerationRequest) -> Completion:
        return await self._engine.generate(request)

    async def ready(self) -> bool:
        """Answers once `__init__` has finished, which is when Serve routes calls here."""
        return True

    async def check_health(self) -> None:
        """Called by Serve every few seconds; raising makes it replace the replica. Engines
        that can tell (an optional async `check_health`) are asked."""
        check = getattr(self._engine, "check_health", None)
        if check is not None:
            await check()

    async def __del__(self) -> None:
        engine, self._engine = getattr(self, "_engine", None), None
        if engine is not None:
            await engine.shutdown()


class ServeEngineClient:
    """The `Engine` interface over a handle to the engine deployment."""

    def __init__(self, handle: Any, model: str) -> None:
        self._handle = handle
        self.model = model
        self._answered = False  # whether the last call reached the engine

    async def ready(self, timeout_s: float) -> bool:
        """Whether the engine deployment takes calls. After a call that reached it, no new
        call is made, so a busy engine does not look unavailable."""
        if self._answered:
            return True
        response = self._handle.ready.remote()
        try:
            self._answered = bool(await asyncio.wait_for(response, timeout_s))
        except asyncio.TimeoutError:
            response.cancel()
        except Exception:  # any failure to reach it means: not ready
            self._answered = False
        return self._answered

    async def generate(self, request: GenerationRequest) -> Completion:
        from ray.exceptions import RayActorError
        from ray.serve.exceptions import RayServeException

        response = self._handle.generate.remote(request)
        try:
            completion = await response
        except asyncio.CancelledError:
            # The caller gave up (a cancelled job, a closed connection): free the engine too.
            response.cancel()
            raise
        except (RayActorError, RayServeException) as error:
            self._answered = False
            raise EngineUnavailable(
                f"the engine deployment is unavailable ({type(error).__name__})"
            ) from error
        self._answered = True
        return completion

    async def shutdown(self) -> None:
        """The deployment owns the engine; nothing to do for one client."""
