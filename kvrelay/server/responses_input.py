"""The Responses API request (``POST /v1/responses``) and its translation into a chat-completions body.

A Responses request runs through the chat-completions job path, so reuse, tools and constrained decoding
work identically: ``input`` items become chat messages (``function_call`` items an assistant's
``tool_calls``, but for a call cut off, ``is_cut_call``; ``function_call_output`` items ``role: "tool"`` messages),
``instructions`` a leading system message, flat function tools and ``text.format`` their chat-completions shapes.
What cannot be translated without changing the answer (hosted tools, images, files, stored prompts, conversations,
background runs) is a 400 naming the field and the value.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, field_validator

from kvrelay.server.protocol import (
    MAX_SALT_CHARS,
    ApiError,
    KvrelayOptions,
    StrictBool,
    StrictFloat,
    StrictInt,
    _Body,
    null_is_default,
)

LOGPROBS_INCLUDE = "message.output_text.logprobs"
# the other values OpenAI documents for ``include``: each asks for more of an item this server never produces (hosted
# tools' calls, input images, reasoning), so there is nothing to add and the answer is the same: accepted (a client
# that always sends reasoning.encrypted_content works). Any other value is a typo or newer than this list: a 400.
IGNORED_INCLUDES = ("code_interpreter_call.outputs", "computer_call_output.output.image_url",
                    "file_search_call.results", "message.input_image.image_url", "reasoning.encrypted_content",
                    "web_search_call.action.sources", "web_search_call.results")
_TEXT_PARTS = ("input_text", "output_text", "text", "refusal")


class ResponsesRequest(_Body):
    # what OpenAI accepts but cannot change the answer here (user, service_tier, prompt_cache_key,
    # reasoning, stream_options, ...) is ignored; what would change it is a field below and refused if set.
    # _Body: a lone surrogate is a 400 naming this request's field, before translation (its chat message's name)
    # and before the response echoes it (metadata: a 500 once encoding the response failed)

    model: str
    input: str | list[dict[str, Any]] = Field(default_factory=list)
    instructions: str | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: StrictBool | None = None
    text: dict[str, Any] | None = None
    max_output_tokens: StrictInt | None = Field(default=None, ge=1)
    temperature: StrictFloat | None = Field(default=None, ge=0.0, le=2.0)
    top_p: StrictFloat | None = Field(default=None, gt=0.0, le=1.0)
    top_logprobs: StrictInt | None = Field(default=None, ge=0, le=20)
    include: list[str] | None = None
    stream: StrictBool = False
    store: StrictBool | None = None  # None: True, as OpenAI
    previous_response_id: str | None = None
    metadata: dict[str, str] | None = None
    truncation: Literal["auto", "disabled"] | None = None
    # refused when set: each changes the answer and has no counterpart here
    background: StrictBool | None = None
    conversation: Any = None
    prompt: Any = None
    max_tool_calls: StrictInt | None = None
    moderation: Any = None
    context_management: list[Any] | None = None
    # kvrelay's extensions, as on chat completions
    seed: StrictInt | None = Field(default=None, ge=-(1 << 63), le=(1 << 64) - 1)
    cache_salt: str | None = Field(default=None, max_length=MAX_SALT_CHARS)
    kvrelay: KvrelayOptions | None = None
    # vLLM's extra parameters its ResponsesRequest has: passed to the chat request, which types, serves or refuses
    # them (kvrelay.server.vllm_params)
    top_k: Any = None
    min_p: Any = None
    repetition_penalty: Any = None
    stop: Any = None
    stop_token_ids: Any = None
    ignore_eos: Any = None
    skip_special_tokens: Any = None
    include_stop_str_in_output: Any = None
    watermarking: Any = None
    media_io_kwargs: Any = None
    mm_processor_kwargs: Any = None
    priority: Any = None
    vllm_xargs: Any = None
    kv_transfer_params: Any = None
    ec_transfer_params: Any = None
    presence_penalty: Any = None
    frequency_penalty: Any = None
    logit_bias: Any = None
    structured_outputs: Any = None
    chat_template_kwargs: Any = None

    _null_stream = field_validator("stream", mode="before")(null_is_default)


#: the fields above that pass to the chat request as they are (each changes the answer on vLLM: dropped, it would
#: change nothing here, with no error)
VLLM_FIELDS = ("top_k", "min_p", "repetition_penalty", "stop", "stop_token_ids", "ignore_eos", "skip_special_tokens",
               "include_stop_str_in_output", "watermarking", "media_io_kwargs", "mm_processor_kwargs", "priority",
               "vllm_xargs", "kv_transfer_params", "ec_transfer_params", "presence_penalty", "frequency_penalty",
               "logit_bias", "structured_outputs", "chat_template_kwargs")


def _refuse(message: str, param: str | None, code: str = "unsupported") -> ApiError:
    return ApiError(400, message, param=param, code=code)


def check_supported(body: ResponsesRequest) -> None:
    """400 for the parameters that would change the answer and that kvrelay cannot honour."""
    if body.background:
        raise _refuse("background responses are not supported: send the request and wait (or stream)",
                      "background")
    if body.conversation is not None:
        raise _refuse("conversations are not supported: use previous_response_id or send the items",
                      "conversation")
    if body.prompt is not None:
        raise _refuse("stored prompt templates are not supported: send instructions and input", "prompt")
    for i, value in enumerate(body.include or []):
        if value != LOGPROBS_INCLUDE and value not in IGNORED_INCLUDES:
            raise _refuse(f"include[{i}] {value!r} is not one of {', '.join((LOGPROBS_INCLUDE, *IGNORED_INCLUDES))}",
                          f"include.{i}", "invalid_value")
    if body.max_tool_calls is not None:
        raise _refuse("max_tool_calls is not supported; parallel_tool_calls=false allows one call per response",
                      "max_tool_calls")
    if body.moderation is not None:
        raise _refuse("moderation is not supported: this server runs no moderation model; moderate in the client",
                      "moderation")
    if body.context_management:
        raise _refuse("context_management is not supported: this server does not compact a conversation; a "
                      "prompt over the context is a 400 (context_length_exceeded)", "context_management")
    verbosity = (body.text or {}).get("verbosity")
    if verbosity not in (None, "medium"):
        raise _refuse(f"text.verbosity {verbosity!r} is not supported: the model is not told how long to answer; "
                      "omit it (or send 'medium') and bound the answer with max_output_tokens", "text.verbosity")


def _text_of(content: Any, param: str) -> str:
    """The text of an item's content: a string or a list of text parts; other parts are a 400."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise _refuse(f"{param} must be a string or a list of content parts", param, "invalid_value")
    texts = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind not in _TEXT_PARTS:
            raise _refuse(f"{param}[{j}].type {kind!r} is not supported: this model reads text only "
                          f"({', '.join(_TEXT_PARTS)})", f"{param}.{j}.type")
        value = part.get("refusal" if kind == "refusal" else "text")
        if not isinstance(value, str):
            raise _refuse(f"{param}[{j}] has no text", f"{param}.{j}", "invalid_value")
        texts.append(value)
    return "".join(texts)


