"""The chat template's flags as transformers applies them (the renderer vLLM uses): ``continue_final_message`` cuts
the prompt where transformers cuts it, ``add_generation_prompt`` false leaves the turn closed, and extra template
variables reach the template. Both embedded models' templates: SmolLM2's keeps the message's spacing, Gemma's trims
it (transformers then strips the cut)."""

from __future__ import annotations

import importlib.util

import pytest

from kvrelay.model.tokenizer import Tokenizer
from kvrelay.weights.loader import ALIASES, load_tokenizer

MODELS = [m for m in ("smollm2-135m", "gemma3-270m") if importlib.util.find_spec(ALIASES[m][0]) is not None]
CONVERSATIONS = [
    [{"role": "user", "content": "Name a colour."}, {"role": "assistant", "content": "My favourite colour is "}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
     {"role": "assistant", "content": "Hello! I am"}],
    [{"role": "user", "content": "Continue this list: apples, pears,"}],
]


@pytest.fixture(scope="module", params=MODELS)
def tokenizer(request) -> Tokenizer:
    return load_tokenizer(request.param)


def _transformers(tokenizer: Tokenizer, messages, **flags) -> str:
    render = pytest.importorskip("transformers.utils.chat_template_utils").render_jinja_template
    rendered, _ = render([messages], chat_template=tokenizer.chat_template, bos_token=tokenizer.bos_token,
                         eos_token=tokenizer.eos_token, **flags)
    return rendered[0]


@pytest.mark.parametrize("messages", CONVERSATIONS)
def test_continue_final_message_is_cut_where_transformers_cuts_it(tokenizer, messages):
    ours = tokenizer.apply_chat_template(messages, add_generation_prompt=False, continue_final_message=True)
    assert ours == _transformers(tokenizer, messages, continue_final_message=True, add_generation_prompt=False)
    assert ours.rstrip().endswith(messages[-1]["content"].rstrip())  # the prompt ends inside the final message
    closed = tokenizer.apply_chat_template(messages, add_generation_prompt=False)
    assert closed.startswith(ours) and len(closed) > len(ours)  # the closed turn has its end of turn after it


@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_add_generation_prompt_renders_as_transformers(tokenizer, add_generation_prompt):
    messages = CONVERSATIONS[1][:2]
    ours = tokenizer.apply_chat_template(messages, add_generation_prompt=add_generation_prompt)
    assert ours == _transformers(tokenizer, messages, add_generation_prompt=add_generation_prompt)


def test_a_template_variable_reaches_the_template():
    template = "{% for m in messages %}{{ m.content }}{% endfor %}{% if enable_thinking %}<think>{% endif %}"
    tok = Tokenizer(load_tokenizer("smollm2-135m").backend, template, None, None)
    assert "enable_thinking" in tok.template_variables()
    messages = [{"role": "user", "content": "x"}]
    assert tok.apply_chat_template(messages, template_kwargs={"enable_thinking": True}) == "x<think>"
    assert tok.apply_chat_template(messages, template_kwargs={"enable_thinking": False}) == "x"


def test_a_template_that_drops_the_final_message_cannot_continue_it():
    tok = Tokenizer(load_tokenizer("smollm2-135m").backend, "{{ messages[0].content }}", None, None)
    with pytest.raises(ValueError, match="continue_final_message"):
        tok.apply_chat_template([{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}],
                                add_generation_prompt=False, continue_final_message=True)
