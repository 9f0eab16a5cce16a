"""Run a pipeline: agents in topological order, each call's KV published for the calls after it.

A prompt is segments: template text (tokenized here), task inputs (tokenized once per run, so the
same ids appear in every prompt that holds them) and upstream outputs (their generated ids, spliced
in as generated). Every input or output segment becomes a ``SpanRef`` to the stored span that
already holds those exact ids, which is what the reuse methods plan from.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from kvrelay.engine import Engine, GenerateOptions, GenerationOutput
from kvrelay.errors import KvRelayError
from kvrelay.model.sampling import SamplingConfig
from kvrelay.pipeline.dag import consumers
from kvrelay.pipeline.prompt import PromptIds, chat_prompt_ids, splice_marker
from kvrelay.pipeline.spec import AgentSpec, PipelineSpec, placeholders
from kvrelay.reuse import CallInput, ReuseMethod, SpanRef, role_key


@dataclass
class AgentResult:
    agent: str
    position: int  # index in the run order
    call: CallInput
    prompt: PromptIds
    output: GenerationOutput
    span_id: str


def agent_role(agent: AgentSpec) -> str:
    """``role_key`` of the system message the agent sends (its text with ``{{ }}`` unescaped, as a client sends it);
    "" when it has none, or when it holds a {placeholder} (its text then changes from call to call)."""
    if not agent.system or placeholders(agent.system, f"agent {agent.name!r} system"):
        return ""
    return role_key(agent.system.format())


def render_messages(agent: AgentSpec) -> list[dict[str, str]]:
    """Chat messages of an agent with every {placeholder} turned into a splice marker."""
    marks = {ref: splice_marker(ref) for ref in agent.refs()}
    messages = [{"role": "system", "content": agent.system.format(**marks)}] if agent.system else []
    return messages + [{"role": "user", "content": agent.user.format(**marks)}]


def span_consumers(spec: PipelineSpec) -> dict[str, list[str]]:
    """Agent -> later agents that read its span: its output's readers, plus readers of the task
    inputs it is the first to hold (their ids are reused from its prompt)."""
    out = consumers(spec.order, spec.deps)
    first_holder: dict[str, str] = {}
    for name in spec.order:
        for ref in spec.agent(name).refs():
            if ref in spec.inputs:
                holder = first_holder.setdefault(ref, name)
                if holder != name and name not in out[holder]:
                    out[holder].append(name)
    return out


class PipelineRunner:
    """Runs a pipeline on an engine (which owns the model, the store and the capture layers)."""

    def __init__(self, engine: Engine, spec: PipelineSpec, run_id: str = "run") -> None:
        if engine.store is None:
            raise ValueError("a pipeline publishes every call's KV: its engine needs a store")
        self.engine, self.spec, self.run_id = engine, spec, run_id
        self.lm, self.store = engine.lm, engine.store
        self.readers = span_consumers(spec)

    def span_id(self, agent: str) -> str:
        return f"{self.run_id}/{agent}"

    def prepare(self, agent: AgentSpec, input_ids: dict[str, list[int]], done: dict[str, AgentResult]
                ) -> tuple[CallInput, PromptIds]:
        """Prompt ids of one call and the refs of its input/output segments."""
        splices = {**input_ids, **{name: r.output.output_ids for name, r in done.items()}}
        prompt = chat_prompt_ids(self.lm.tokenizer, render_messages(agent), splices)
        refs = []
        for seg in prompt.segments:
            if seg.ref is None:
                continue
            if seg.ref in done:  # an upstream output: after that call's prompt in its span
                up = done[seg.ref]
                refs.append(SpanRef(seg.start, seg.end, up.span_id, len(up.output.prompt_ids), "output", seg.ref))
                continue
            holder = next((r for r in done.values() if any(s.ref == seg.ref for s in r.prompt.segments)), None)
            if holder is not None:  # a task input some earlier call already prefilled
                src = next(s for s in holder.prompt.segments if s.ref == seg.ref)
                refs.append(SpanRef(seg.start, seg.end, holder.span_id, src.start, "input", seg.ref))
        return CallInput(prompt.ids, refs, agent.name, agent_role(agent)), prompt

    def run(self, inputs: dict[str, str], method: ReuseMethod | str = "full",
            before_call: Callable[[AgentSpec, CallInput, int], None] | None = None,
            progress: Callable[[AgentResult], None] | None = None) -> dict[str, AgentResult]:
        """Run every agent with ``method``; ``before_call`` sees each call while the store holds
        only the spans of the calls before it; ``progress`` sees each finished call's result (so a
        failure later in the run keeps what came before). An error of one call names its agent."""
        self.spec.check_inputs(inputs)
        method = self.engine.method(method)
        input_ids = {name: self.lm.tokenizer.encode(text) for name, text in inputs.items()}
        pending = {name: len(readers) for name, readers in self.readers.items()}
        done: dict[str, AgentResult] = {}
        for position, name in enumerate(self.spec.order):
            agent = self.spec.agent(name)
            try:
                out, call, prompt = self._call(agent, position, method, input_ids, done, before_call)
            except KvRelayError as exc:  # same class, so callers that catch it still do; its text names the agent
                if exc.args and isinstance(exc.args[0], str):
                    exc.args = (f"agent {name!r}: {exc.args[0]}", *exc.args[1:])
                raise
            span_id = self.span_id(name)
            self.engine.publish(span_id, out, pin=pending[name] > 0)
            out.cache = None  # the store has its own copy
            done[name] = AgentResult(name, position, call, prompt, out, span_id)
            for holder, readers in self.readers.items():  # a span is unpinned after its last reader
                if name in readers:
                    pending[holder] -= 1
                    if pending[holder] == 0:
                        self.store.unpin(self.span_id(holder))
            if progress is not None:
                progress(done[name])
        return done

    def _call(self, agent: AgentSpec, position: int, method: ReuseMethod, input_ids: dict[str, list[int]],
              done: dict[str, AgentResult], before_call: Callable[[AgentSpec, CallInput, int], None] | None
              ) -> tuple[GenerationOutput, CallInput, PromptIds]:
        call, prompt = self.prepare(agent, input_ids, done)
        if before_call is not None:
            before_call(agent, call, position)
        sampling = SamplingConfig(agent.max_new_tokens, agent.temperature, agent.top_p)
        forced = None if agent.forced_output is None else self.lm.tokenizer.encode(agent.forced_output)
        out = self.engine.generate(call, method, GenerateOptions(sampling, keep_cache=True, forced_output_ids=forced))
        return out, call, prompt

    def drop_spans(self) -> None:
        for name in self.spec.order:
            if self.span_id(name) in self.store:
                self.store.remove(self.span_id(name))
