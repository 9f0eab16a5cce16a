"""PipelineSpec: agents with a system prompt and a user template whose {placeholders} name task
inputs or upstream agents. Edges follow from the placeholders. Loaded from YAML, validated."""

from __future__ import annotations

import string
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvrelay.pipeline.dag import PipelineError, topological_order

_AGENT_KEYS = {"name", "system", "user", "max_new_tokens", "temperature", "top_p", "forced_output"}


def placeholders(template: str, where: str) -> list[str]:
    """Field names in a ``str.format`` template (``{{`` / ``}}`` are literal braces)."""
    try:
        names = [f for _, f, spec, conv in string.Formatter().parse(template) if f is not None]
    except ValueError as exc:
        raise PipelineError(f"{where}: bad template ({exc}); write literal braces as {{{{ and }}}}") from exc
    for name in names:
        if not name.isidentifier():
            raise PipelineError(f"{where}: placeholder {{{name}}} is not a plain name")
    return names


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
        names = [a.name for a in self.agents]
        for a in self.agents:
            if not a.name or not a.name.isidentifier():
                raise PipelineError(f"agent name {a.name!r} must be a plain identifier")
            if names.count(a.name) > 1:
                raise PipelineError(f"duplicate agent name {a.name!r}")
            if a.name in self.inputs:
                raise PipelineError(f"agent {a.name!r} has the name of an input")
            if a.max_new_tokens < 1:
                raise PipelineError(f"agent {a.name!r}: max_new_tokens must be >= 1, got {a.max_new_tokens}")
        deps = {}
        for a in self.agents:
            agent_refs = []
            for ref in a.refs():
                if ref == a.name:
                    raise PipelineError(f"agent {a.name!r} refers to its own output {{{ref}}}")
                if ref in names:
                    agent_refs.append(ref)
                elif ref not in self.inputs:
                    raise PipelineError(
                        f"agent {a.name!r}: unknown reference {{{ref}}} (not an input: {list(self.inputs)}; "
                        f"not an agent: {names})"
                    )
            deps[a.name] = tuple(dict.fromkeys(agent_refs))
        object.__setattr__(self, "deps", deps)
        object.__setattr__(self, "order", tuple(topological_order(names, deps)))
        if self.output and self.output not in names:
            raise PipelineError(f"pipeline output {self.output!r} is not an agent")
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
    def from_dict(cls, d: Any, where: str = "pipeline") -> PipelineSpec:
        if not isinstance(d, dict):
            raise PipelineError(f"{where}: expected a mapping with 'agents', got {type(d).__name__}")
        agents_raw = d.get("agents")
        if not isinstance(agents_raw, list) or not agents_raw:
            raise PipelineError(f"{where}: 'agents' must be a non-empty list")
        agents = []
        for i, a in enumerate(agents_raw):
            if not isinstance(a, dict):
                raise PipelineError(f"{where}: agents[{i}] must be a mapping")
            unknown = set(a) - _AGENT_KEYS
            if unknown:
                raise PipelineError(f"{where}: agents[{i}] ({a.get('name')!r}) has unknown key(s) {sorted(unknown)}")
            for key in ("name", "user"):
                if not isinstance(a.get(key), str):
                    raise PipelineError(f"{where}: agents[{i}] needs a string {key!r}")
            try:
                agents.append(AgentSpec(**{k: v for k, v in a.items()}))
            except TypeError as exc:
                raise PipelineError(f"{where}: agents[{i}] ({a.get('name')!r}): {exc}") from exc
        inputs = d.get("inputs", [])
        if not isinstance(inputs, list) or not all(isinstance(x, str) for x in inputs):
            raise PipelineError(f"{where}: 'inputs' must be a list of names")
        return cls(name=str(d.get("name", where)), inputs=tuple(inputs), agents=tuple(agents),
                   output=str(d.get("output", "")))

    @classmethod
    def from_yaml(cls, path: str | Path) -> PipelineSpec:
        import yaml

        path = Path(path)
        if not path.is_file():
            raise PipelineError(f"pipeline file not found: {path}")
        try:
            data = yaml.safe_load(path.read_text())
        except yaml.YAMLError as exc:
            raise PipelineError(f"{path}: malformed YAML ({exc})") from exc
        return cls.from_dict(data, where=str(path))
