"""PipelineSpec: agents with a system prompt and a user template whose {placeholders} name task
inputs or upstream agents. Edges follow from the placeholders. Loaded from YAML, validated."""

from __future__ import annotations

import string
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from kvrelay.pipeline.dag import PipelineError, topological_order
from kvrelay.validation import first_error


def placeholders(template: str, where: str) -> list[str]:
    """Names of the ``{name}`` placeholders of a template.

    Only plain ``{name}`` is a placeholder; ``{{`` and ``}}`` are literal braces. Format specs
    (``{a:>40}``) and conversions (``{a!r}``) are errors: a spliced output is token ids, not text
    that could be padded or quoted."""
    try:
        parsed = list(string.Formatter().parse(template))
    except ValueError as exc:
        raise PipelineError(f"{where}: bad template ({exc}); write literal braces as {{{{ and }}}}") from exc
    names = []
    for _, name, spec, conversion in parsed:
        if name is None:
            continue
        if not name.isidentifier():
            raise PipelineError(f"{where}: placeholder {{{name}}} is not a plain name (write {{name}}; literal "
                                "braces as {{{{ and }}}})")
        if spec or conversion:
            shown = name + (f"!{conversion}" if conversion else "") + (f":{spec}" if spec else "")
            raise PipelineError(f"{where}: placeholder {{{shown}}} has a format spec or conversion; only plain "
                                f"{{{name}}} is allowed")
        names.append(name)
    return names


class _AgentModel(BaseModel):
    """One agent of a pipeline file: types are strict (no "ten", no true for a count, no .nan)."""

    model_config = ConfigDict(extra="forbid", strict=True)
    name: str
    user: str
    system: str = ""
    max_new_tokens: int = Field(128, ge=1)
    temperature: float = Field(0.0, ge=0, allow_inf_nan=False)
    top_p: float = Field(1.0, gt=0, le=1, allow_inf_nan=False)
    forced_output: str | None = None


