"""Request bodies of the OpenAI-compatible API (pydantic) and OpenAI-style errors."""

from __future__ import annotations

import functools
import re
from typing import Annotated, Any, Literal

from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field, Strict, ValidationInfo, field_validator
from pydantic_core import PydanticCustomError

from kvrelay.server.structured_protocol import StructuredOutputs
from kvrelay.server.tool_protocol import ResponseFormat, ToolCall, ToolChoice, ToolDef

ROLES = ("system", "developer", "user", "assistant", "tool")


class ApiError(Exception):
    """An error the client caused (or a limit it hit), rendered as OpenAI's error JSON."""

    def __init__(self, status: int, message: str, type_: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None, headers: dict[str, str] | None = None) -> None:
        message = redact_paths(message)
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type_, param, code
        self.headers = headers

    def response(self) -> JSONResponse:
        return error_response(self.status, self.message, self.type, self.param, self.code, self.headers)


SHUTTING_DOWN_CODE = "shutting_down"
#: a 503 shutting_down's Retry-After: retry at once, elsewhere (this replica will not serve it; the load balancer
#: picks another), but not in a tight loop against a balancer that has not yet dropped this one
SHUTTING_DOWN_RETRY_AFTER_S = 1


def shutting_down_error() -> ApiError:
    """What a request the server will not serve any more is answered while it shuts down (a 503: retryable)."""
    return ApiError(503, "the server is shutting down; retry the request (another replica will serve it)",
                    "server_error", code=SHUTTING_DOWN_CODE,
                    headers={"Retry-After": str(SHUTTING_DOWN_RETRY_AFTER_S)})


def error_response(status: int, message: str, type_: str = "invalid_request_error", param: str | None = None,
                   code: str | None = None, headers: dict[str, str] | None = None) -> JSONResponse:
    body = {"error": {"message": _bounded(redact_paths(message)), "type": type_, "param": _bounded(_text(param)),
                      "code": code}}
    return JSONResponse(body, status_code=status, headers=headers)


# an absolute filesystem path's directories (not a URL's, an API route or a JSON pointer such as #/$defs/):
# an error names no server path
_SERVER_DIRS = re.compile(r"(?<![\w:/.~#-])/(?!v1/)(?:[^\s/'\"`,;:()\[\]{}<>]+/)+")


def redact_paths(message: str) -> str:
    """``message`` with the directories of any absolute path replaced (a file's own name stays, as the clue), and
    as valid Unicode (a lone surrogate it quotes from a request escaped, so the error JSON can be encoded)."""
    return _SERVER_DIRS.sub("<server path>/", _text(message))


# an error quotes what the request sent (an id, a model name, a value); a megabyte id is not echoed back whole
MAX_ERROR_TEXT_CHARS = 2000


def _bounded(text: str | None) -> str | None:
    """``text`` cut in the middle to at most about MAX_ERROR_TEXT_CHARS, saying how much was left out."""
    if text is None or len(text) <= MAX_ERROR_TEXT_CHARS:
        return text
    half = MAX_ERROR_TEXT_CHARS // 2
    return f"{text[:half]}... ({len(text) - 2 * half} characters left out) ...{text[-half:]}"


def _text(text: str | None) -> str | None:
    """``text`` as valid Unicode: lone surrogates escaped (\\udfff)."""
    return None if text is None else text.encode("utf-8", "backslashreplace").decode("utf-8")


def _lone_surrogate_at(value: Any) -> str | None:
    """Where in ``value`` (strings, lists, dicts, models that are not request bodies) a string holds a lone
    surrogate ("" for ``value`` itself), or None. Iterative: as deep as JSON nests, no recursion limit."""
    stack: list[tuple[str, Any]] = [("", value)]
    while stack:
        path, item = stack.pop()
        if isinstance(item, str):
            try:
                item.encode("utf-8")
            except UnicodeEncodeError:
                return path
        elif isinstance(item, dict):
            for key, sub in item.items():
                where = f"{path}.{_text(str(key))[:64]}"
                stack.extend(((where, key), (where, sub)))
        elif isinstance(item, list | tuple):
            stack.extend((f"{path}[{i}]", sub) for i, sub in enumerate(item))
        elif isinstance(item, BaseModel) and not isinstance(item, _Body):  # a _Body checked its own fields
            stack.extend((f"{path}.{name}", sub) for name, sub in item.__dict__.items())
    return None


class _Body(BaseModel):
    # agent frameworks send parameters that do not change the answer here (user, metadata...): ignored
    model_config = ConfigDict(extra="ignore")

    @field_validator("*", mode="after")
    @classmethod
    def _valid_unicode(cls, value: Any) -> Any:
        """A lone surrogate (JSON's "\\udfff" alone) is no Unicode text: a 400 naming the field, as OpenAI, not a
        tokenizer's 500 later."""
        where = _lone_surrogate_at(value)
        if where is not None:
            raise PydanticCustomError("lone_surrogate", "holds a lone surrogate ({where}), which is not valid "
                                      "Unicode text", {"where": f"at {where.lstrip('.')}" if where else "a \\uD800-"
                                                       "\\uDFFF escape without its pair"})
        return value


