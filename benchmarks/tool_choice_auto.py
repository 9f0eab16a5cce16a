"""How often a model calls a tool by itself under ``tool_choice: "auto"`` (what AutoGen's AssistantAgent sends), on
a fixed set of ten one-step tool tasks, through ``kvrelay serve``'s default tool prompt.

    python -m benchmarks.tool_choice_auto --models smollm2-135m,gemma3-270m --json benchmarks/results/tool-auto-cpu.json

Each task has two tools, the one that answers it first; the system message is AutoGen's default. Greedy, 60
tokens, one call at most (``parallel_tool_calls`` false). Counted: replies with a tool call, and with a call of the
task's own tool. Each model gets its own server (``--quality-target off``), started here on a free port.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
from pathlib import Path

# `python benchmarks/tool_choice_auto.py` as well as `python -m benchmarks.tool_choice_auto`: the project root, not
# benchmarks/, must be on the path for the `benchmarks.` import
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import httpx  # noqa: E402

from benchmarks.agent_tools import ServerProcess  # noqa: E402

SYSTEM = ("You are a helpful AI assistant. Solve tasks using your tools. Reply with TERMINATE when the task has been "
          "completed.")  # AutoGen AssistantAgent's default system message


def _tool(name: str, description: str, properties: dict, required: list[str]) -> dict:
    return {"type": "function", "function": {"name": name, "description": description, "parameters": {
        "type": "object", "properties": properties, "required": required}}}


WEATHER = _tool("get_weather", "Current weather of a city.", {"city": {"type": "string"}}, ["city"])
ADD = _tool("add", "Add two numbers.", {"a": {"type": "number"}, "b": {"type": "number"}}, ["a", "b"])
SEARCH = _tool("search", "Search the web for a query.", {"query": {"type": "string"}}, ["query"])
TIME = _tool("get_time", "Current local time in a city.", {"city": {"type": "string"}}, ["city"])
TASKS = [("What is the weather in Paris?", [WEATHER, ADD]), ("What is 1234 plus 5678?", [ADD, WEATHER]),
         ("Search the web for the tallest building in Europe.", [SEARCH, ADD]),
         ("What time is it in Tokyo?", [TIME, WEATHER]), ("Is it raining in London right now?", [WEATHER, SEARCH]),
         ("Add 17.5 and 4.25.", [ADD, TIME]), ("Find recent news about the Mars rover.", [SEARCH, WEATHER]),
         ("What is the local time in New York?", [TIME, ADD]), ("How warm is it in Madrid today?", [WEATHER, TIME]),
         ("Look up who won the 2018 World Cup.", [SEARCH, TIME])]


def run_model(url: str, model: str) -> dict:
    rows = []
    for task, tools in TASKS:
        body = {"model": model, "messages": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": task}],
                "tools": tools, "tool_choice": "auto", "temperature": 0, "max_tokens": 60,
                "parallel_tool_calls": False}
        message = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=600).json()["choices"][0]["message"]
        names = [c["function"]["name"] for c in message.get("tool_calls") or []]
        rows.append({"task": task, "calls": names, "content": (message.get("content") or "")[:120]})
        print(json.dumps(rows[-1]), flush=True)
    wanted = [tools[0]["function"]["name"] for _, tools in TASKS]
    return {"model": model, "num_tasks": len(rows), "num_called": sum(bool(r["calls"]) for r in rows),
            "num_right_tool": sum(r["calls"][:1] == [w] for r, w in zip(rows, wanted, strict=True)), "rows": rows}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default="smollm2-135m,gemma3-270m")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    results = []
    for model in args.models.split(","):
        server = ServerProcess(model, "full", Path(os.environ.get("TMPDIR", "/tmp")))
        try:
            results.append(run_model(server.url, model))
        finally:
            server.stop()
        print(json.dumps({k: v for k, v in results[-1].items() if k != "rows"}), flush=True)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"command": " ".join([Path(sys.argv[0]).name, *sys.argv[1:]]),
                                         "machine": f"{platform.node()} {platform.machine()}, {os.cpu_count()} CPUs",
                                         "results": results}, indent=1))


if __name__ == "__main__":
    main()
