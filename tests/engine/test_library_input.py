"""What the Python API does with input of the wrong kind: one KvRelayError naming it (a ValueError too, where a
ValueError was raised before), never a torch or jinja error, never a silent run on something else."""

import numpy as np
import pytest
import torch

from kvrelay.engine import Engine, GenerateOptions
from kvrelay.errors import ConfigError, InputError, KvRelayError, PromptError, SpliceError
from kvrelay.model.sampling import SamplingConfig
from kvrelay.model.tokenizer import Tokenizer
from kvrelay.pipeline.prompt import chat_prompt_ids, splice_marker
from kvrelay.reuse.base import CallInput
from tests.helpers import tiny_lm, toy_tokenizer_metadata

ONE = GenerateOptions(SamplingConfig(max_new_tokens=1))


@pytest.fixture(scope="module")
def engine():
    return Engine(tiny_lm("llama3"))


@pytest.mark.parametrize("prompt, words", [
    ("hello", r"got str"), (b"hi", r"got bytes"), (None, r"got NoneType"), (7, r"got int"),
    ([1.5, 2.0], r"item 0 is 1.5 \(float\)"), ([True, 5], r"item 0 is True \(bool\)"),
    ([1, "2"], r"item 1 is '2' \(str\)"), ([torch.tensor(1.0)], r"item 0 .*\(Tensor\)"),
])
def test_a_prompt_that_is_not_token_ids_is_one_clear_error(engine, prompt, words):
    for run in (engine.generate, engine.start, engine.begin):
        with pytest.raises(PromptError, match=rf"prompt must be a list of int token ids.*{words}.*tokenize text"):
            run(prompt, "full", ONE)
    with pytest.raises(PromptError, match="prompt must be a list of int token ids"):
        CallInput(prompt)


def test_integer_ids_of_other_types_are_token_ids(engine):
    plain = engine.generate([3, 4, 5], "full", ONE)
    for ids in ([np.int64(3), np.int64(4), np.int64(5)], torch.tensor([3, 4, 5]), (3, 4, 5)):
        out = engine.generate(ids, "full", ONE)
        assert out.prompt_ids == [3, 4, 5] and all(type(t) is int for t in out.prompt_ids)
        assert out.output_ids == plain.output_ids


@pytest.mark.parametrize("prompt, words", [([], "empty prompt"), ([1, 10**9], "outside .*vocabulary")])
def test_an_empty_or_out_of_vocabulary_prompt_is_a_prompt_error_and_a_value_error(engine, prompt, words):
    with pytest.raises(PromptError, match=words) as err:
        engine.generate(prompt, "full", ONE)
    assert isinstance(err.value, ValueError) and isinstance(err.value, KvRelayError)


def test_stop_ids_are_token_ids_and_a_stop_string_is_named():
    assert GenerateOptions(stop_ids=[np.int64(2), 3]).stop_ids == frozenset({2, 3})
    stop_error = r"GenerateOptions.stop_ids must be int token ids.*encode\(text\).*stops on token ids only\)"
    for bad in (["</s>"], "</s>", [2.5]):
        with pytest.raises(InputError, match=stop_error):
            GenerateOptions(stop_ids=bad)
    with pytest.raises(InputError, match=r"GenerateOptions.forced_output_ids must be int token ids, got \['a'\] "
                                         r"\(lm.tokenizer.encode\(text\) gives a text's ids\)"):
        GenerateOptions(forced_output_ids=["a"])


@pytest.mark.parametrize("lm, words", [
    ("smollm2-135m", r"not the name or path 'smollm2-135m': Engine\(load_model\('smollm2-135m'\)\)"),
    (object(), r"Engine takes a loaded model \(kvrelay.weights.load_model\), got object"),
])
def test_an_engine_given_a_model_name_says_to_load_it(lm, words):
    with pytest.raises(ConfigError, match=words):
        Engine(lm)


@pytest.fixture(scope="module")
def tok():
    return Tokenizer.from_gguf_metadata(toy_tokenizer_metadata())


@pytest.mark.parametrize("messages, words", [
    ([{"role": "user"}], r"messages\[0\]\['content'\] must be a string, got missing"),
    ([{"role": "user", "content": None}], r"messages\[0\]\['content'\] must be a string, got a NoneType"),
    ([{"content": "hi"}], r"messages\[0\]\['role'\] must be a string, got missing"),
    (["hi"], r"messages\[0\] must be a dict with 'role' and 'content', got str"),
    ("hi", r"messages must be a list"),
])
def test_malformed_messages_are_named(tok, messages, words):
    with pytest.raises(InputError, match=words):
        chat_prompt_ids(tok, messages)


def test_a_missing_splice_is_a_splice_error_and_still_a_key_error(tok):
    messages = [{"role": "user", "content": "check " + splice_marker("a")}]
    with pytest.raises(SpliceError, match=r"prompt refers to output 'a', which was not given \(splices has \['b'\]\)"):
        chat_prompt_ids(tok, messages, {"b": [1]})
    with pytest.raises(KeyError, match="no spliced output 'z' in this prompt"):
        chat_prompt_ids(tok, messages, {"a": [1]}).span_of("z")
