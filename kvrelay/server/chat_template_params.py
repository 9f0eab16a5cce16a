"""vLLM's chat-template parameters of a chat request, checked: ``add_generation_prompt``,
``continue_final_message``, ``chat_template_kwargs`` and ``echo``.

- ``continue_final_message``: the prompt ends inside the final message (no end of turn after it), and the model
  continues it; as vLLM, it cannot be sent with ``add_generation_prompt`` true (its default), so a request sends
  ``add_generation_prompt: false`` beside it. The prompt is cut where transformers (so vLLM) cuts it: the same ids.
- ``chat_template_kwargs``: the keys the model's chat template reads are passed to it; the others are dropped, as
  vLLM drops them (the embedded models' templates read none: ``enable_thinking`` and the like change nothing
  there). Keys the server sets itself (``messages``, ``add_generation_prompt``...) are refused by name: vLLM
  refuses ``chat_template`` and ``tokenize`` and overrides the rest with the request's own fields.
- ``echo`` (vLLM prepends the final message to the answer): refused when true; the client has that text.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from kvrelay.server.protocol import ApiError, ChatCompletionRequest

# what the server passes the template itself (kvrelay.model.tokenizer), and what vLLM refuses in the kwargs
RESERVED_KWARGS = frozenset({"messages", "add_generation_prompt", "continue_final_message", "bos_token",
                             "eos_token", "tools", "documents", "chat_template", "tokenize", "raise_exception",
                             "strftime_now"})


@dataclass(frozen=True)
class TemplateParams:
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    kwargs: dict[str, Any] = field(default_factory=dict)  # the chat_template_kwargs the template reads


def template_params(body: ChatCompletionRequest, template_variables: frozenset[str]) -> TemplateParams:
    """The request's checked template parameters; ``template_variables``: what the model's template reads. A 400
    naming the field for what is refused (module docstring)."""
    if body.echo:
        raise ApiError(400, "echo is not supported on chat completions: the answer holds the new text only (send "
                       "continue_final_message to continue the final message, and prepend it yourself)",
                       param="echo", code="unsupported")
    if body.continue_final_message and body.add_generation_prompt:
        raise ApiError(400, "continue_final_message: cannot be sent with add_generation_prompt true (its default); "
                       "send add_generation_prompt: false beside it, as vLLM requires",
                       param="continue_final_message", code="invalid_value")
    kwargs = body.chat_template_kwargs or {}
    for key in kwargs:
        if key in RESERVED_KWARGS:
            top = f": send it as the request's own {key}" if hasattr(body, key) else ""
            raise ApiError(400, f"chat_template_kwargs.{key} is set by the server and cannot be passed to the chat "
                           f"template{top}", param=f"chat_template_kwargs.{key}", code="invalid_value")
    return TemplateParams(body.add_generation_prompt, body.continue_final_message,
                          {k: v for k, v in kwargs.items() if k in template_variables})
