"""vLLM's ``structured_outputs`` through the official openai client's ``extra_body``, on SmolLM2: each constraint's
answers follow it (greedy and sampled, chat and completions, streamed), and what is refused is a 400 naming the
field, the server answering the next request as before."""

from __future__ import annotations

import json
import re
import uuid

import openai
import pytest
from jsonschema import Draft202012Validator

from kvrelay.server import grammar
from tests.server.conftest import SMOL

pytestmark = [pytest.mark.slow, pytest.mark.skipif(grammar.xgr is None, reason="needs xgrammar")]

PERSON = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 20},
                                           "age": {"type": "integer", "minimum": 0, "maximum": 150}},
          "required": ["name", "age"]}
COLOURS = ["red", "green", "blue", "dark purple"]
DIGITS = r"[0-9]{2,5}"
GRAMMAR = 'root ::= "Answer: " ("yes" | "no") "."'
LARK = 'start: "Answer: " ANSWER "."\nANSWER: "yes" | "no"'
# greedy, and sampled hot enough that an unconstrained model would wander off the constraint
SAMPLING = [{"temperature": 0.0}, {"temperature": 1.5, "seed": 7}]


def _chat(server, structured, content="Tell me about a person and their age.", **kw):
    extra = {"structured_outputs": structured, "cache_salt": uuid.uuid4().hex}
    return server.client().chat.completions.create(
        model=SMOL, messages=[{"role": "user", "content": content}], max_tokens=kw.pop("max_tokens", 60),
        extra_body={**extra, **kw.pop("extra", {})}, **kw)


@pytest.mark.parametrize("sampling", SAMPLING)
def test_regex_choice_and_grammars_are_followed(smol, sampling):
    assert re.fullmatch(DIGITS, _chat(smol, {"regex": DIGITS}, **sampling).choices[0].message.content)
    assert _chat(smol, {"choice": COLOURS}, **sampling).choices[0].message.content in COLOURS
    for text in (GRAMMAR, LARK):
        answer = _chat(smol, {"grammar": text}, "Is the sky blue?", **sampling).choices[0].message.content
        assert answer in ("Answer: yes.", "Answer: no."), (text, answer)


@pytest.mark.parametrize("sampling", SAMPLING)
def test_json_follows_the_schema_sent_as_an_object_or_as_text(smol, sampling):
    for schema in (PERSON, json.dumps(PERSON)):
        reply = _chat(smol, {"json": schema}, max_tokens=80, **sampling).choices[0]
        assert reply.finish_reason == "stop"
        Draft202012Validator(PERSON).validate(json.loads(reply.message.content))
    # an open-ended object is where SmolLM2 rambles until max_tokens (as on vLLM): a prompt that says what to write
    reply = _chat(smol, {"json_object": True}, 'Reply with the JSON object {"ok": true}.', max_tokens=80,
                  **sampling).choices[0]
    assert reply.finish_reason == "stop" and isinstance(json.loads(reply.message.content), dict)


def test_disable_any_whitespace_leaves_no_whitespace_in_the_json(smol):
    numbers = {"type": "array", "items": {"type": "integer"}, "maxItems": 3}
    schema = {"type": "object", "properties": {"a": {"type": "integer"}, "b": numbers}, "required": ["a", "b"]}
    for temperature in (0.0, 1.5):
        text = _chat(smol, {"json": schema, "disable_any_whitespace": True}, "Some numbers please.",
                     temperature=temperature, seed=3, max_tokens=80).choices[0].message.content
        assert json.dumps(json.loads(text), separators=(",", ":")) == text  # no string holds a space here


def test_completions_take_structured_outputs_and_response_format(smol):
    client = smol.client()
    salt = {"cache_salt": uuid.uuid4().hex}
    for sampling in SAMPLING:
        out = client.completions.create(model=SMOL, prompt="My phone number is", max_tokens=20, **sampling,
                                        extra_body={**salt, "structured_outputs": {"regex": DIGITS}})
        assert re.fullmatch(DIGITS, out.choices[0].text)
        out = client.completions.create(model=SMOL, prompt="A person as JSON:", max_tokens=80, **sampling,
                                        extra_body={**salt, "response_format": {
                                            "type": "json_schema", "json_schema": {"name": "p", "schema": PERSON}}})
        Draft202012Validator(PERSON).validate(json.loads(out.choices[0].text))


def test_a_streamed_answer_follows_the_constraint(smol):
    stream = smol.client().chat.completions.create(
        model=SMOL, messages=[{"role": "user", "content": "Pick a colour."}], max_tokens=20, stream=True,
        extra_body={"structured_outputs": {"choice": COLOURS}, "cache_salt": uuid.uuid4().hex})
    assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices) in COLOURS


