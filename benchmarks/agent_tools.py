"""Tool loops of real agent frameworks against ``kvrelay serve``: cached share and TTFT per step, per method.

    python benchmarks/agent_tools.py --model smollm2-135m --methods full,epic --runs 2 \
        --json benchmarks/results/agent-tools-cpu.json

Per framework (the OpenAI Agents SDK on its chat-completions model, LangGraph with langchain-openai, AutoGen
AgentChat, smolagents), one flow of four or five model steps: a researcher calls a ``search`` tool over a fixed
corpus (MMLU astronomy questions with their correct answers, ``--data``) and writes notes from the results, a
writer drafts an answer from the notes, a reviewer checks the draft against the notes. Each method gets its own server
(``--method``), started here on a free port; each run asks about another corpus question, in a fresh
``cache_salt`` namespace. (The Agents SDK's Responses model raises on an answer cut by ``max_output_tokens``,
which SmolLM2's notes often are in a bounded budget; the chat-completions model reads it as finish_reason
"length".)

Per step, from the server's reply (an httpx response hook on the framework's own client): prompt tokens,
``cached_tokens``, the server's TTFT (``kvrelay.ttft_ms``: plan, reused-KV load, prefill, first token), and
the flow's end-to-end wall time. The researcher's tool calls are forced (tool_choice "required": the Agents
SDK resets it to "auto" after the call, LangGraph's dynamic model sends "none" once a result is in; AutoGen's
AssistantAgent always sends "auto", so its client's ``extra_body`` forces "required" for two search iterations
and its notes are AutoGen's tool-call summary, without a reflection step; smolagents' ToolCallingAgent sends
"required" on every step, with ``final_answer`` among its tools, for two steps, then its own summary step).
"""

from __future__ import annotations

import argparse
import asyncio
import csv
import json
import os
import platform
import re
import socket
import statistics
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Annotated

import httpx
from pydantic import BaseModel, Field

REPO = Path(__file__).resolve().parents[1]
DEFAULT_DATA = REPO.parent / "shared" / "data" / "mmlu" / "astronomy_test.csv"
FRAMEWORKS = ("agents", "langgraph", "autogen", "smolagents")
RESEARCHER = "You are a researcher. Call the search tool to find facts, then write short notes from the results."
WRITER = "You are a writer. Write a two-sentence answer to the question from the research notes."
REVIEWER = "You are a reviewer. Say whether the draft agrees with the notes and name one fix."
# the researcher's budget holds a whole call (a call cut by max_tokens is text, and the flow goes on without it)
MAX_TOKENS = {"researcher": 160, "writer": 64, "reviewer": 48}


# ---------------------------------------------------------------------- the corpus and its search tool
# a bounded query (the tools' JSON schema says maxLength): SmolLM2 otherwise may write one query until max_tokens
Query = Annotated[str, Field(max_length=80)]


def load_corpus(path: Path) -> list[str]:
    """One document per MMLU row: the question and its correct answer."""
    docs = []
    with open(path, newline="") as f:
        for row in csv.reader(f):
            question, options, letter = row[0], row[1:5], row[5].strip()
            docs.append(f"{question} Answer: {options['ABCD'.index(letter)]}")
    return docs


def _words(text: str) -> set[str]:
    return {w for w in re.findall(r"[a-z]+", text.lower()) if len(w) > 3}


def search(docs: list[str], query: str, k: int = 2) -> str:
    """The ``k`` documents sharing the most words with ``query`` (ties: corpus order)."""
    q = _words(query)
    ranked = sorted(range(len(docs)), key=lambda i: (-len(q & _words(docs[i])), i))[:k]
    return "\n".join(f"[{i}] {docs[i]}" for i in ranked)


# ---------------------------------------------------------------------- servers and replies
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerProcess:
    def __init__(self, model: str, method: str, log_dir: Path, flags: list[str] | None = None) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = open(log_dir / f"agent-tools-{method}-{self.port}.log", "w")
        # --quality-target off: the guard (on by default) would serve each role its rung instead of ``method``;
        # ``flags`` replaces both (``[]``: the server's defaults, the guard on)
        flags = ["--method", method, "--quality-target", "off"] if flags is None else flags
        command = [sys.executable, "-m", "kvrelay.server", "--model", model, *flags, "--port", str(self.port)]
        self.proc = subprocess.Popen(command, stdout=self.log, stderr=subprocess.STDOUT, cwd=REPO,
                                     env={**os.environ, "PYTHONPATH": str(REPO)})
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode}; see {self.log.name}")
            try:
                if httpx.get(f"{self.url}/health", timeout=1).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        self.stop()
        raise RuntimeError("server did not start in 300 s")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
        self.log.close()


