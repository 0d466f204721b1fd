"""Engine adapters behind one small async interface (see `base`)."""

from pipeline.engines.base import Completion, Engine, EngineError, GenerationRequest, SamplingConfig

__all__ = ["Completion", "Engine", "EngineError", "GenerationRequest", "SamplingConfig"]
