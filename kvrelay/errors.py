"""Errors users see. Each names the input at fault (file, field, limit) and what to do."""


class KvRelayError(Exception):
    """Base class of every error kvrelay raises on bad input or state."""


class ModelNotFoundError(KvRelayError):
    """An unknown model alias or a path that does not exist."""


class UnsupportedModelError(KvRelayError):
    """An architecture, RoPE variant or tensor type this engine does not implement."""


class ConfigError(KvRelayError):
    """A configuration value that is out of range or inconsistent."""


class CorruptModelError(KvRelayError):
    """A model or cache file that cannot be parsed (truncated, wrong magic, missing tensors)."""


class ContextLengthError(KvRelayError):
    """A prompt (plus generation) that does not fit the model's context."""


class ScheduleError(KvRelayError):
    """A schedule that asks the forward for something impossible (e.g. a token with no KV)."""


class StoreFullError(KvRelayError):
    """A span that cannot fit the store's byte budget even after evicting every unpinned span."""


class DeviceError(KvRelayError):
    """A device that does not exist or is not available on this machine (cuda without CUDA, mps without MPS)."""


class DataFileError(KvRelayError):
    """A data file (--data, --input @file) that is missing, unreadable, or has a malformed line."""


class OutputPathError(KvRelayError):
    """An output path (--json, --plot, --out) that cannot be written; checked before any work starts."""


class InputError(KvRelayError, ValueError):
    """A value handed to the Python API that is malformed or out of range. A ValueError too, so code that caught
    the ValueError raised before this class existed still catches it."""


class PromptError(InputError):
    """A prompt that is not a non-empty list of int token ids inside the model's vocabulary."""


class SpanRefError(InputError):
    """A SpanRef whose range does not fit its prompt or its stored span, or whose tokens are not the span's."""


class SpliceError(InputError, KeyError):
    """A splice marker in a prompt whose output was not given, or a spliced output the prompt does not hold (a
    KeyError too, as it was before this class existed)."""

    def __str__(self) -> str:  # KeyError's str() would quote the message
        return str(self.args[0]) if self.args else ""
