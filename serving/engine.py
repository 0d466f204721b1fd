"""The engine as a Serve deployment, and the client that makes its handle an `Engine`.

Every chain of every request sends its current step to the same engine deployment, so a replica
holds all in-flight steps at once and vLLM batches them (continuous batching) whichever request
they belong to. `max_ongoing_requests` of the deployment bounds how many steps a replica takes.
"""

from __future__ import annotations

import asyncio
from typing import Any

from connectors.engines.factory import EngineFactory, EngineSpec, open_checked_engine, open_engine
from operators.engine import Completion, EngineError, EngineUnhealthy, GenerationRequest


class EngineUnavailable(EngineError):
    """The engine deployment could not take the call (its replica died, is restarting, or is
    overloaded); the same call may succeed later."""


class EngineServer:
    """One engine (vLLM in process, or an OpenAI-compatible server) serving model calls: the
    body of the engine deployment (see `serving.app`). Its `__init__` and `__del__` are async,
    as Serve allows, so the engine starts and stops on the replica's event loop."""

    async def __init__(  # type: ignore[misc]
        self, spec: EngineSpec, engine_factory: EngineFactory = open_engine
    ) -> None:
        # Built inside the replica's event loop, where its background tasks must run.
        self._engine = await open_checked_engine(spec, engine_factory)

    async def generate(self, request: GenerationRequest) -> Completion:
        try:
            return await self._engine.generate(request)
        except EngineError:
            raise
        except Exception:
            # The engine may have died under the call (vLLM's EngineDeadError): say so in the
            # interface's words, so the client knows a restarted replica can serve it.
            await self._engine.check_health()
            raise

    async def check_health(self) -> None:
        """Called by Serve every `health_check_period_s`, and by `/healthz` through the handle.
        When it raises for Serve three times in a row, Serve replaces the replica."""
        await self._engine.check_health()

    async def __del__(self) -> None:
        engine, self._engine = getattr(self, "_engine", None), None
        if engine is not None:
            await engine.shutdown()


class ServeEngineClient:
    """The `Engine` interface over a handle to the engine deployment."""

    def __init__(self, handle: Any, model: str) -> None:
        self._handle = handle
        self.model = model

    async def generate(self, request: GenerationRequest) -> Completion:
        from ray.exceptions import RayActorError, RayTaskError
        from ray.serve.exceptions import RayServeException

        response = self._handle.generate.remote(request)
        try:
            return await response
        except asyncio.CancelledError:
            # The caller gave up (a cancelled job, a closed connection): free the engine too.
            response.cancel()
            raise
        except RayTaskError as error:
            if isinstance(error.cause, EngineUnhealthy):  # died under the call: Serve replaces it
                raise EngineUnavailable(f"the engine died during the call: {error.cause}") from None
            raise
        except (RayActorError, RayServeException) as error:
            raise unavailable(error) from error

    async def check_health(self) -> None:
        """Asks a replica of the engine deployment. Raises `EngineUnhealthy` with the reason its
        engine gave, or `EngineUnavailable` when no replica could take the call. It waits while
        no replica runs (one is starting): callers bound the wait."""
        from ray.exceptions import RayActorError, RayTaskError
        from ray.serve.exceptions import RayServeException

        response = self._handle.check_health.remote()
        try:
            await response
        except asyncio.CancelledError:
            response.cancel()
            raise
        except RayTaskError as error:  # raised by the replica's check; its cause says why
            raise EngineUnhealthy(str(error.cause)) from None
        except (RayActorError, RayServeException) as error:
            raise unavailable(error) from error

    async def check(self) -> None:
        """The replica checked its engine as it started: a health check says the rest."""
        await self.check_health()

    async def shutdown(self) -> None:
        """The deployment owns the engine; nothing to do for one client."""


def unavailable(error: Exception) -> EngineUnavailable:
    return EngineUnavailable(f"the engine deployment is unavailable ({type(error).__name__})")
