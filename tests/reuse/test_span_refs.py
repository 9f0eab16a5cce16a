"""A SpanRef is checked against the span it names: a wrong source range is refused, naming the span, its length and
the range (never another text's KV loaded in silence, never a torch error); a span the store lacks is named in the
call's note."""

import pytest

from kvrelay.errors import KvRelayError, SpanRefError
from kvrelay.model.sampling import SamplingConfig
from kvrelay.reuse.base import CallInput, SpanRef
from tests.helpers import generate, relayed_call

# every method that reads a call's refs (full and prefix ignore them); kvcomm reads them as it gates and learns
REF_METHODS = ["naive", "epic", "cacheblend", "relay[band=1:1:2]", "kvcomm"]


@pytest.fixture(scope="module")
def setup():
    return relayed_call("llama3")  # span "up": 24 prompt + 10 output tokens; the call copies the output at [27, 37)


def _run(lm, store, call, method):
    return generate(lm, call, method, store, SamplingConfig(max_new_tokens=1))


@pytest.mark.parametrize("method", REF_METHODS)
def test_a_ref_to_the_wrong_tokens_of_its_span_is_refused(setup, method):
    """src_start 0 instead of 24 (the upstream prompt's length, easy to miss by hand) points at the span's prompt
    tokens: loaded, they would stand in for the output's with no sign of it."""
    lm, store, call = setup
    wrong = CallInput(call.prompt_ids, [SpanRef(27, 37, "up", 0)])
    with pytest.raises(SpanRefError, match=r"SpanRef of 'up': its tokens \[0, 10\) \(of 34\) are not prompt tokens "
                                           r"\[27, 37\): they differ first at prompt token 27"):
        _run(lm, store, wrong, method)


@pytest.mark.parametrize("method", REF_METHODS)
def test_a_ref_past_the_end_of_its_span_is_refused(setup, method):
    lm, store, call = setup
    past = CallInput(call.prompt_ids, [SpanRef(27, 37, "up", 10_000)])
    with pytest.raises(SpanRefError, match=r"SpanRef of 'up' asks for its tokens \[10000, 10010\) \(for prompt "
                                           r"tokens \[27, 37\)\), past the span's 34 tokens"):
        _run(lm, store, past, method)


def test_a_ref_error_is_a_kvrelay_error_and_a_value_error(setup):
    lm, store, call = setup
    with pytest.raises(KvRelayError):
        _run(lm, store, CallInput(call.prompt_ids, [SpanRef(27, 37, "up", 25)]), "naive")
    with pytest.raises(ValueError):  # as a SpanRef out of its prompt always was
        CallInput([1, 2], [SpanRef(0, 5, "up", 0)])


@pytest.mark.parametrize("method", ["naive", "epic", "cacheblend", "relay[band=1:1:2]"])
def test_a_right_ref_is_reused_and_a_missing_span_is_named(setup, method):
    lm, store, call = setup
    out = _run(lm, store, call, method)
    assert out.stats.num_reused_tokens == 24 + 10  # the exact prefix and the copied output
    missing = CallInput(call.prompt_ids, [*call.refs, SpanRef(40, 45, "gone", 0)])
    out = _run(lm, store, missing, method)
    assert out.stats.num_reused_tokens == 34
    assert "span 'gone' not in the store (never published, or evicted)" in out.stats.note
