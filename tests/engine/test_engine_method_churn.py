"""An engine that serves for weeks: calls that each name a new method spec (a request's ``kvrelay.method``) keep
a bounded number of method objects, and the methods set up at the start are never put out."""

import pytest

from kvrelay.engine import Engine, GenerateOptions
from kvrelay.engine.methods import MAX_ONE_OFF_METHODS
from kvrelay.model.sampling import SamplingConfig
from tests.helpers import tiny_lm


@pytest.fixture(scope="module")
def lm():
    return tiny_lm("llama3")


def test_calls_naming_new_specs_keep_a_bounded_number_of_methods(lm):
    engine = Engine(lm, methods=("full", "kvcomm"))
    kvcomm = engine.method("kvcomm")
    one = GenerateOptions(SamplingConfig(max_new_tokens=1))
    for k in range(MAX_ONE_OFF_METHODS + 20):
        engine.generate([5, 6, 7, 8], f"epic[k={k}]", one)
        assert engine.num_methods <= 2 + MAX_ONE_OFF_METHODS
    assert engine.num_methods == 2 + MAX_ONE_OFF_METHODS
    assert engine.method("kvcomm") is kvcomm  # set up at the start: never put out
    last = f"epic[k={MAX_ONE_OFF_METHODS + 19}]"
    assert engine.method(last) is engine.method(last)  # a recent one is the same object


def test_a_one_off_method_named_again_keeps_its_object_while_recent(lm):
    engine = Engine(lm)
    one = GenerateOptions(SamplingConfig(max_new_tokens=1))
    engine.generate([5, 6, 7, 8], "kvcomm", one)
    kvcomm = engine.method("kvcomm", keep=False)
    for k in range(MAX_ONE_OFF_METHODS + 5):
        engine.generate([5, 6, 7, 8], f"epic[k={k}]", one)
        engine.generate([5, 6, 7, 8], "kvcomm", one)  # used again: the most recent
    assert engine.method("kvcomm") is kvcomm
