"""A prompt quoting a registered output is tokenized piece by piece around it: each piece is refused from its
encoding's length against what the prompt has left (``tests/model/test_tokenizer_limit.py``), so a huge body quoting
an earlier output is refused before its ids and offsets become Python objects, as one quoting nothing is."""

from __future__ import annotations

import pytest
from tokenizers import Tokenizer as HFTokenizer
from tokenizers import models, pre_tokenizers

from kvrelay.errors import ContextLengthError
from kvrelay.model.tokenizer import Tokenizer
from kvrelay.server.prompting import chat_ids, completion_ids
from kvrelay.server.registry import OutputRegistry, RegisteredOutput
from tests.model.test_tokenizer_limit import _NoListsEncoding

QUOTED = "a b a b a b a b a b"  # 10 tokens, long enough to register
LIMIT = 20


class _GuardedBackend:
    """Encodings longer than the limit are unreadable (their ids and offsets raise); shorter ones read as usual."""

    def __init__(self) -> None:
        self.inner = HFTokenizer(models.WordLevel({"a": 0, "b": 1, "[UNK]": 2}, unk_token="[UNK]"))
        self.inner.pre_tokenizer = pre_tokenizers.Whitespace()

    def encode_batch(self, texts, add_special_tokens=False):
        encodings = self.inner.encode_batch(texts, add_special_tokens=add_special_tokens)
        return [_NoListsEncoding(e) if len(e) > LIMIT else e for e in encodings]

    def token_to_id(self, name):
        return self.inner.token_to_id(name)


def _tokenizer() -> Tokenizer:
    return Tokenizer(_GuardedBackend(), None, None, None)


def _registry() -> OutputRegistry:
    registry = OutputRegistry()
    assert registry.add(RegisteredOutput(QUOTED, (0, 1) * 5, "span-1", 3, "ns"))
    return registry


def _ids(build_ids, tokenizer, body: str, max_tokens: int):
    if build_ids is chat_ids:
        return chat_ids(tokenizer, [{"role": "user", "content": body}], _registry(), "ns", max_tokens)
    return completion_ids(tokenizer, body, _registry(), "ns", max_tokens)


@pytest.mark.parametrize("build_ids", [chat_ids, completion_ids])
@pytest.mark.parametrize("body", [QUOTED + " b" * 40, "b " * 40 + QUOTED])
def test_a_body_quoting_an_output_over_the_limit_is_refused_before_its_ids_are_read(build_ids, body):
    with pytest.raises(ContextLengthError, match=f"over the model's context of {LIMIT}"):
        _ids(build_ids, _tokenizer(), body, LIMIT)


@pytest.mark.parametrize("build_ids", [chat_ids, completion_ids])
def test_the_quoted_output_counts_toward_the_limit(build_ids):
    """6 + 10 spliced + 6 tokens (plus the transcript's role): each piece alone is within the limit, the prompt is
    not."""
    tokenizer = _tokenizer()
    body = "b " * 6 + QUOTED + " a" * 6
    with pytest.raises(ContextLengthError, match=f"over the model's context of {LIMIT}"):
        _ids(build_ids, tokenizer, body, LIMIT)
    build = _ids(build_ids, tokenizer, body, 2 * LIMIT)  # within it: the output spliced in as its generated ids
    assert len(build.splices) == 1 and build.ids[build.splices[0].start:build.splices[0].end] == [0, 1] * 5
