"""Adapter for any OpenAI-compatible chat completions server (vLLM's server, SGLang, hosted APIs).

The `openai` client retries 408, 409, 429, 5xx, timeouts and connection errors with exponential
backoff. Its timeout bounds each read, not a request: a server that sends a byte now and then
would hold a call forever, so every call also has a deadline (`call_deadline_s`)
over all its attempts and their backoff.
"""

from __future__ import annotations

import asyncio
import os
import time
from dataclasses import dataclass

from operators.config import ConfigError
from operators.engine import Completion, EngineError, EngineUnhealthy, GenerationRequest

HEALTH_CHECK_TIMEOUT_S = 1.5
CONNECT_TIMEOUT_S = 5.0  # a host that drops packets fails in seconds, not after timeout_s
# The openai client's backoff before retry n (from 0): 0.5 s doubling, at most 8 s.
FIRST_BACKOFF_S, MAX_BACKOFF_S = 0.5, 8.0


@dataclass(frozen=True)
class OpenAIEngineConfig:
    base_url: str
    model: str  # the name the server serves the model under
    api_key_env: str = "OPENAI_API_KEY"
    timeout_s: float = 600.0  # of each read of one attempt
    max_retries: int = 5
    max_concurrency: int = 64

    def __post_init__(self) -> None:
        if not self.base_url.startswith(("http://", "https://")):
            raise ConfigError(
                f"base_url must start with http:// or https://, got {self.base_url!r}"
            )
        if self.max_concurrency < 1:
            raise ValueError(f"max_concurrency must be at least 1, got {self.max_concurrency}")
        if self.timeout_s <= 0 or self.max_retries < 0:
            raise ValueError("timeout_s must be positive and max_retries at least 0")


def call_deadline_s(timeout_s: float, max_retries: int) -> float:
    """The longest one call may take: every attempt its connection and its timeout, and the
    backoff between them. A server's Retry-After beyond that backoff is cut short by it."""
    attempt = min(CONNECT_TIMEOUT_S, timeout_s) + timeout_s
    backoff = sum(min(FIRST_BACKOFF_S * 2**n, MAX_BACKOFF_S) for n in range(max_retries))
    return (max_retries + 1) * attempt + backoff


class OpenAIEngine:
    def __init__(self, config: OpenAIEngineConfig) -> None:
        import openai

        self.config = config
        self.model = config.model
        self._client = openai.AsyncOpenAI(
            base_url=config.base_url,
            api_key=os.environ.get(config.api_key_env) or "EMPTY",
            timeout=openai.Timeout(
                config.timeout_s, connect=min(CONNECT_TIMEOUT_S, config.timeout_s)
            ),
            max_retries=config.max_retries,
        )
        self._slots = asyncio.Semaphore(config.max_concurrency)

    async def check(self) -> None:
        """Fails fast, with one clear message, when the server is unreachable or lacks the model."""
        await self._check_served(self.config.timeout_s, max_retries=1)

    async def check_health(self) -> None:
        """One cheap request, the served models, with a short timeout and no retry."""
        try:
            await self._check_served(HEALTH_CHECK_TIMEOUT_S, max_retries=0)
        except EngineError as error:
            raise EngineUnhealthy(str(error)) from None

    async def _check_served(self, timeout_s: float, max_retries: int) -> None:
        client = self._client.with_options(max_retries=max_retries, timeout=timeout_s)
        models = await self._call(client.models.list(), timeout_s, max_retries)
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
                ),
                self.config.timeout_s,
                self.config.max_retries,
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

    async def _call(self, call, timeout_s: float, max_retries: int):  # type: ignore[no-untyped-def]
        """The call's result, or EngineError with one line that says what went wrong; never
        longer than `call_deadline_s` of its timeout and retries."""
        import openai

        config = self.config
        url = config.base_url
        attempts = f"{max_retries + 1} attempt{'s' if max_retries else ''}"
        deadline_s = call_deadline_s(timeout_s, max_retries)
        try:
            async with asyncio.timeout(deadline_s):
                return await call
        except TimeoutError:
            raise EngineError(
                f"{url} gave no complete answer within {deadline_s:g} s ({attempts} of "
                f"timeout {timeout_s:g} s and their backoff); is the server overloaded?"
            ) from None
        except openai.APITimeoutError:
            raise EngineError(
                f"{url} did not answer within the timeout of {timeout_s:g} s ({attempts}); "
                "is the server overloaded? (engine.timeout_s)"
            ) from None
        except openai.APIConnectionError as error:
            raise EngineError(f"cannot reach {url} ({error}); is the server running?") from None
        except AttributeError as error:
            # anyio reads the peer of a socket its transport already dropped when the server
            # closes the connection as it opens (a server going down): a refused call too
            if "getpeername" not in str(error):
                raise
            raise EngineError(
                f"cannot reach {url} (it closed the connection as it opened); is the server "
                "running?"
            ) from None
        except openai.AuthenticationError:
            raise EngineError(f"{url} rejected the API key; set ${config.api_key_env}") from None
        except openai.APIStatusError as error:
            tried = f" ({attempts})" if error.status_code >= 500 or error.status_code == 429 else ""
            body = error.body if isinstance(error.body, dict) else {}
            detail = body.get("message") or error.message  # the server's words, if it said any
            raise EngineError(f"{url} answered {error.status_code}{tried}: {detail}") from None

    async def shutdown(self) -> None:
        await self._client.close()
