"""``penalties_of`` without a server: a logit_bias key is a 400 naming it, whatever its length."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from kvrelay.server.penalty_check import penalties_of
from kvrelay.server.protocol import ApiError


def _body(**fields):
    return SimpleNamespace(**{"logit_bias": None, "frequency_penalty": None, "presence_penalty": None, **fields})


@pytest.mark.parametrize("key", ["9" * 5000, "1" * 19, "0" * 5000 + "49152"])
def test_a_key_too_long_for_int_is_a_400_naming_it_not_a_value_error(key):
    # int() refuses more than 4300 digits (a ValueError: a 500 after the request was accepted)
    with pytest.raises(ApiError) as info:
        penalties_of(_body(logit_bias={key: 1.0}), 49152)
    assert info.value.status == 400 and info.value.param == f"logit_bias.{key}"


def test_leading_zeros_and_the_last_token_id_are_accepted():
    penalties = penalties_of(_body(logit_bias={"0" * 30 + "5": 1.0, "49151": -1.0}), 49152)
    assert penalties.logit_bias == ((5, 1.0), (49151, -1.0))
