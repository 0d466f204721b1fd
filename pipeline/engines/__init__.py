"""Engine adapters behind one small async interface (see `base`)."""

from pipeline.engines.base import (
    Completion,
    Engine,
    EngineError,
    EngineUnhealthy,
    GenerationRequest,
    SamplingConfig,
)

__all__ = [
    "Completion",
    "Engine",
    "EngineError",
    "EngineUnhealthy",
    "GenerationRequest",
    "SamplingConfig",
]
