"""The method's knobs as one flat, typed record: what a job spec, the CLI and the API share."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict, dataclass
from typing import Any

from pipeline.core.chain import (
    REFERENCE_MAX_ANSWER_TOKENS,
    REFERENCE_MAX_MEMORY_TOKENS,
    ChainConfig,
)
from pipeline.core.segmentation import REFERENCE_CHUNK_SIZE, SegmentationConfig
from pipeline.core.templates import REFERENCE, SEGMENT_FIRST, VERIFIED_QUOTES, get_template_set
from pipeline.engines.base import SamplingConfig
from pipeline.engines.factory import DEFAULT_MODEL

# The template set a model gets when none is named. For the small models that were not RL-trained,
# the best measured by `memstream eval` (README, Accuracy); for every other model the reference,
# which is what the RL-MemAgent weights were trained on.
MEASURED_DEFAULT_TEMPLATES: dict[str, str] = {
    "qwen2.5-coder-0.5b-instruct": VERIFIED_QUOTES.name,
    "smollm2-135m-instruct": SEGMENT_FIRST.name,
}


@dataclass(frozen=True)
class MethodConfig:
    chunk_size: int = REFERENCE_CHUNK_SIZE
    snap_window: int = 0
    max_memory_tokens: int = REFERENCE_MAX_MEMORY_TOKENS
    max_answer_tokens: int = REFERENCE_MAX_ANSWER_TOKENS
    template: str = REFERENCE.name
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int = 0

    def __post_init__(self) -> None:
        # Build every part once so an invalid value fails here, with the part's own message.
        self.segmentation()
        self.chain()
        self.sampling()

    def segmentation(self) -> SegmentationConfig:
        return SegmentationConfig(chunk_size=self.chunk_size, snap_window=self.snap_window)

    def chain(self) -> ChainConfig:
        return ChainConfig(
            templates=get_template_set(self.template),
            max_memory_tokens=self.max_memory_tokens,
            max_answer_tokens=self.max_answer_tokens,
        )

    def sampling(self) -> SamplingConfig:
        return SamplingConfig(temperature=self.temperature, top_p=self.top_p, seed=self.seed)

    def as_dict(self) -> dict[str, object]:
        return asdict(self)


def default_template(model: str) -> str:
    return MEASURED_DEFAULT_TEMPLATES.get(model, REFERENCE.name)


def with_default_template(config: Mapping[str, Any]) -> dict[str, Any]:
    """A job or serving configuration (plain data, with optional `engine` and `method` sections)
    whose method names a template: the one given, else the engine model's default."""
    method = config.get("method") or {}
    if not isinstance(method, Mapping) or "template" in method:
        return dict(config)
    engine = config.get("engine") or {}
    model = engine.get("model", DEFAULT_MODEL) if isinstance(engine, Mapping) else DEFAULT_MODEL
    return {**config, "method": {**method, "template": default_template(model)}}