class Steps:
    """Every model step's reply, as the framework's httpx client received it."""

    def __init__(self) -> None:
        self.rows: list[dict] = []
        self.agent = ""

    def _record(self, response: httpx.Response) -> None:
        if not response.request.url.path.endswith(("/chat/completions", "/responses")):
            return
        body = json.loads(response.content)
        usage = body["usage"]
        prompt = usage.get("prompt_tokens", usage.get("input_tokens"))
        details = usage.get("prompt_tokens_details") or usage.get("input_tokens_details") or {}
        output = body.get("output") or body.get("choices", [{}])[0].get("message", {}).get("tool_calls") or []
        calls = [o for o in output if o.get("type") in ("function_call", "function")]
        ext = body["kvrelay"]
        self.rows.append({"agent": self.agent, "prompt_tokens": prompt, "cached_tokens": details["cached_tokens"],
                          "cached_share": details["cached_tokens"] / prompt, "ttft_ms": ext["ttft_ms"],
                          "queue_ms": ext["queue_ms"], "num_tool_calls": len(calls)})

    def hook(self, response: httpx.Response) -> None:
        response.read()
        self._record(response)

    async def ahook(self, response: httpx.Response) -> None:
        await response.aread()
        self._record(response)

    def sync_client(self) -> httpx.Client:
        return httpx.Client(event_hooks={"response": [self.hook]}, timeout=600)

    def async_client(self) -> httpx.AsyncClient:
        return httpx.AsyncClient(event_hooks={"response": [self.ahook]}, timeout=600)


def _writer_task(question: str, notes: str) -> str:
    return f"Question: {question}\n\nResearch notes:\n{notes}"


def _reviewer_task(question: str, notes: str, draft: str) -> str:
    return f"Question: {question}\n\nResearch notes:\n{notes}\n\nDraft:\n{draft}"


# ---------------------------------------------------------------------- the three frameworks
def run_agents(url: str, model_id: str, docs: list[str], question: str, steps: Steps) -> None:
    from agents import Agent, ModelSettings, OpenAIChatCompletionsModel, Runner, function_tool, set_tracing_disabled
    from openai import AsyncOpenAI

    set_tracing_disabled(True)
    salt = uuid.uuid4().hex

    @function_tool
    def search_corpus(query: Query) -> str:
        """Search the astronomy notes."""
        return search(docs, query)

    async def flow() -> None:
        client = AsyncOpenAI(base_url=f"{url}/v1", api_key="none", http_client=steps.async_client())
        model = OpenAIChatCompletionsModel(model=model_id, openai_client=client)

        def agent(name: str, instructions: str, **kw) -> Agent:
            settings = ModelSettings(temperature=0, max_tokens=MAX_TOKENS[name], extra_body={"cache_salt": salt},
                                     tool_choice=kw.pop("tool_choice", None), parallel_tool_calls=False)
            return Agent(name=name, instructions=instructions, model=model, model_settings=settings, **kw)

        steps.agent = "researcher"  # tool_choice "required", reset to "auto" once the tool ran (the SDK default)
        notes = (await Runner.run(agent("researcher", RESEARCHER, tools=[search_corpus], tool_choice="required"),
                                  question, max_turns=4)).final_output
        steps.agent = "writer"
        draft = (await Runner.run(agent("writer", WRITER), _writer_task(question, notes))).final_output
        steps.agent = "reviewer"
        await Runner.run(agent("reviewer", REVIEWER), _reviewer_task(question, notes, draft))

    asyncio.run(flow())


