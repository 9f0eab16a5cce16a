"""The engine: one object (``Engine``) that owns a model, a span store and the reuse methods."""

from kvrelay.engine.call import CallStats, GenerationOutput, sync_device
from kvrelay.engine.engine import Engine
from kvrelay.engine.sequence import GenerateOptions, Sequence

__all__ = ["CallStats", "Engine", "GenerateOptions", "GenerationOutput", "Sequence", "sync_device"]
