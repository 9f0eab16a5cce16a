"""Prompt assembly: spliced ids are the upstream ids, at the positions the segments say."""

import pytest

from kvrelay.model.tokenizer import Tokenizer
from kvrelay.pipeline.prompt import chat_prompt_ids, splice_marker
from tests.helpers import toy_tokenizer_metadata


@pytest.fixture(scope="module")
def tok():
    return Tokenizer.from_gguf_metadata(toy_tokenizer_metadata())


def test_spliced_ids_and_positions(tok):
    upstream = [7, 7, 9, 100, 3]  # ids as generated: need not be what re-tokenizing the text would give
    messages = [{"role": "user", "content": "Q?"}, {"role": "assistant", "content": splice_marker("a")},
                {"role": "user", "content": "check " + splice_marker("a")}]
    p = chat_prompt_ids(tok, messages, {"a": upstream})
    refs = [s for s in p.segments if s.ref == "a"]
    assert len(refs) == 2
    for seg in refs:
        assert p.ids[seg.start : seg.end] == upstream
    assert [s.start for s in p.segments] == [0] + [s.end for s in p.segments[:-1]]  # contiguous cover
    assert p.segments[-1].end == len(p.ids)
    text = tok.apply_chat_template(messages).replace(splice_marker("a"), "")
    assert len(p.ids) == len(tok.encode(text)) + 2 * len(upstream)


def test_missing_splice_names_the_output(tok):
    with pytest.raises(KeyError, match="'solver'"):
        chat_prompt_ids(tok, [{"role": "user", "content": splice_marker("solver")}], {})


@pytest.mark.parametrize("text", ["What does \u27e6x\u27e7 mean?", "\u27e6a\u27e7",
                                  "\u27e6\u27e6a\u27e7\u27e7 and \u27e6"])
def test_user_text_that_looks_like_a_marker_is_kept_literally(tok, text):
    messages = [{"role": "user", "content": text}]
    p = chat_prompt_ids(tok, messages, {"a": [7, 7, 7]})
    assert p.ids == tok.encode(tok.apply_chat_template(messages))
    assert all(s.ref is None for s in p.segments)


def test_marker_cannot_be_forged_from_text(tok):
    real = splice_marker("a")
    assert "\u27e6a\u27e7" != real and "a" in real
    forged = real.replace(real[1:-3], "0" * (len(real) - 4))  # right shape, wrong nonce
    p = chat_prompt_ids(tok, [{"role": "user", "content": forged + real}], {"a": [5]})
    assert [s.ref for s in p.segments if s.ref] == ["a"]
