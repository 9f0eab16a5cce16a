"""The engine: one object (``Engine``) that owns a model, a span store and the reuse methods."""

from kvrelay.engine.core import CallStats, GenerationOutput, generate, publish, sync_device
from kvrelay.engine.engine import Engine, GenerateOptions, Sequence

__all__ = ["CallStats", "Engine", "GenerateOptions", "GenerationOutput", "Sequence", "generate", "publish",
           "sync_device"]
