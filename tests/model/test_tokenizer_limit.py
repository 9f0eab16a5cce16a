"""``Tokenizer.encode(text, max_tokens)``: a text over the limit is refused from its encoding's length, before its
ids and offsets become Python objects (for a 8 MB body, 4M of each: seconds holding the GIL, which stalls the engine
thread while a server's prepare thread tokenizes it)."""

from __future__ import annotations

import pytest
from tokenizers import Tokenizer as HFTokenizer
from tokenizers import models, pre_tokenizers

from kvrelay.errors import ContextLengthError
from kvrelay.model.tokenizer import Tokenizer


class _NoListsEncoding:
    """An encoding whose length is known but whose ids and offsets must not be read."""

    def __init__(self, inner) -> None:
        self.inner = inner

    def __len__(self) -> int:
        return len(self.inner)

    @property
    def ids(self):
        raise AssertionError("read the ids of a prompt over the limit")

    @property
    def offsets(self):
        raise AssertionError("read the offsets of a prompt over the limit")


class _Backend:
    def __init__(self, inner: HFTokenizer, guard: bool) -> None:
        self.inner, self.guard = inner, guard

    def encode_batch(self, texts, add_special_tokens=False):
        encodings = self.inner.encode_batch(texts, add_special_tokens=add_special_tokens)
        return [_NoListsEncoding(e) for e in encodings] if self.guard else encodings

    def token_to_id(self, name):
        return self.inner.token_to_id(name)

    @property
    def model(self):
        return self.inner.model

    def get_vocab(self, with_added_tokens=True):
        return self.inner.get_vocab(with_added_tokens=with_added_tokens)


def _tokenizer(guard: bool) -> Tokenizer:
    hf = HFTokenizer(models.WordLevel({"a": 0, "b": 1, "[UNK]": 2}, unk_token="[UNK]"))
    hf.pre_tokenizer = pre_tokenizers.Whitespace()
    return Tokenizer(_Backend(hf, guard), None, None, None)


@pytest.mark.parametrize("encode", ["encode", "encode_with_offsets"])
def test_a_text_over_the_limit_is_refused_before_its_ids_are_read(encode):
    with pytest.raises(ContextLengthError, match="has 12 tokens, over the model's context of 10"):
        getattr(_tokenizer(guard=True), encode)("a b " * 6, max_tokens=10)


def test_a_text_within_the_limit_gives_its_ids_and_offsets():
    tok = _tokenizer(guard=False)
    assert tok.encode("a b a", max_tokens=3) == [0, 1, 0]
    assert tok.encode_with_offsets("a b", max_tokens=2) == ([0, 1], [(0, 1), (2, 3)])
    assert tok.encode("a b " * 6) == [0, 1] * 6  # no limit


class _NeverEncodes:
    """A backend whose texts must not be tokenized (everything else from the real one)."""

    def __init__(self, inner) -> None:
        self.inner = inner

    def encode_batch(self, texts, add_special_tokens=False):
        raise AssertionError(f"tokenized a text of {len(texts[0])} characters")

    def __getattr__(self, name):
        return getattr(self.inner, name)


@pytest.fixture(scope="module")
def smollm2_tokenizer() -> Tokenizer:
    from kvrelay.weights.loader import load_tokenizer

    return load_tokenizer("smollm2-135m")


def test_a_text_longer_than_any_prompt_of_the_context_is_refused_before_it_is_tokenized(smollm2_tokenizer):
    tok = Tokenizer(_NeverEncodes(smollm2_tokenizer.backend), None, None, None)
    per_token = tok.max_text_chars_per_token()
    assert per_token == max(map(len, smollm2_tokenizer.backend.get_vocab(with_added_tokens=True)))
    with pytest.raises(ContextLengthError, match="characters, more than a prompt of the model's context of 64"):
        tok.encode("x" * (2 * 64 * per_token + 1), max_tokens=64)


def test_a_text_of_the_longest_tokens_that_fits_the_context_is_tokenized(smollm2_tokenizer):
    vocab = smollm2_tokenizer.backend.get_vocab(with_added_tokens=False)
    longest = smollm2_tokenizer.decode([vocab[max(vocab, key=len)]])
    text = longest * 40  # at most 40 tokens, as long as such a prompt gets
    ids = smollm2_tokenizer.encode(text, max_tokens=40)
    assert 0 < len(ids) <= 40 and smollm2_tokenizer.decode(ids) == text


def test_no_bound_from_length_when_an_unknown_token_covers_any_word():
    tok = _tokenizer(guard=False)
    assert tok.max_text_chars_per_token() == 0
    assert tok.encode("z" * 10_000, max_tokens=1) == [2]  # one [UNK]