def _field(item: dict, key: str, param: str) -> str:
    value = item.get(key)
    if not isinstance(value, str):
        raise _refuse(f"{param}.{key} is missing or not a string", f"{param}.{key}", "invalid_value")
    return value


def input_messages(items: str | list[dict[str, Any]]) -> list[dict]:
    """Chat messages of a Responses ``input``. A ``function_call`` joins the assistant message right
    before it (a response's text and calls are one assistant turn in chat completions)."""
    if isinstance(items, str):
        return [{"role": "user", "content": items}]
    messages: list[dict] = []
    for i, item in enumerate(items):
        param = f"input.{i}"
        kind = item.get("type") or ("message" if "role" in item else None)
        if kind == "message":
            role = item.get("role")
            if role not in ("user", "system", "developer", "assistant"):
                raise _refuse(f"{param}.role {role!r} is not one of user, system, developer, assistant",
                              f"{param}.role", "invalid_value")
            messages.append({"role": role, "content": _text_of(item.get("content"), f"{param}.content")})
        elif kind == "function_call":
            call = {"id": _field(item, "call_id", param), "type": "function",
                    "function": {"name": _field(item, "name", param), "arguments": _field(item, "arguments", param)}}
            last = messages[-1] if messages else None
            if is_cut_call(item):  # left out, its turn kept: as the stored conversation holds that response
                if last is None or last["role"] != "assistant":
                    messages.append({"role": "assistant", "content": ""})
                continue
            if last is None or last["role"] != "assistant":
                last = {"role": "assistant", "content": None}
                messages.append(last)
            last.setdefault("tool_calls", []).append(call)
        elif kind == "function_call_output":
            messages.append({"role": "tool", "tool_call_id": _field(item, "call_id", param),
                             "content": _text_of(item.get("output"), f"{param}.output")})
        elif kind == "reasoning":
            continue  # never produced here; another provider's reasoning is not text a chat template shows
        else:
            raise _refuse(f"{param}.type {kind!r} is not supported; kvrelay reads message, function_call and "
                          "function_call_output items", f"{param}.type")
    return messages


