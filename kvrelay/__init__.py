"""kvrelay: reuse KV caches across the agents of a multi-agent LLM pipeline.

The Python API's names, importable from here (``from kvrelay import Engine, load_model``). Each is imported on first
use: ``import kvrelay`` (and ``kvrelay --help``) loads no torch.
"""

__version__ = "0.1.0"

_ERRORS = ("KvRelayError", "ConfigError", "ContextLengthError", "CorruptModelError", "DataFileError", "DeviceError",
           "InputError", "ModelNotFoundError", "OutputPathError", "PromptError", "ScheduleError", "SpanRefError",
           "SpliceError", "StoreFullError", "UnsupportedModelError")
# name -> the module that defines it
_EXPORTS: dict[str, str] = {
    "Engine": "kvrelay.engine", "GenerateOptions": "kvrelay.engine", "GenerationOutput": "kvrelay.engine",
    "CallStats": "kvrelay.engine", "SamplingConfig": "kvrelay.model.sampling_config", "KVStore": "kvrelay.cache.store",
    "SpanNotFoundError": "kvrelay.cache.store", "load_model": "kvrelay.weights.loader",
    "chat_prompt_ids": "kvrelay.pipeline.prompt", "splice_marker": "kvrelay.pipeline.prompt",
    "CallInput": "kvrelay.reuse.base", "SpanRef": "kvrelay.reuse.base",
    **dict.fromkeys(_ERRORS, "kvrelay.errors"),
}

__all__ = ["__version__", *_EXPORTS]


def __getattr__(name: str):
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'kvrelay' has no attribute {name!r}")
    import importlib  # here: ``import kvrelay`` itself imports nothing

    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # looked up once
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_EXPORTS))