REFUSED = [
    ({"structured_outputs": {"regex": "([a-z"}}, "structured_outputs.regex"),
    ({"structured_outputs": {"regex": "[a-z]{1,5000}"}}, "structured_outputs.regex"),
    ({"structured_outputs": {"regex": "[a-z]{1,600}[0-9]{1,600}"}}, "structured_outputs.regex"),
    ({"structured_outputs": {"grammar": "root ::= "}}, "structured_outputs.grammar"),
    ({"structured_outputs": {"grammar": "start: ("}}, "structured_outputs.grammar"),
    ({"structured_outputs": {"grammar": "root ::= " + " ".join(['"x"'] * 4200)}}, "structured_outputs.grammar"),
    ({"structured_outputs": {"grammar": "root ::= [^x]{1,600} [^y]{1,600}"}}, "structured_outputs.grammar"),
    ({"structured_outputs": {"json": {"type": 5}}}, "structured_outputs.json"),
    ({"structured_outputs": {"json": "{not json"}}, "structured_outputs.json"),
    ({"structured_outputs": {"json_object": False}}, "structured_outputs.json_object"),
    ({"structured_outputs": {"choice": []}}, "structured_outputs.choice"),
    ({"structured_outputs": {"choice": ["x"] * 2000}}, "structured_outputs.choice"),
    ({"structured_outputs": {"regex": "a+", "choice": ["a"]}}, "structured_outputs"),
    ({"structured_outputs": {"disable_any_whitespace": True}}, "structured_outputs"),
    ({"structured_outputs": {"regex": "a+", "whitespace_pattern": " "}}, "structured_outputs.whitespace_pattern"),
    ({"structured_outputs": {"structural_tag": "{}"}}, "structured_outputs.structural_tag"),
    ({"structured_outputs": {"regx": "a+"}}, "structured_outputs.regx"),
    ({"structured_outputs": {"regex": "a+"}, "response_format": {"type": "json_object"}}, "structured_outputs"),
    # compiles, but matches no text: its first mask allows no token, and sampling from it was a 500
    ({"structured_outputs": {"grammar": "root ::= root"}}, "structured_outputs.grammar"),
    ({"guided_regex": "a+"}, "guided_regex"),
    ({"guided_json": {"type": "object"}}, "guided_json"),
]


@pytest.mark.parametrize(("extra", "param"), REFUSED)
def test_what_is_refused_is_a_400_naming_the_field(smol, extra, param):
    with pytest.raises(openai.BadRequestError) as err:
        smol.client().chat.completions.create(model=SMOL, messages=[{"role": "user", "content": "Hi"}],
                                              max_tokens=5, extra_body=extra)
    assert err.value.status_code == 400
    assert err.value.body["param"] == param, err.value.body
    assert err.value.body["message"].startswith(param), err.value.body


def test_completions_refuse_by_name_too(smol):
    with pytest.raises(openai.BadRequestError) as err:
        smol.client().completions.create(model=SMOL, prompt="x", max_tokens=5,
                                         extra_body={"structured_outputs": {"grammar": "root ::= ("}})
    assert err.value.body["param"] == "structured_outputs.grammar"
    with pytest.raises(openai.BadRequestError) as err:
        smol.client().completions.create(model=SMOL, prompt="x", max_tokens=5, extra_body={"guided_choice": ["a"]})
    assert err.value.body["param"] == "guided_choice"


def test_forced_tools_and_a_constraint_are_a_400_and_tool_choice_none_takes_the_constraint(smol):
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {}}}}]
    client = smol.client()
    for choice in ("required", "auto", {"type": "function", "function": {"name": "f"}}):
        with pytest.raises(openai.BadRequestError) as err:
            client.chat.completions.create(model=SMOL, messages=[{"role": "user", "content": "Hi"}], tools=tools,
                                           tool_choice=choice, max_tokens=5,
                                           extra_body={"structured_outputs": {"regex": "a+"}})
        assert err.value.body["param"] == "structured_outputs", choice
    out = client.chat.completions.create(model=SMOL, messages=[{"role": "user", "content": "Pick a colour."}],
                                         tools=tools, tool_choice="none", max_tokens=20, temperature=0,
                                         extra_body={"structured_outputs": {"choice": COLOURS}})
    assert out.choices[0].message.content in COLOURS and not out.choices[0].message.tool_calls


def test_a_grammar_larger_than_a_regex_may_be_is_served(smol):
    """A grammar of many rules is longer than a regex's 4096 characters and cheap to compile (0.1 s for 10 KB)."""
    words = [f"w{i:03d}" for i in range(700)]
    text = "root ::= " + " | ".join(f"r{i}" for i in range(700)) + "\n" + "\n".join(
        f'r{i} ::= "{w}"' for i, w in enumerate(words))
    assert 4096 < len(text) <= 16384
    assert _chat(smol, {"grammar": text}, "Say a word.", temperature=0).choices[0].message.content in words


@pytest.mark.parametrize("stream", [False, True])
def test_a_grammar_that_dead_ends_after_its_first_token_is_the_requests_error_not_the_servers(smol, stream):
    # a rule that only refers to itself, reached after "a": the mask then allows nothing, and the request was a
    # 500 internal_error (the model's fault by its code) although its own grammar cannot be completed
    dead = {"grammar": 'root ::= "a" x\nx ::= x'}
    if not stream:
        with pytest.raises(openai.BadRequestError) as err:
            _chat(smol, dead, max_tokens=10)
        assert err.value.code == "invalid_value" and "cannot be completed" in err.value.message
        return
    events = smol.client().chat.completions.create(
        model=SMOL, messages=[{"role": "user", "content": "Say a."}], max_tokens=10, stream=True,
        extra_body={"structured_outputs": dead, "cache_salt": uuid.uuid4().hex})
    with pytest.raises(openai.APIError) as err:
        for _ in events:
            pass
    assert "cannot be completed" in str(err.value) and "internal" not in str(err.value).lower()
    assert _chat(smol, {"choice": COLOURS}).choices[0].message.content in COLOURS  # the server serves on