def run_langgraph(url: str, model_id: str, docs: list[str], question: str, steps: Steps) -> None:
    from typing import TypedDict

    from langchain_core.messages import ToolMessage
    from langchain_core.tools import tool
    from langchain_openai import ChatOpenAI
    from langgraph.graph import END, START, StateGraph
    from langgraph.prebuilt import create_react_agent

    salt = uuid.uuid4().hex

    @tool
    def search_corpus(query: Query) -> str:
        """Search the astronomy notes."""
        return search(docs, query)

    def llm(name: str) -> ChatOpenAI:
        return ChatOpenAI(model=model_id, base_url=f"{url}/v1", api_key="none", temperature=0,
                          max_tokens=MAX_TOKENS[name], extra_body={"cache_salt": salt},
                          http_client=steps.sync_client())

    researcher_llm = llm("researcher")

    def pick_model(state, runtime):
        answered = any(isinstance(m, ToolMessage) for m in state["messages"])
        return researcher_llm.bind_tools([search_corpus], tool_choice="none" if answered else "required",
                                         parallel_tool_calls=False)

    researcher = create_react_agent(pick_model, [search_corpus], prompt=RESEARCHER)

    class State(TypedDict, total=False):
        question: str
        notes: str
        draft: str
        review: str

    def research(state: State) -> State:
        steps.agent = "researcher"
        out = researcher.invoke({"messages": [("user", state["question"])]}, {"recursion_limit": 8})
        return {"notes": out["messages"][-1].content}

    def write(state: State) -> State:
        steps.agent = "writer"
        return {"draft": llm("writer").invoke([("system", WRITER),
                                                ("user", _writer_task(state["question"], state["notes"]))]).content}

    def review(state: State) -> State:
        steps.agent = "reviewer"
        task = _reviewer_task(state["question"], state["notes"], state["draft"])
        return {"review": llm("reviewer").invoke([("system", REVIEWER), ("user", task)]).content}

    graph = StateGraph(State)
    for name, node in (("research", research), ("write", write), ("review", review)):
        graph.add_node(name, node)
    graph.add_edge(START, "research")
    graph.add_edge("research", "write")
    graph.add_edge("write", "review")
    graph.add_edge("review", END)
    graph.compile().invoke({"question": question})


def run_autogen(url: str, model_id: str, docs: list[str], question: str, steps: Steps) -> None:
    from autogen_agentchat.agents import AssistantAgent
    from autogen_core.models import ModelFamily
    from autogen_core.tools import BaseTool
    from autogen_ext.models.openai import OpenAIChatCompletionClient

    info = {"vision": False, "function_calling": True, "json_output": True, "family": ModelFamily.UNKNOWN,
            "structured_output": True, "multiple_system_messages": False}

    class SearchArgs(BaseModel):
        query: Query

    class SearchCorpus(BaseTool[SearchArgs, str]):  # a plain function's Annotated hint must be a description
        def __init__(self) -> None:
            super().__init__(SearchArgs, str, "search_corpus", "Search the astronomy notes.")

        async def run(self, args: SearchArgs, cancellation_token) -> str:
            return search(docs, args.query)

    search_corpus = SearchCorpus()

    salt = uuid.uuid4().hex

    async def flow() -> None:
        def client(name: str, **extra_body) -> OpenAIChatCompletionClient:
            return OpenAIChatCompletionClient(model=model_id, base_url=f"{url}/v1", api_key="none", model_info=info,
                                              temperature=0, max_tokens=MAX_TOKENS[name], parallel_tool_calls=False,
                                              http_client=steps.async_client(),
                                              extra_body={"cache_salt": salt, **extra_body})

        steps.agent = "researcher"
        researcher = AssistantAgent("researcher", model_client=client("researcher", tool_choice="required"),
                                    tools=[search_corpus], max_tool_iterations=2, reflect_on_tool_use=False,
                                    system_message=RESEARCHER)
        notes = (await researcher.run(task=question)).messages[-1].content
        steps.agent = "writer"
        writer = AssistantAgent("writer", model_client=client("writer"), system_message=WRITER)
        draft = (await writer.run(task=_writer_task(question, notes))).messages[-1].content
        steps.agent = "reviewer"
        reviewer = AssistantAgent("reviewer", model_client=client("reviewer"), system_message=REVIEWER)
        await reviewer.run(task=_reviewer_task(question, notes, draft))

    asyncio.run(flow())