def is_cut_call(item: dict[str, Any]) -> bool:
    """A ``function_call`` item that ``max_output_tokens`` cut off (``status: "incomplete"``, as a response's output
    lists it): a client replaying that output sends it back. The stored conversation leaves such a call out (the
    model never finished it and no tool ran it), so a replayed one is left out alike: not shown to the model, and it
    needs no ``function_call_output``."""
    return item.get("type") == "function_call" and item.get("status") == "incomplete"


def check_call_outputs(items: str | list[dict[str, Any]], history: list[dict]) -> None:
    """A ``function_call_output`` answers a call made before it, in the stored history or earlier in ``input``: a
    400 naming the item (the chat check after translation would name a chat message the client never sent)."""
    if isinstance(items, str):
        return
    seen = {call.get("id") for m in history for call in m.get("tool_calls") or []}
    for i, item in enumerate(items):
        if item.get("type") == "function_call" and not is_cut_call(item):
            seen.add(item.get("call_id"))
        elif item.get("type") == "function_call_output" and item.get("call_id") not in seen:
            raise _refuse(f"input.{i}.call_id {item.get('call_id')!r} answers no function_call before it (in input "
                          "or the previous response)", f"input.{i}.call_id", "invalid_value")


def chat_tools(tools: list[dict[str, Any]] | None) -> list[dict] | None:
    """Flat Responses function tools in chat-completions' nested shape; any other tool type is a 400."""
    if tools is None:
        return None
    out = []
    for i, tool in enumerate(tools):
        if tool.get("type") != "function":
            raise _refuse(f"tools[{i}].type {tool.get('type')!r} is not supported: kvrelay runs no hosted tools, "
                          "only function tools (type 'function') that the client executes", f"tools.{i}.type")
        function = {k: tool[k] for k in ("name", "description", "parameters", "strict") if tool.get(k) is not None}
        out.append({"type": "function", "function": function})
    return out


def chat_tool_choice(choice: str | dict[str, Any] | None) -> str | dict | None:
    if choice is None or isinstance(choice, str):
        return choice
    if choice.get("type") != "function":
        raise _refuse(f"tool_choice.type {choice.get('type')!r} is not supported: use 'auto', 'none', 'required' "
                      "or {'type': 'function', 'name': ...}", "tool_choice.type")
    return {"type": "function", "function": {"name": choice.get("name")}}


def chat_response_format(text: dict[str, Any] | None) -> dict | None:
    fmt = (text or {}).get("format")
    if fmt is not None and not isinstance(fmt, dict):  # `text` is any dict, so its format comes unchecked
        raise _refuse("text.format must be an object, e.g. {\"type\": \"json_object\"}", "text.format",
                      "invalid_value")
    if fmt is None or fmt.get("type") == "text":
        return None
    if fmt.get("type") == "json_object":
        return {"type": "json_object"}
    if fmt.get("type") == "json_schema":
        spec = {k: fmt[k] for k in ("name", "description", "schema", "strict") if fmt.get(k) is not None}
        return {"type": "json_schema", "json_schema": spec}
    raise _refuse(f"text.format.type {fmt.get('type')!r} is not one of text, json_object, json_schema",
                  "text.format.type", "invalid_value")


def chat_body(body: ResponsesRequest, history: list[dict], messages: list[dict]) -> dict:
    """The chat-completions request body that runs ``body`` after the stored ``history``."""
    check_supported(body)
    system = [{"role": "system", "content": body.instructions}] if body.instructions else []
    chat: dict[str, Any] = {"model": body.model, "messages": system + history + messages, "stream": False}
    for key, value in (("max_completion_tokens", body.max_output_tokens), ("temperature", body.temperature),
                       ("top_p", body.top_p), ("seed", body.seed), ("cache_salt", body.cache_salt),
                       ("tools", chat_tools(body.tools)), ("tool_choice", chat_tool_choice(body.tool_choice)),
                       ("parallel_tool_calls", body.parallel_tool_calls),
                       ("response_format", chat_response_format(body.text))):
        if value is not None:
            chat[key] = value
    for key in VLLM_FIELDS:
        if getattr(body, key) is not None:
            chat[key] = getattr(body, key)
    if body.kvrelay is not None:
        chat["kvrelay"] = body.kvrelay.model_dump()
    if LOGPROBS_INCLUDE in (body.include or []):
        chat["logprobs"] = True
        chat["top_logprobs"] = body.top_logprobs or 0
    return chat
