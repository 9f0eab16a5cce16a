"""The chat template ``kvrelay export-hf`` writes renders tool conversations as ``kvrelay serve`` renders them: the
same prompt text from transformers' ``apply_chat_template`` (what vLLM runs, with vLLM's message shapes: call
arguments as a parsed object) as from kvrelay serve's own rendering on the model's template, and conversations
without tools exactly as the model's own template renders them."""

from __future__ import annotations

import copy
import importlib.util
import json

import pytest

from kvrelay.weights.loader import ALIASES
from kvrelay.weights.tool_template import tool_chat_template

pytest.importorskip("transformers")
MODELS = [pytest.param(alias, marks=pytest.mark.skipif(importlib.util.find_spec(ALIASES[alias][0]) is None,
                                                       reason=f"{alias} is not installed"))
          for alias in ("smollm2-135m", "gemma3-270m")]
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city now.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
CLOCK = {"type": "function", "function": {"name": "get_time"}}  # no description, no parameters
CALLS = [{"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}},
         {"id": "call_2", "type": "function", "function": {"name": "get_time", "arguments": "{}"}}]


def _parts(*texts: str) -> list[dict]:
    return [{"type": "text", "text": t} for t in texts]


CONVERSATIONS = {
    "first step": ([{"role": "system", "content": "You answer weather questions."},
                    {"role": "user", "content": "Weather in Paris?"}], [WEATHER]),
    "no system message": ([{"role": "user", "content": "Weather in Paris?"}], [WEATHER, CLOCK]),
    "developer message": ([{"role": "developer", "content": "Be brief."},
                           {"role": "user", "content": "Weather in Paris?"}], [WEATHER]),
    "two calls, results, a user message after them": (
        [{"role": "system", "content": "You answer weather questions."},
         {"role": "user", "content": "Weather and time in Paris?"},
         {"role": "assistant", "content": None, "tool_calls": CALLS},
         {"role": "tool", "tool_call_id": "call_1", "content": "21 degrees, sunny"},
         {"role": "tool", "tool_call_id": "call_2", "content": "14:05"},
         {"role": "user", "content": "Answer in one sentence."}], [WEATHER, CLOCK]),
    "history without tools": ([{"role": "user", "content": "Weather in Paris?"},
                               {"role": "assistant", "content": "Let me look.", "tool_calls": CALLS[:1]},
                               {"role": "tool", "tool_call_id": "call_1", "content": "21 degrees"}], None),
    # content as an array of text parts (OpenAI's other shape; kvrelay serve joins the parts' text)
    "a system message in parts, with tools": ([{"role": "system", "content": _parts("You answer ", "weather.")},
                                               {"role": "user", "content": "Weather in Paris?"}], [WEATHER]),
    "an assistant's text in parts beside its calls": (
        [{"role": "user", "content": "Weather in Paris?"},
         {"role": "assistant", "content": _parts("Let me ", "look."), "tool_calls": CALLS[:1]},
         {"role": "tool", "tool_call_id": "call_1", "content": "21 degrees"}], [WEATHER]),
    "a tool result in parts": ([{"role": "user", "content": "Weather and time in Paris?"},
                                {"role": "assistant", "content": None, "tool_calls": CALLS},
                                {"role": "tool", "tool_call_id": "call_1", "content": _parts("21 degrees, ", "sunny")},
                                {"role": "tool", "tool_call_id": "call_2", "content": _parts("14:05")}],
                               [WEATHER, CLOCK]),
    "a user message in parts after results": (
        [{"role": "user", "content": "Weather in Paris?"},
         {"role": "assistant", "content": None, "tool_calls": CALLS[:1]},
         {"role": "tool", "tool_call_id": "call_1", "content": "21 degrees"},
         {"role": "user", "content": _parts("Answer in ", "one sentence.")}], [WEATHER]),
}


@pytest.fixture(scope="module", params=MODELS)
def tokenizers(request):
    """(kvrelay's tokenizer with the model's own template, transformers' on the same tokenizer with the exported
    template)."""
    from transformers import PreTrainedTokenizerFast

    from kvrelay.weights.loader import load_model

    lm = load_model(request.param, progress=False)
    hf = PreTrainedTokenizerFast(tokenizer_object=lm.tokenizer.backend, bos_token=lm.tokenizer.bos_token,
                                 eos_token=lm.tokenizer.eos_token)
    hf.chat_template = tool_chat_template(lm.tokenizer.chat_template)
    return lm.tokenizer, hf


def _kvrelay_serve_text(tokenizer, messages: list[dict], tools: list[dict] | None) -> str:
    from kvrelay.server.protocol import ChatCompletionRequest
    from kvrelay.server.tools import plan_tools, render_messages

    body = ChatCompletionRequest.model_validate({"model": "m", "messages": messages,
                                                 **({"tools": tools} if tools else {})})
    return tokenizer.apply_chat_template(render_messages(body, plan_tools(body)))


def _as_vllm_sends(messages: list[dict]) -> list[dict]:
    """vLLM hands a template each call's arguments parsed into an object (renderers/chat_utils.py)."""
    out = copy.deepcopy(messages)
    for m in out:
        for call in m.get("tool_calls") or []:
            call["function"]["arguments"] = json.loads(call["function"]["arguments"])
    return out


@pytest.mark.parametrize("name", CONVERSATIONS)
def test_tool_conversations_render_as_kvrelay_serve_renders_them(tokenizers, name):
    kvrelay_tok, hf_tok = tokenizers
    messages, tools = CONVERSATIONS[name]
    expected = _kvrelay_serve_text(kvrelay_tok, messages, tools)
    for sent in (messages, _as_vllm_sends(messages)):
        got = hf_tok.apply_chat_template(sent, tools=tools, tokenize=False, add_generation_prompt=True)
        assert got == expected


def test_the_call_a_later_step_renders_is_the_text_the_model_was_forced_to_write(tokenizers):
    kvrelay_tok, hf_tok = tokenizers
    messages, tools = CONVERSATIONS["first step"]
    call = CALLS[0]["function"]
    step = [*messages, {"role": "assistant", "content": None, "tool_calls": CALLS[:1]}]
    first = hf_tok.apply_chat_template(messages, tools=tools, tokenize=False, add_generation_prompt=True)
    second = hf_tok.apply_chat_template(_as_vllm_sends(step), tools=tools, tokenize=False)
    generated = f'<tool_call>{{"name": "{call["name"]}", "arguments": {call["arguments"]}}}</tool_call>'
    assert second.startswith(first + generated)


def test_messages_without_tools_render_as_the_models_own_template(tokenizers):
    kvrelay_tok, hf_tok = tokenizers
    messages = [{"role": "system", "content": "Solve it."}, {"role": "user", "content": "2 + 3?"},
                {"role": "assistant", "content": "5"}, {"role": "user", "content": "And 2 + 4?"}]
    for conversation in (messages, messages[1:]):
        expected = kvrelay_tok.apply_chat_template(conversation)
        assert hf_tok.apply_chat_template(conversation, tokenize=False, add_generation_prompt=True) == expected
    # kvrelay serve on an exported folder renders with the exported template, through kvrelay's own Jinja
    exported = copy.copy(kvrelay_tok)
    exported.chat_template, exported._template = hf_tok.chat_template, None
    assert exported.apply_chat_template(messages) == kvrelay_tok.apply_chat_template(messages)


def test_the_preamble_is_added_once():
    template = tool_chat_template("{{ messages[0]['content'] }}")
    assert tool_chat_template(template) == template