class _PipelineModel(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    name: str | None = None
    inputs: list[str] = []
    agents: list[_AgentModel] = Field(min_length=1)
    output: str = ""


@dataclass(frozen=True)
class AgentSpec:
    name: str
    user: str
    system: str = ""
    max_new_tokens: int = 128
    temperature: float = 0.0
    top_p: float = 1.0
    forced_output: str | None = None  # a fixed output (deterministic microbenchmarks), not sampled

    def refs(self) -> list[str]:
        return placeholders(self.system, f"agent {self.name!r} system") + \
            placeholders(self.user, f"agent {self.name!r} user")


@dataclass(frozen=True)
class PipelineSpec:
    name: str
    inputs: tuple[str, ...]
    agents: tuple[AgentSpec, ...]
    output: str = ""  # whose output is the pipeline's answer (default: the last agent in order)
    order: tuple[str, ...] = field(default=(), init=False)
    deps: dict[str, tuple[str, ...]] = field(default_factory=dict, init=False)

    def __post_init__(self) -> None:
        if not self.agents:
            raise PipelineError(f"pipeline {self.name!r} has no agents")
        for i, name in enumerate(self.inputs):
            if name in self.inputs[:i]:
                raise _at(f"input {name!r} is listed twice", "inputs", i)
        names = [a.name for a in self.agents]
        for i, a in enumerate(self.agents):
            if not a.name or not a.name.isidentifier():
                raise _at(f"agent name {a.name!r} must be a plain identifier", "agents", i, "name")
            if a.name in names[:i]:
                raise _at(f"duplicate agent name {a.name!r}", "agents", i, "name")
            if a.name in self.inputs:
                raise _at(f"agent {a.name!r} has the name of an input", "agents", i, "name")
            if a.max_new_tokens < 1:
                raise _at(f"agent {a.name!r}: max_new_tokens must be >= 1, got {a.max_new_tokens}",
                          "agents", i, "max_new_tokens")
        deps = {}
        for i, a in enumerate(self.agents):
            agent_refs = []
            for part in ("system", "user"):
                try:
                    refs = placeholders(getattr(a, part), f"agent {a.name!r} {part}")
                except PipelineError as exc:
                    exc.loc = ("agents", i, part)
                    raise
                for ref in refs:
                    if ref == a.name:
                        raise _at(f"agent {a.name!r} refers to its own output {{{ref}}}", "agents", i, part)
                    if ref in names:
                        agent_refs.append(ref)
                    elif ref not in self.inputs:
                        raise _at(f"agent {a.name!r}: unknown reference {{{ref}}} (not an input: "
                                  f"{list(self.inputs)}; not an agent: {names})", "agents", i, part)
            deps[a.name] = tuple(dict.fromkeys(agent_refs))
        object.__setattr__(self, "deps", deps)
        object.__setattr__(self, "order", tuple(topological_order(names, deps)))
        if self.output and self.output not in names:
            raise _at(f"pipeline output {self.output!r} is not an agent", "output")
        if not self.output:
            object.__setattr__(self, "output", self.order[-1])

    def agent(self, name: str) -> AgentSpec:
        return next(a for a in self.agents if a.name == name)

    def check_inputs(self, values: dict[str, str]) -> None:
        missing = [i for i in self.inputs if i not in values]
        if missing:
            raise PipelineError(f"pipeline {self.name!r}: missing input(s) {missing}; give them with --input NAME=TEXT")
        extra = [k for k in values if k not in self.inputs]
        if extra:
            raise PipelineError(f"pipeline {self.name!r}: unknown input(s) {extra}; inputs are {list(self.inputs)}")

    @classmethod
    def from_dict(cls, d: Any, where: str = "pipeline", line_of: Callable[[tuple], int | None] | None = None
                  ) -> PipelineSpec:
        """Validate a parsed pipeline file; ``line_of`` maps a field's location to its line in the file."""
        if not isinstance(d, dict):
            raise PipelineError(f"{where}: expected a mapping with 'agents', got {type(d).__name__}")
        raw = d.get("agents")
        names = {i: a["name"] for i, a in enumerate(raw) if isinstance(a, dict) and isinstance(a.get("name"), str)
                 } if isinstance(raw, list) else {}
        try:
            model = _PipelineModel.model_validate(d)
        except ValidationError as exc:
            line = line_of(tuple(exc.errors()[0]["loc"])) if line_of else None
            raise PipelineError(first_error(exc, f"{where}:{line}" if line else where, names)) from None
        agents = tuple(AgentSpec(**a.model_dump()) for a in model.agents)
        try:
            return cls(name=model.name if model.name is not None else where, inputs=tuple(model.inputs),
                       agents=agents, output=model.output)
        except PipelineError as exc:  # the checks across fields, placed like the field checks above
            loc = getattr(exc, "loc", None)
            line = line_of(loc) if line_of and loc else None
            raise PipelineError(f"{where}:{line}: {exc}" if line else f"{where}: {exc}") from None

    @classmethod
    def from_yaml(cls, path: str | Path) -> PipelineSpec:
        import yaml

        path = Path(path)
        if path.is_dir():
            raise PipelineError(f"{path}: is a folder; give the pipeline's YAML file")
        if not path.is_file():
            raise PipelineError(f"pipeline file not found: {path}")
        try:
            data = yaml.load(path.read_text(encoding="utf-8"), Loader=_strict_loader())  # noqa: S506 (a SafeLoader)
        except yaml.YAMLError as exc:
            raise PipelineError(f"{path}: malformed YAML ({' '.join(str(exc).split())})") from None
        except (OSError, UnicodeDecodeError) as exc:
            raise PipelineError(f"{path}: cannot read the pipeline file ({exc})") from None
        except _DuplicateKeyError as exc:
            raise PipelineError(f"{path}:{exc.line}: key {exc.key!r} is given twice (a later one would silently "
                                "replace the first)") from None
        return cls.from_dict(data, where=str(path), line_of=lambda loc: _yaml_line(path, loc))


def _at(message: str, *loc: str | int) -> PipelineError:
    """A PipelineError that knows the field it is about (``from_dict`` turns that into a line of the file)."""
    exc = PipelineError(message)
    exc.loc = loc
    return exc


class _DuplicateKeyError(Exception):
    def __init__(self, key: object, line: int) -> None:
        super().__init__(key, line)
        self.key, self.line = key, line


def _strict_loader() -> type:
    import yaml

    class StrictLoader(yaml.SafeLoader):
        """SafeLoader that refuses a key given twice in one mapping (PyYAML keeps the last, silently)."""

        def construct_mapping(self, node, deep=False):  # noqa: ANN001, ANN202 (PyYAML's signature)
            seen = set()
            for key_node, _ in node.value:
                key = self.construct_object(key_node, deep=True)
                if isinstance(key, str | int | float | bool) or key is None:
                    if key in seen:
                        raise _DuplicateKeyError(key, key_node.start_mark.line + 1)
                    seen.add(key)
            return super().construct_mapping(node, deep=deep)

    return StrictLoader


def _yaml_line(path: Path, loc: tuple) -> int | None:
    """1-based line of the YAML node at ``loc`` (keys and list indices), or of its nearest parent."""
    import yaml

    try:
        node = yaml.compose(path.read_text(encoding="utf-8"))
    except (yaml.YAMLError, OSError, UnicodeDecodeError):
        return None
    line = None
    for part in loc:
        if node is None:
            break
        line = node.start_mark.line + 1
        if isinstance(node, yaml.MappingNode):
            hit = next(((k, v) for k, v in node.value if getattr(k, "value", None) == part), None)
            node = None if hit is None else hit[1]
            if hit is not None:
                line = hit[0].start_mark.line + 1
        elif isinstance(node, yaml.SequenceNode) and isinstance(part, int) and part < len(node.value):
            node = node.value[part]
            line = node.start_mark.line + 1
        else:
            node = None
    return line
