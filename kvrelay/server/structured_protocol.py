"""The request shape of vLLM's ``structured_outputs`` (its ``StructuredOutputsParams``), as agents coming from vLLM
send it through the openai client's ``extra_body``. Pydantic checks the shape; kvrelay.server.structured_outputs
checks the rest (one constraint, sizes, what compiles) and builds the grammar.

Unknown keys are refused (vLLM drops them silently): a misspelt ``regx`` would otherwise decode unconstrained.
"""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, Field, Strict

StrictBool = Annotated[bool, Strict()]

#: the fields of which a request may set exactly one (vLLM's rule)
CONSTRAINT_FIELDS = ("json", "regex", "choice", "grammar", "json_object", "structural_tag")


class StructuredOutputs(BaseModel):
    model_config = ConfigDict(extra="forbid")

    # a JSON schema, as an object or as its JSON text ("json" in the request: the name shadows BaseModel.json)
    json_: str | dict[str, Any] | None = Field(default=None, alias="json")
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None  # xgrammar's EBNF (GBNF), or Lark (converted by xgrammar, as vLLM does)
    json_object: StrictBool | None = None
    structural_tag: Any = None  # refused (kvrelay.server.structured_outputs)
    # options
    disable_any_whitespace: StrictBool = False
    disable_additional_properties: StrictBool = False
    whitespace_pattern: str | None = None  # refused unless null: xgrammar takes no whitespace pattern
    disable_fallback: StrictBool = False  # a no-op: one grammar backend, nothing to fall back to

    def constraints(self) -> list[str]:
        """The constraint fields this request sets (vLLM's names)."""
        values = {"json": self.json_, "regex": self.regex, "choice": self.choice, "grammar": self.grammar,
                  "json_object": self.json_object, "structural_tag": self.structural_tag}
        return [name for name in CONSTRAINT_FIELDS if values[name] is not None]
