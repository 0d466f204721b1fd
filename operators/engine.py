"""The engine interface: requests with ids go in, completions with token usage come out.

Engines are thin adapters. Batching happens behind `generate`: callers await many requests
at once and the engine schedules them together.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol


@dataclass(frozen=True)
class SamplingConfig:
    """Greedy by default so runs can be audited and reproduced; the reference evaluation
    samples with temperature 0.7 and top_p 0.95."""

    temperature: float = 0.0
    top_p: float = 1.0
    # Per request on GPUs; on vLLM's CPU backend sampled requests use the engine's seeded
    # stream (VLLMEngine.__init__ says why).
    seed: int = 0
    stop: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")


@dataclass(frozen=True)
class GenerationRequest:
    request_id: str
    prompt: str  # the content of one user message; the engine applies the chat template
    max_tokens: int
    sampling: SamplingConfig = field(default_factory=SamplingConfig)
    # Lower runs first where the engine has a queue (vLLM's priority scheduling); ties in order
    # of arrival. Engines without priorities ignore it.
    priority: int = 0
    # The whole prompt as token ids, chat template included, used instead of `prompt` (which
    # then only names it in logs): training splices a memory's sampled ids into the next
    # prompt rather than re-encoding its text. Only token-level engines (vLLM) take it.
    prompt_token_ids: tuple[int, ...] | None = None
    # Ask for each sampled token's log-probability (Completion.logprobs).
    logprobs: bool = False


@dataclass(frozen=True)
class Completion:
    request_id: str
    text: str
    prompt_tokens: int
    completion_tokens: int
    finish_reason: str | None
    latency_s: float
    # Token-level engines (vLLM) give the ids they were sent and sampled, the end-of-sequence
    # token included; what training learns from. Empty where the engine does not say.
    prompt_token_ids: tuple[int, ...] = ()
    token_ids: tuple[int, ...] = ()
    logprobs: tuple[float, ...] | None = None  # of each sampled token, when asked for


class EngineError(RuntimeError):
    """A request the engine could not serve; the message says what to do."""


class EngineUnhealthy(EngineError):
    """The engine cannot serve any request (its process died, its server does not answer);
    the message says why, in one line."""


class Engine(Protocol):
    """An engine starts when it is built (`connectors.engines.factory.open_engine`), is checked
    once before its first request (`open_checked_engine` does both) and shut down once at the
    end."""

    model: str

    async def check(self) -> None:
        """Returns when the engine can serve this model; raises `EngineError` with one line that
        says why not (a server that does not answer, or does not serve the model)."""

    async def generate(self, request: GenerationRequest) -> Completion: ...

    async def check_health(self) -> None:
        """Returns while the engine can serve requests; raises `EngineUnhealthy` otherwise. Cheap
        enough to call often."""

    async def shutdown(self) -> None: ...
