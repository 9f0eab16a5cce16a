"""Request bodies of the OpenAI-compatible API (pydantic) and OpenAI-style errors."""

from __future__ import annotations

from typing import Any, Literal

from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field

from kvrelay.server.tool_protocol import ResponseFormat, ToolCall, ToolChoice, ToolDef

ROLES = ("system", "developer", "user", "assistant", "tool")


class ApiError(Exception):
    """An error the client caused (or a limit it hit), rendered as OpenAI's error JSON."""

    def __init__(self, status: int, message: str, type_: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None, headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type_, param, code
        self.headers = headers

    def response(self) -> JSONResponse:
        return error_response(self.status, self.message, self.type, self.param, self.code, self.headers)


def error_response(status: int, message: str, type_: str = "invalid_request_error", param: str | None = None,
                   code: str | None = None, headers: dict[str, str] | None = None) -> JSONResponse:
    body = {"error": {"message": message, "type": type_, "param": param, "code": code}}
    return JSONResponse(body, status_code=status, headers=headers)


class _Body(BaseModel):
    # agent frameworks send parameters we do not implement (presence_penalty, user, tools...): ignored
    model_config = ConfigDict(extra="ignore")


class KvrelayOptions(_Body):
    method: str | None = None  # a reuse method spec, e.g. "epic" or "relay[l_pre=4]"
    debug: bool = False  # add prompt ids, refs, output ids and the span id to the kvrelay object
    cache_output: bool = True  # False: this completion is not stored for later requests (probes, one-offs)
    # the first token's log-probabilities over the whole vocabulary (base64 of little-endian float32), so a
    # client can measure a method's KL against a `full` call on the same prompt; ~4 bytes x vocab per response
    first_token_logprobs: bool = False


class StreamOptions(_Body):
    include_usage: bool = False


class ContentPart(_Body):
    type: Literal["text"]
    text: str


class ChatMessage(_Body):
    role: str
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None  # an assistant's calls (its content may then be null)
    tool_call_id: str | None = None  # a tool message: the call it answers

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)


class _Sampling(_Body):
    model: str
    max_tokens: int | None = Field(default=None, ge=1)
    temperature: float = Field(default=1.0, ge=0.0, le=2.0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    stop: str | list[str] | None = None
    # what torch.Generator.manual_seed takes; without one each request draws its own (as OpenAI samples)
    seed: int | None = Field(default=None, ge=-(1 << 63), le=(1 << 64) - 1)
    n: int = Field(default=1, ge=1)
    stream: bool = False
    stream_options: StreamOptions | None = None
    cache_salt: str | None = Field(default=None, max_length=256)
    kvrelay: KvrelayOptions | None = None

    def stop_list(self) -> list[str]:
        stops = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        return [s for s in stops if s]


class ChatCompletionRequest(_Sampling):
    messages: list[ChatMessage]
    max_completion_tokens: int | None = Field(default=None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=20)
    tools: list[ToolDef] | None = None
    tool_choice: ToolChoice | None = None  # None: "auto" with tools, "none" without
    parallel_tool_calls: bool | None = None  # None: True (OpenAI's default)
    response_format: ResponseFormat | None = None
    # the deprecated function-calling fields: refused with a 400 (kvrelay.server.tools), not dropped
    functions: list[Any] | None = None
    function_call: Any = None


class CompletionRequest(_Sampling):
    prompt: str | list[str] | list[int]
    logprobs: int | None = Field(default=None, ge=0, le=5)
    echo: bool = False


def validation_message(errors: list[dict[str, Any]]) -> tuple[str, str | None]:
    """One readable message (and the offending parameter) from pydantic's errors."""
    if not errors:
        return "invalid request", None
    first = errors[0]
    loc = [str(p) for p in first.get("loc", ()) if p != "body"]
    param = ".".join(loc) or None
    if first.get("type") == "json_invalid":
        return f"request body is not valid JSON: {first.get('msg', '')}", None
    return f"{param or 'body'}: {first.get('msg', 'invalid value')}", param
