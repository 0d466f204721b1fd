"""Adapter for any OpenAI-compatible chat completions server (vLLM's server, SGLang, hosted APIs).

The `openai` client retries 408, 409, 429, 5xx and connection errors with exponential backoff.
"""

from __future__ import annotations

import asyncio
import os
import time
from dataclasses import dataclass

from pipeline.engines.base import Completion, EngineError, EngineUnhealthy, GenerationRequest

HEALTH_CHECK_TIMEOUT_S = 1.5


@dataclass(frozen=True)
class OpenAIEngineConfig:
    base_url: str
    model: str  # the name the server serves the model under
    api_key_env: str = "OPENAI_API_KEY"
    timeout_s: float = 600.0
    max_retries: int = 5
    max_concurrency: int = 64

    def __post_init__(self) -> None:
        if not self.base_url.startswith(("http://", "https://")):
            raise ValueError(f"base_url must start with http:// or https://, got {self.base_url!r}")
        if self.max_concurrency < 1:
            raise ValueError(f"max_concurrency must be at least 1, got {self.max_concurrency}")


class OpenAIEngine:
    def __init__(self, config: OpenAIEngineConfig) -> None:
        import openai

        self.config = config
        self.model = config.model
        self._client = openai.AsyncOpenAI(
            base_url=config.base_url,
            api_key=os.environ.get(config.api_key_env) or "EMPTY",
            timeout=config.timeout_s,
            max_retries=config.max_retries,
        )
        self._slots = asyncio.Semaphore(config.max_concurrency)

    async def check(self) -> None:
        """Fails fast, with one clear message, when the server is unreachable or lacks the model."""
        await self._check_served(self._client.with_options(max_retries=1))

    async def check_health(self) -> None:
        """One cheap request, the served models, with a short timeout and no retry."""
        client = self._client.with_options(max_retries=0, timeout=HEALTH_CHECK_TIMEOUT_S)
        try:
            await self._check_served(client)
        except EngineError as error:
            raise EngineUnhealthy(str(error)) from None

    async def _check_served(self, client) -> None:  # type: ignore[no-untyped-def]
        models = await self._call(client.models.list())
        served = [m.id for m in models.data]
        if self.model not in served:
            raise EngineError(
                f"{self.config.base_url} does not serve model {self.model!r}; it serves {served}"
            )

    async def generate(self, request: GenerationRequest) -> Completion:
        if request.prompt_token_ids is not None:
            raise EngineError(
                "an OpenAI-compatible server takes messages, not token ids: train with the "
                "in-process vLLM engine"
            )
        sampling = request.sampling
        async with self._slots:
            started = time.perf_counter()
            response = await self._call(
                self._client.chat.completions.create(
                    model=self.model,
                    messages=[{"role": "user", "content": request.prompt}],
                    max_tokens=request.max_tokens,
                    temperature=sampling.temperature,
                    top_p=sampling.top_p,
                    seed=sampling.seed,
                    stop=list(sampling.stop) or None,
                )
            )
            latency = time.perf_counter() - started
        choice = response.choices[0]
        usage = response.usage
        return Completion(
            request_id=request.request_id,
            text=choice.message.content or "",
            prompt_tokens=usage.prompt_tokens if usage else 0,
            completion_tokens=usage.completion_tokens if usage else 0,
            finish_reason=choice.finish_reason,
            latency_s=latency,
        )

    async def _call(self, call):  # type: ignore[no-untyped-def]
        import openai

        url = self.config.base_url
        try:
            return await call
        except openai.APIConnectionError as error:
            raise EngineError(f"cannot reach {url} ({error}); is the server running?") from None
        except openai.AuthenticationError:
            raise EngineError(
                f"{url} rejected the API key; set ${self.config.api_key_env}"
            ) from None
        except openai.APIStatusError as error:
            raise EngineError(f"{url} answered {error.status_code}: {error.message}") from None

    async def shutdown(self) -> None:
        await self._client.close()
