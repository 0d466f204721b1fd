"""One memory chain through verl's rollout servers, with the native trainer's own rollout code.

verl's agent loop (pipeline.training.verl_hooks) hands a dataset row and a client of its
vLLM servers, which takes prompt token ids and returns sampled token ids and their
log-probabilities. `ServerEngine` makes that client a memstream `Engine`, so a row's chain is
rolled out by `pipeline.training.rollout.roll_out_chain`: the same segmentation, templates,
memory splicing (a memory enters the next prompt as its sampled ids without the
end-of-sequence token) and overwrite rule as `memstream train`. Nothing here imports verl.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Protocol

from operators.core.chain import ChainConfig, MemoryChain
from operators.core.segmentation import SegmentationConfig, segment, tokenize
from operators.engine import Completion, GenerationRequest, SamplingConfig
from pipeline.training.learner import Conversation
from pipeline.training.rollout import PromptSplicer, roll_out_chain

# The row's extra_info keys a chain reads (the export writes them).
SAMPLE_ID = "sample_id"
DOCUMENT = "document"
QUESTION = "question"


class TokenOutput(Protocol):
    token_ids: list[int]
    log_probs: list[float] | None


class TokenServer(Protocol):
    """What verl's `LLMServerClient.generate` is (verl/workers/rollout/llm_server.py)."""

    async def generate(
        self, request_id: str, *, prompt_ids: list[int], sampling_params: dict[str, Any]
    ) -> TokenOutput: ...


class ServerEngine:
    """A memstream `Engine` over a verl token server. verl's sampling parameters (temperature,
    top_p, log-probabilities) apply to every request; each request's budget is the chain's."""

    model = "verl"

    def __init__(
        self, server: TokenServer, tokenizer: Any, sampling_params: Mapping[str, Any]
    ) -> None:
        self.server = server
        self.tokenizer = tokenizer
        self.sampling_params = dict(sampling_params)
        self.end_ids = frozenset(tokenizer.all_special_ids)

    async def check(self) -> None:
        pass

    async def check_health(self) -> None:
        pass

    async def shutdown(self) -> None:
        pass

    async def generate(self, request: GenerationRequest) -> Completion:
        if request.prompt_token_ids is None:
            raise ValueError("the verl rollout takes prompts as token ids")
        started = time.perf_counter()
        prompt_ids = list(request.prompt_token_ids)
        output = await self.server.generate(
            request.request_id,
            prompt_ids=prompt_ids,
            sampling_params={**self.sampling_params, "max_tokens": request.max_tokens},
        )
        ids = tuple(output.token_ids)
        stopped = bool(ids) and ids[-1] in self.end_ids
        return Completion(
            request_id=request.request_id,
            text=self.tokenizer.decode(ids, skip_special_tokens=True),
            prompt_tokens=len(prompt_ids),
            completion_tokens=len(ids),
            finish_reason="length" if len(ids) >= request.max_tokens and not stopped else "stop",
            latency_s=time.perf_counter() - started,
            prompt_token_ids=tuple(prompt_ids),
            token_ids=ids,
            logprobs=tuple(output.log_probs) if output.log_probs else None,
        )


@dataclass(frozen=True)
class RowChain:
    """A row's rolled-out chain: its K update conversations and its final one, the final
    reply's text, and each update's reply length in tokens (for the overlong term)."""

    conversations: tuple[Conversation, ...]
    response: str
    memory_lengths: tuple[int, ...]


async def roll_out_row(
    engine: ServerEngine,
    extra_info: Mapping[str, Any],
    chain_config: ChainConfig,
    chunk_size: int,
) -> RowChain:
    """The chain over the row's document, cut at `chunk_size` tokens as the native trainer cuts
    it (pipeline.training.rollout.roll_out_samples)."""
    tokenizer = engine.tokenizer
    document = tokenize(str(extra_info[SAMPLE_ID]), str(extra_info[DOCUMENT]), tokenizer)
    segments = segment(document, tokenizer, SegmentationConfig(chunk_size=chunk_size))
    # Request ids route verl's requests (sticky sessions): unique per chain.
    chain = MemoryChain(uuid.uuid4().hex, str(extra_info[QUESTION]), segments, chain_config)
    conversations, response, _ = await roll_out_chain(
        engine, PromptSplicer(tokenizer), chain, SamplingConfig(), sample_index=0
    )
    return RowChain(
        conversations=tuple(conversations),
        response=response,
        memory_lengths=tuple(len(c.response_ids) for c in conversations[:-1]),
    )