# OpenAI is strict where a lax parser would coerce: true is no max_tokens, "yes" no stream, "42" no seed.
# Numbers stay numbers: a float field takes an integer (temperature: 1), as OpenAI does.
StrictInt = Annotated[int, Strict()]
StrictBool = Annotated[bool, Strict()]
StrictFloat = Annotated[float, Strict()]


def null_is_default(cls, value: Any, info: ValidationInfo) -> Any:
    """A ``mode="before"`` field validator for fields OpenAI types "... or null" that have a default here: null is
    the field not given (its default), every other value is checked as strictly as the field says ("0.5" is no
    temperature). Fields whose default is None take null as they are."""
    return cls.model_fields[info.field_name].get_default(call_default_factory=True) if value is None else value


class KvrelayOptions(_Body):
    method: str | None = None  # a reuse method spec, e.g. "epic" or "relay[l_pre=4]"
    debug: StrictBool = False  # add prompt/output ids, refs, the span id and tier decisions to the kvrelay object
    cache_output: StrictBool = True  # False: this completion is not stored for later requests (probes, one-offs)
    # the first token's log-probabilities over the whole vocabulary (base64 of little-endian float32), so a
    # client can measure a method's KL against a `full` call on the same prompt; ~4 bytes x vocab per response
    first_token_logprobs: StrictBool = False


class StreamOptions(_Body):
    include_usage: StrictBool = False


class ContentPart(_Body):
    type: Literal["text"]
    text: str


class RefusalPart(_Body):
    """An assistant's earlier refusal, as OpenAI returns it and accepts it back (an assistant's content only)."""

    type: Literal["refusal"]
    refusal: str


class ChatMessage(_Body):
    role: str
    content: str | list[ContentPart | RefusalPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None  # an assistant's calls (its content may then be null)
    tool_call_id: str | None = None  # a tool message: the call it answers
    refusal: str | None = None  # an assistant's refusal beside null content, as OpenAI's replies carry it

    def text(self) -> str:
        """What the message said; a refusal is the words the assistant answered with, so it is rendered as text."""
        if self.content is None:
            return self.refusal or ""
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text if isinstance(part, ContentPart) else part.refusal for part in self.content)


#: the longest ``cache_salt`` (a body's, and the quality route's query)
MAX_SALT_CHARS = 256


class _Sampling(_Body):
    model: str
    max_tokens: StrictInt | None = Field(default=None, ge=1)
    temperature: StrictFloat = Field(default=1.0, ge=0.0, le=2.0)
    top_p: StrictFloat = Field(default=1.0, gt=0.0, le=1.0)
    stop: str | list[str] | None = None
    # what torch.Generator.manual_seed takes; without one each request draws its own (as OpenAI samples)
    seed: StrictInt | None = Field(default=None, ge=-(1 << 63), le=(1 << 64) - 1)
    n: StrictInt = Field(default=1, ge=1)
    stream: StrictBool = False
    stream_options: StreamOptions | None = None
    cache_salt: str | None = Field(default=None, max_length=MAX_SALT_CHARS)
    kvrelay: KvrelayOptions | None = None
    # OpenAI's ranges; None as 0 (frameworks send null or 0 for "off"). A bias's key, value and range are checked by
    # ``kvrelay.server.penalty_check``: it knows the vocabulary, and names the key (an error location here would
    # drop a numeric key as a union member's tag: a value that is no number was a 400 naming only logit_bias)
    frequency_penalty: StrictFloat | None = Field(default=None, ge=-2.0, le=2.0)
    presence_penalty: StrictFloat | None = Field(default=None, ge=-2.0, le=2.0)
    logit_bias: dict[str, Any] | None = None
    # vLLM's extra parameters (``extra_body``), in vLLM's ranges: which are served and which refused is
    # ``kvrelay.server.vllm_params``; None is vLLM's default (off)
    top_k: StrictInt | None = Field(default=None, ge=-1)  # 0 or -1: off
    min_p: StrictFloat | None = Field(default=None, ge=0.0, le=1.0)
    repetition_penalty: StrictFloat | None = Field(default=None, gt=0.0, allow_inf_nan=False)
    min_tokens: StrictInt | None = Field(default=None, ge=0)
    stop_token_ids: list[StrictInt] | None = None
    ignore_eos: StrictBool | None = None
    include_stop_str_in_output: StrictBool | None = None
    skip_special_tokens: StrictBool | None = None
    spaces_between_special_tokens: StrictBool | None = None
    # refused unless their no-op value (``kvrelay.server.vllm_params.REFUSED``): typed there, not here
    use_beam_search: Any = None
    length_penalty: Any = None
    watermarking: Any = None
    truncate_prompt_tokens: Any = None
    truncation_side: Any = None
    prompt_logprobs: Any = None
    logprob_token_ids: Any = None
    allowed_token_ids: Any = None
    bad_words: Any = None
    thinking_token_budget: Any = None
    vllm_xargs: Any = None
    kv_transfer_params: Any = None
    ec_transfer_params: Any = None
    repetition_detection: Any = None
    documents: Any = None
    chat_template: Any = None
    add_special_tokens: Any = None
    mm_processor_kwargs: Any = None
    media_io_kwargs: Any = None
    prompt_embeds: Any = None
    priority: Any = None
    return_token_ids: Any = None
    return_tokens_as_token_ids: Any = None
    return_prompt_text: Any = None

    _null_sampling = field_validator("temperature", "top_p", "n", "stream", mode="before")(null_is_default)

    def stop_list(self) -> list[str]:
        stops = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        return [s for s in stops if s]


