"""logit_bias, frequency_penalty and presence_penalty are honoured (they were accepted and dropped): each request's
greedy tokens match a reference computed from random:tiny's own logits with OpenAI's formula, a request beside them
in the same decode batch is unchanged, and their logprobs are the model's (before the bias, as OpenAI reports)."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
import torch

from kvrelay.engine import Engine, GenerateOptions
from kvrelay.model.sampling import SamplingConfig
from tests.server.conftest import MODEL
from tests.server.live import LiveServer

MESSAGES = [{"role": "user", "content": "Say something about the sea."}]


@pytest.fixture(scope="module")
def srv():
    server = LiveServer(method="full")
    yield server
    server.stop()


def _chat(srv: LiveServer, **fields) -> dict:
    body = {"model": MODEL, "messages": MESSAGES, "temperature": 0, "max_tokens": 1,
            "kvrelay": {"debug": True, "cache_output": False}, **fields}
    reply = httpx.post(f"{srv.url}/v1/chat/completions", json=body, timeout=60)
    assert reply.status_code == 200, reply.text
    return reply.json()


def _ids(reply: dict) -> tuple[list[int], list[int]]:
    debug = reply["kvrelay"]["debug"]
    return debug["prompt_ids"], debug["output_ids"]


def _logits(srv: LiveServer, ids: list[int]) -> torch.Tensor:
    """The model's next-token logits after ``ids``: one full prefill, apart from the server's engine and store."""
    lm = srv.worker.engine.lm
    out = Engine(lm).generate(ids, "full", GenerateOptions(SamplingConfig(max_new_tokens=1)))
    return out.first_logits.float().clone()  # an inference tensor: a clone takes the reference's in-place bias


def _reference(srv: LiveServer, prompt_ids: list[int], num_tokens: int, bias: dict[int, float] | None = None,
               frequency: float = 0.0, presence: float = 0.0) -> list[int]:
    """Greedy tokens under OpenAI's formula: logit + bias - count * frequency - (count > 0) * presence."""
    out: list[int] = []
    stop_ids = srv.worker.engine.lm.tokenizer.stop_ids
    for _ in range(num_tokens):
        logits = _logits(srv, prompt_ids + out)
        for token_id, value in (bias or {}).items():
            logits[token_id] += value
        counts = torch.bincount(torch.tensor(out, dtype=torch.long), minlength=logits.numel()).float()
        token_id = int((logits - counts * frequency - (counts > 0).float() * presence).argmax())
        if token_id in stop_ids:
            break
        out.append(token_id)
    return out


def test_a_bias_of_minus_100_on_the_greedy_token_takes_the_second_best(srv):
    prompt_ids, (greedy,) = _ids(_chat(srv))
    logits = _logits(srv, prompt_ids)
    assert greedy == int(logits.argmax())
    second = int(logits.topk(2).indices[1])
    assert _ids(_chat(srv, logit_bias={str(greedy): -100}))[1] == [second]


def test_a_bias_of_plus_100_forces_a_token_and_its_logprobs_stay_the_models(srv):
    prompt_ids, _ = _ids(_chat(srv))
    logits = _logits(srv, prompt_ids)
    stop_ids = srv.worker.engine.lm.tokenizer.stop_ids
    forced = next(int(t) for t in logits.topk(40).indices[20:] if int(t) not in stop_ids)
    reply = _chat(srv, logit_bias={str(forced): 100}, max_tokens=3, logprobs=True, top_logprobs=2)
    assert _ids(reply)[1] == [forced] * 3
    first = reply["choices"][0]["logprobs"]["content"][0]
    model_logprob = float(torch.log_softmax(logits, -1)[forced])
    assert first["logprob"] == pytest.approx(model_logprob, abs=1e-4)  # not ~0: the bias is not the model's
    assert first["top_logprobs"][0]["logprob"] == pytest.approx(float(torch.log_softmax(logits, -1).max()), abs=1e-4)
    later = reply["choices"][0]["logprobs"]["content"][1]["logprob"]
    assert later < -1  # a decode step's too: far from the biased distribution's ~0


@pytest.mark.parametrize("penalties", [{"frequency_penalty": 2.0}, {"presence_penalty": 2.0},
                                       {"frequency_penalty": 1.5, "presence_penalty": -0.5,
                                        "logit_bias": {"17": 3.5}}])