def run_smolagents(url: str, model_id: str, docs: list[str], question: str, steps: Steps) -> None:
    from smolagents import OpenAIServerModel, ToolCallingAgent, tool

    salt = uuid.uuid4().hex

    @tool
    def search_corpus(query: str) -> str:
        """Search the astronomy notes.

        Args:
            query: what to look for
        """
        return search(docs, query[:80])

    def model(name: str) -> OpenAIServerModel:
        # parallel_tool_calls=False passes through to the request: a small model otherwise repeats one call
        return OpenAIServerModel(model_id=model_id, api_base=f"{url}/v1", api_key="none", temperature=0,
                                 max_tokens=MAX_TOKENS[name], parallel_tool_calls=False,
                                 client_kwargs={"http_client": steps.sync_client(), "max_retries": 0},
                                 extra_body={"cache_salt": salt})

    # ToolCallingAgent sends tool_choice "required" on every step (its tools plus final_answer); two action steps,
    # then, without a final_answer call, smolagents' own summary step (no tools) gives the notes
    steps.agent = "researcher"
    researcher = ToolCallingAgent(tools=[search_corpus], model=model("researcher"), max_steps=2, verbosity_level=0)
    notes = str(researcher.run(question))
    steps.agent = "writer"
    draft = model("writer").generate([{"role": "system", "content": [{"type": "text", "text": WRITER}]},
                                      {"role": "user", "content": [{"type": "text",
                                                                    "text": _writer_task(question, notes)}]}]).content
    steps.agent = "reviewer"
    model("reviewer").generate([{"role": "system", "content": [{"type": "text", "text": REVIEWER}]},
                                {"role": "user", "content": [{"type": "text",
                                                              "text": _reviewer_task(question, notes, draft or "")}]}])


RUNNERS = {"agents": run_agents, "langgraph": run_langgraph, "autogen": run_autogen, "smolagents": run_smolagents}


# ---------------------------------------------------------------------- the run and its summary
def summarize(flows: list[dict]) -> list[dict]:
    """Per framework and method: the median over runs of each step's cached share and TTFT, and of the flow."""
    out = []
    for key in sorted({(f["framework"], f["method"]) for f in flows}):
        mine = [f for f in flows if (f["framework"], f["method"]) == key]
        num_steps = min(len(f["steps"]) for f in mine)
        out.append({"framework": key[0], "method": key[1], "num_runs": len(mine), "num_steps": num_steps,
                    "cached_share_by_step": [statistics.median(f["steps"][i]["cached_share"] for f in mine)
                                             for i in range(num_steps)],
                    "ttft_ms_by_step": [statistics.median(f["steps"][i]["ttft_ms"] for f in mine)
                                        for i in range(num_steps)],
                    "tool_calls_by_step": [[f["steps"][i]["num_tool_calls"] for f in mine] for i in range(num_steps)],
                    "e2e_s_median": statistics.median(f["e2e_s"] for f in mine)})
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--methods", default="full,epic", help="comma-separated; one server each")
    ap.add_argument("--frameworks", default=",".join(FRAMEWORKS))
    ap.add_argument("--runs", type=int, default=2, help="flows per framework and method, each on another question")
    ap.add_argument("--data", type=Path, default=DEFAULT_DATA, help="MMLU-format CSV: the search corpus")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    docs = load_corpus(args.data)
    questions = [d.split(" Answer: ")[0] for d in docs[: args.runs]]
    flows = []
    log_dir = Path(os.environ.get("TMPDIR", "/tmp"))
    for method in args.methods.split(","):
        server = ServerProcess(args.model, method, log_dir)
        try:
            for framework in args.frameworks.split(","):
                for run, question in enumerate(questions):
                    steps = Steps()
                    start = time.perf_counter()
                    RUNNERS[framework](server.url, args.model, docs, question, steps)
                    e2e_s = time.perf_counter() - start
                    flows.append({"framework": framework, "method": method, "run": run, "question": question,
                                  "e2e_s": e2e_s, "steps": steps.rows})
                    shares = " ".join(f"{s['cached_share']:.2f}" for s in steps.rows)
                    print(f"{framework:9s} {method:6s} run {run}: {len(steps.rows)} steps, cached {shares}, "
                          f"{e2e_s:.1f} s", flush=True)
        finally:
            server.stop()
    result = {"command": " ".join([Path(sys.argv[0]).name, *sys.argv[1:]]), "model": args.model,
              "machine": f"{platform.node()} {platform.machine()}, {os.cpu_count()} CPUs", "data": str(args.data),
              "summary": summarize(flows), "flows": flows}
    for row in result["summary"]:
        print(json.dumps({k: v for k, v in row.items() if k != "tool_calls_by_step"}))
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
