"""A request's ``logit_bias``, ``frequency_penalty`` and ``presence_penalty``, checked against the vocabulary.

pydantic has checked the penalties' range ([-2, 2]) and that ``logit_bias`` is an object; here a bias must be a
number in [-100, 100] and its key a token id, as OpenAI's are: a decimal integer (a string, JSON's keys being
strings) within the vocabulary. A bad one is a 400 naming it (``logit_bias.<key>``), not an index error on the
engine thread (a 500 after the prompt's prefill).
"""

from __future__ import annotations

from kvrelay.engine.penalties import Penalties
from kvrelay.server.protocol import ApiError


def penalties_of(body, vocab_size: int, repetition_penalty: float = 1.0, min_tokens: int = 0,
                 min_tokens_stop_ids: tuple[int, ...] = ()) -> Penalties | None:
    """The request's ``Penalties``, or None when they change nothing (absent, null, 0, an empty or all-0 bias, a
    repetition penalty of 1, no ``min_tokens``). The vLLM parameters come checked (kvrelay.server.vllm_params)."""
    bias = []
    for key, value in (body.logit_bias or {}).items():
        # at most 18 significant digits: int() of a 4301-digit key is a ValueError (a 500), and no vocabulary is near
        digits = key.lstrip("0") or "0"
        token_id = int(digits) if key.isascii() and key.isdigit() and len(digits) <= 18 else None
        if token_id is None or token_id >= vocab_size:
            raise ApiError(400, f"logit_bias key {key!r} is not a token id in [0, {vocab_size}) (a decimal integer)",
                           param=f"logit_bias.{key}", code="invalid_value")
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ApiError(400, f"logit_bias[{key!r}] must be a number, got {type(value).__name__}",
                           param=f"logit_bias.{key}", code="invalid_value")
        if not -100 <= value <= 100:
            raise ApiError(400, f"logit_bias[{key!r}] is {value!r}, outside [-100, 100]", param=f"logit_bias.{key}",
                           code="invalid_value")
        bias.append((token_id, float(value)))
    penalties = Penalties(tuple(sorted(bias)), float(body.frequency_penalty or 0.0),
                          float(body.presence_penalty or 0.0), float(repetition_penalty), min_tokens,
                          min_tokens_stop_ids)
    return penalties if penalties.active else None