class _VllmStructured(_Body):
    """vLLM's structured outputs, on chat and completions (``kvrelay.server.structured_outputs``)."""

    structured_outputs: StructuredOutputs | None = None
    # the guided_* fields vLLM removed: refused by name, pointing at structured_outputs (not dropped)
    guided_json: Any = None
    guided_regex: Any = None
    guided_choice: Any = None
    guided_grammar: Any = None
    guided_decoding_backend: Any = None
    guided_whitespace_pattern: Any = None


class ChatCompletionRequest(_Sampling, _VllmStructured):
    messages: list[ChatMessage]
    max_completion_tokens: StrictInt | None = Field(default=None, ge=1)
    logprobs: StrictBool = False
    top_logprobs: StrictInt | None = Field(default=None, ge=0, le=20)
    tools: list[ToolDef] | None = None
    tool_choice: ToolChoice | None = None  # None: "auto" with tools, "none" without
    parallel_tool_calls: StrictBool | None = None  # None: True (OpenAI's default)
    response_format: ResponseFormat | None = None
    # the deprecated function-calling fields: refused with a 400 (kvrelay.server.tools), not dropped
    functions: list[Any] | None = None
    function_call: Any = None
    # audio output: refused with a 400 (kvrelay.server.chat_route): dropped, the answer would come without it
    modalities: list[Any] | None = None
    audio: Any = None
    # each changes the answer on OpenAI and has no counterpart here: refused when set (kvrelay.server.chat_route)
    web_search_options: Any = None
    moderation: Any = None
    verbosity: Any = None  # "medium", OpenAI's default, is what every answer here is
    # vLLM's chat-template parameters (kvrelay.server.chat_template_params)
    add_generation_prompt: StrictBool = True
    continue_final_message: StrictBool = False
    chat_template_kwargs: dict[str, Any] | None = None
    echo: StrictBool = False  # refused when true

    _null_chat = field_validator("logprobs", "echo", mode="before")(null_is_default)


class CompletionRequest(_Sampling, _VllmStructured):
    prompt: str | list[str] | list[StrictInt]
    logprobs: StrictInt | None = Field(default=None, ge=0, le=5)
    echo: StrictBool = False
    # refused when set to anything but their no-op (kvrelay.server.completions_route): each changes the answer
    suffix: str | None = None
    best_of: StrictInt | None = None
    # response_format on completions, as on vLLM (kvrelay.server.structured_outputs)
    response_format: ResponseFormat | None = None

    _null_completion = field_validator("echo", mode="before")(null_is_default)


def validation_message(errors: list[dict[str, Any]]) -> tuple[str, str | None]:
    """One readable message (and the offending parameter) from pydantic's errors."""
    if not errors:
        return "invalid request", None
    # a value no member of a union takes gives one error per member: the one that got furthest names the problem
    # ("messages.0.content.0.text: holds a lone surrogate", not "messages.0.content: Input should be a valid string")
    field_errors = [e for e in errors if _field_loc(e)[:1] == _field_loc(errors[0])[:1]]
    first = max(field_errors, key=lambda e: len(_field_loc(e)))
    loc = _field_loc(first)
    param = ".".join(loc) or None
    if first.get("type") == "json_invalid":
        return f"request body is not valid JSON: {first.get('msg', '')}", None
    if not loc and first.get("type") in ("model_attributes_type", "dict_type", "missing"):
        # a body that is no JSON object (a list, a string, a form: curl's -d without a JSON Content-Type)
        return "the request body must be a JSON object, sent with Content-Type: application/json", None
    return f"{param or 'body'}: {first.get('msg', 'invalid value')}", param


def _field_loc(error: dict[str, Any]) -> list[str]:
    loc = error.get("loc", ())
    if loc[:1] in (("query",), ("path",)):  # where a GET's parameter was: the parameter's name alone names it
        loc = loc[1:]
    return [str(p) for p in loc if p != "body" and not _is_union_tag(p)]


def _is_union_tag(part: Any) -> bool:
    """pydantic names the member of a union in an error's location ("str", "list[int]", a model's class name such
    as "NamedToolChoice"): not a field."""
    return isinstance(part, str) and (not part.isidentifier() or part in ("str", "int", "float", "bool", "list",
                                                                          "dict", "none") or part in _model_names())


@functools.cache
def _model_names() -> frozenset[str]:
    """Class names of kvrelay's request models (the tags of their union members); all are defined by the time a
    request is validated."""
    names, stack = set(), [BaseModel]
    while stack:
        for sub in stack.pop().__subclasses__():
            stack.append(sub)
            if sub.__module__.startswith("kvrelay."):
                names.add(sub.__name__)
    return frozenset(names)
