"""A request's logprobs hold one entry per output token when its constraint refuses a sampled token (the step is
sampled again, ``kvrelay.engine.constrained.sample_masked``): the refused pick's entry is replaced, not kept, so
each later token's logprob is its own, not the one before it."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from kvrelay.engine.constrained import TokenRefused, sample_masked
from kvrelay.model.sampling import Sampler, SamplingConfig
from kvrelay.server.job import _RecordingSampler


class _Tokenizer:
    def decode(self, ids, **_) -> str:
        return f"<{ids[0]}>"


class _RefusesOnce:
    """Allows every token, and refuses ``refused`` the first time it is taken (a grammar library's disagreement)."""

    def __init__(self, refused: int) -> None:
        self.refused, self.num_refused = refused, 0

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        return logits

    def advance(self, token_id: int) -> None:
        if token_id == self.refused and self.num_refused == 0:
            self.num_refused += 1
            raise TokenRefused(str(token_id))


def test_a_refused_pick_leaves_no_entry_and_the_taken_token_has_its_own_logprob():
    first = {"id": 7}  # the first token's entry, recorded from the prefill's logits
    job = SimpleNamespace(penalized=None, logprobs=[first], num_top_logprobs=2, seq=SimpleNamespace(output_ids=[7]))
    sampler = _RecordingSampler(Sampler(SamplingConfig(temperature=0.0)), job, _Tokenizer())
    logits = torch.tensor([0.0, 1.0, 5.0, 2.0])
    constraint = _RefusesOnce(refused=2)
    for _ in range(2):  # step 1: 2 refused, 3 taken; step 2: 2 taken
        job.seq.output_ids.append(sample_masked(sampler, constraint, logits))
    assert job.seq.output_ids == [7, 3, 2]
    assert [e["id"] for e in job.logprobs] == [7, 3, 2]
    model = torch.log_softmax(logits, -1)
    assert job.logprobs[1]["logprob"] == pytest.approx(float(model[3]))  # the model's, not renormalised without 2
    assert [t["id"] for t in job.logprobs[1]["top_logprobs"]] == [2, 3]  # the refused token is still the model's top
