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