def test_penalties_match_openais_formula_token_for_token(srv, penalties):
    num_tokens = 12
    prompt_ids, plain = _ids(_chat(srv, max_tokens=num_tokens))
    _, penalized = _ids(_chat(srv, max_tokens=num_tokens, **penalties))
    bias = {int(k): v for k, v in penalties.get("logit_bias", {}).items()}
    expected = _reference(srv, prompt_ids, num_tokens, bias, penalties.get("frequency_penalty", 0.0),
                          penalties.get("presence_penalty", 0.0))
    assert penalized == expected
    assert penalized != plain  # the penalties changed this greedy output: the check above tells them apart


def test_a_request_beside_them_in_one_decode_batch_is_unchanged(srv):
    num_tokens = 10
    prompt_ids, alone = _ids(_chat(srv, max_tokens=num_tokens))
    penalties = {"frequency_penalty": 2.0, "presence_penalty": 1.0, "logit_bias": {str(alone[0]): -100}}
    batch_sizes: list[int] = []
    step = srv.worker.engine.step
    srv.worker.engine.step = lambda seqs: batch_sizes.append(len(seqs)) or step(seqs)
    try:
        srv.worker.pause()
        with ThreadPoolExecutor(2) as pool:
            plain = pool.submit(_chat, srv, max_tokens=num_tokens)
            penalized = pool.submit(_chat, srv, max_tokens=num_tokens, **penalties)
            srv.wait_until(lambda: srv.num_waiting() == 2, "both requests queued")
            srv.worker.resume()
            plain_ids, penalized_ids = _ids(plain.result())[1], _ids(penalized.result())[1]
    finally:
        srv.worker.resume()
        srv.worker.engine.step = step
    assert max(batch_sizes) == 2  # they decoded together
    assert plain_ids == alone
    assert penalized_ids == _reference(srv, prompt_ids, num_tokens, {alone[0]: -100}, 2.0, 1.0)
    assert penalized_ids != alone


def test_zeros_and_an_empty_bias_are_accepted_and_change_nothing(srv):
    _, plain = _ids(_chat(srv, max_tokens=6))
    for fields in ({"frequency_penalty": 0, "presence_penalty": 0.0, "logit_bias": {}},
                   {"frequency_penalty": None, "presence_penalty": None, "logit_bias": None},
                   {"logit_bias": {"5": 0}}):
        assert _ids(_chat(srv, max_tokens=6, **fields))[1] == plain


def test_completions_honour_a_bias_too(srv):
    body = {"model": MODEL, "prompt": "The sea is", "max_tokens": 2, "temperature": 0, "logit_bias": {"1234": 100}}
    reply = httpx.post(f"{srv.url}/v1/completions", json={**body, "kvrelay": {"debug": True}}, timeout=60)
    assert reply.status_code == 200, reply.text
    assert reply.json()["kvrelay"]["debug"]["output_ids"] == [1234, 1234]


@pytest.mark.parametrize(("fields", "param"), [
    ({"frequency_penalty": 3}, "frequency_penalty"),
    ({"presence_penalty": -2.5}, "presence_penalty"),
    ({"presence_penalty": "1"}, "presence_penalty"),
    ({"logit_bias": {"99999999": 1}}, "logit_bias.99999999"),
    ({"logit_bias": {"49152": 1}}, "logit_bias.49152"),  # random:tiny's vocabulary is 49152 tokens
    ({"logit_bias": {"-1": 1}}, "logit_bias.-1"),
    ({"logit_bias": {"hello": 1}}, "logit_bias.hello"),
    ({"logit_bias": {"5": 101}}, "logit_bias.5"),
    ({"logit_bias": {"5": -100.5}}, "logit_bias.5"),
    # a value that is no number named only logit_bias: pydantic's location drops a numeric key as a union tag
    ({"logit_bias": {"5": "1"}}, "logit_bias.5"),
    ({"logit_bias": {"5": True}}, "logit_bias.5"),
    ({"logit_bias": {"5": None}}, "logit_bias.5"),
    ({"logit_bias": [5]}, "logit_bias"),
])
@pytest.mark.parametrize("route", ["chat/completions", "completions"])
def test_out_of_range_or_unknown_tokens_are_400s_naming_the_field(srv, fields, param, route):
    body = {"model": MODEL, "max_tokens": 1, **fields}
    body.update({"messages": MESSAGES} if route == "chat/completions" else {"prompt": "Hi"})
    reply = httpx.post(f"{srv.url}/v1/{route}", json=body, timeout=60)
    assert reply.status_code == 400, reply.text
    assert reply.json()["error"]["param"] == param
