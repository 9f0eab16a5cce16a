"""Request models of tool calling and structured output (OpenAI's chat-completions shapes).

Pydantic checks the shapes; ``check_tools`` / ``check_response_format`` (kvrelay.server.tools) check what
pydantic cannot (unique names, valid JSON schemas, a named tool that exists) and answer a 400 naming the field.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictBool


class _Part(BaseModel):
    model_config = ConfigDict(extra="ignore", populate_by_name=True)


class FunctionDef(_Part):
    # OpenAI's rule for function names; it also keeps a name safe inside the prompt's JSON
    name: str = Field(pattern=r"^[A-Za-z0-9_-]{1,64}$")
    description: str | None = None
    parameters: dict[str, Any] | None = None  # a JSON schema of the arguments object; None: no arguments
    strict: StrictBool | None = None  # calls always follow the schema here (constrained decoding), strict or not


class ToolDef(_Part):
    type: Literal["function"]
    function: FunctionDef


class ToolChoiceFunction(_Part):
    name: str


class NamedToolChoice(_Part):
    type: Literal["function"]
    function: ToolChoiceFunction


ToolChoice = Literal["none", "auto", "required"] | NamedToolChoice


class ToolCallFunction(_Part):
    name: str
    arguments: str  # a JSON text, as the model wrote it


class ToolCall(_Part):
    id: str
    type: Literal["function"] = "function"
    function: ToolCallFunction


class JsonSchemaSpec(_Part):
    name: str = Field(pattern=r"^[A-Za-z0-9_-]{1,64}$")
    description: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: StrictBool | None = None


class ResponseFormat(_Part):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaSpec | None = None
