"""What ``kvrelay serve``'s flags are derived from besides the model's: how the server finds stored runs in a prompt
(``MatchConfig``) and its default caps. Torch-free, so that ``kvrelay serve --help`` (or a mistyped flag) answers
without loading torch or the web stack.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from kvrelay.errors import ConfigError
from kvrelay.server.index import MATCH_PREFERENCES

DEFAULT_MAX_TOKENS = 256  # tokens a chat or Responses request that names no cap gets at most
DEFAULT_PREFILL_CHUNK_TOKENS = 512  # a turn's prefill budget: what this many tokens cost at a prompt's start


@dataclass(frozen=True)
class MatchConfig:
    """How the server finds stored runs in a prompt (``kvrelay serve`` flags are derived from these fields)."""

    min_match_tokens: int = field(default=16, metadata={"help": (
        "shortest run of prompt tokens, outside the exact prefix, reused from a stored span")})
    match_framing: bool = field(default=False, metadata={"help": (
        "let runs found at any offset take in a chat prompt's framing (turn tokens, role headers) between "
        "message contents; off: only contents are matched and the framing is computed in the request's own "
        "context, as the pipeline runner does (the exact prefix is reused either way)")})
    match_prefer: str = field(default="oldest", metadata={"choices": MATCH_PREFERENCES, "help": (
        "which run a text shared with several stored spans is taken from: the span that stored it first (as "
        "the pipeline runner takes a task input from the first call that prefilled it), or the longest run")})

    def __post_init__(self) -> None:
        if self.match_prefer not in MATCH_PREFERENCES:
            raise ConfigError(f"--match-prefer must be one of {', '.join(MATCH_PREFERENCES)}, got "
                              f"{self.match_prefer!r}")
        if not isinstance(self.min_match_tokens, int) or self.min_match_tokens < 1:
            raise ConfigError(f"--min-match-tokens must be an integer >= 1, got {self.min_match_tokens!r}")


#: Kubernetes gives a pod 30 s (its default terminationGracePeriodSeconds) between SIGTERM and SIGKILL; 25 s of
#: grace leaves room for the cut requests' last chunks to be written and the process to exit before the kill
DEFAULT_SHUTDOWN_GRACE_S = 25.0


@dataclass(frozen=True)
class ShutdownConfig:
    """What the server does on SIGTERM or SIGINT (``kvrelay serve`` flags are derived from these fields;
    kvrelay.server.graceful)."""

    shutdown_grace_s: float = field(default=DEFAULT_SHUTDOWN_GRACE_S, metadata={"help": (
        "seconds running requests get to finish after SIGTERM or SIGINT; queued requests are answered 503 "
        "shutting_down at once, and those still running at the end get it too (a stream: an error chunk, then "
        "[DONE]); keep it below the orchestrator's kill timeout (Kubernetes: terminationGracePeriodSeconds)")})

    def __post_init__(self) -> None:
        grace_s = self.shutdown_grace_s
        if isinstance(grace_s, bool) or not isinstance(grace_s, int | float) or not grace_s >= 0 \
                or grace_s == float("inf"):
            raise ConfigError(f"--shutdown-grace-s must be a finite number of seconds >= 0, got {grace_s!r}")
