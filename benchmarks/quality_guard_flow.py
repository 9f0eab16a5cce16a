"""The quality guard under a real agent framework: a LangGraph flow over a shared document, scored against ``full``.

    OMP_NUM_THREADS=1 python benchmarks/quality_guard_flow.py --model smollm2-135m --runs 36 \
        --json benchmarks/results/quality-guard-flow-smollm2.json \
        --plots benchmarks/results/quality-guard-plots/flow-smollm2

A LangGraph graph (langchain-openai's ``ChatOpenAI``) of three agents runs once per document against ``kvrelay serve``
with its defaults (the guard on, the default target and ladder): an analyst writes notes on the document for a
question, an answerer picks the option from the document and the notes, a checker checks the answer against the
document. Every agent reads the whole document, so the answerer and the checker reuse it (and the analyst's notes)
at an offset after their own system prompt: the approximate rungs' traffic. A document is six MMLU facts (question and
correct answer) of one subject, rows 20-25 (no default was chosen on them), one subject per run; the question is one
of them, with its options. All runs share one ``cache_salt`` namespace, as one tenant's deployment of the flow:
the guard keys its roles by namespace, so a fresh namespace per run would make every call a role's first.

Every request the framework sends is recorded (an httpx request hook on its client) and, before it goes out, sent
again once per ladder rung as a probe naming that rung's method (one token, ``cache_output: false``, so the store
the live call meets is unchanged; under its own ``x-kvrelay-agent`` so the probes never count as the live role's
calls). The live reply carries the rung the guard picked (``kvrelay.quality``), its reuse (``reuse_rate``,
token-layers) and, asked through the framework's ``extra_body``, its prompt ids and whole first-token distribution
(``kvrelay.first_token_logprobs``, so the KL is exact over the vocabulary: no top-k tail). After each run every
recorded body is re-sent to a second server, ``--quality-target off --method full``, same model: the reference
(where that server tokenizes the body otherwise, since the guarded one splices a completion it returned as the ids it
generated, ``full`` runs again on the guarded call's own prompt ids, a token-id completions prompt).
Per call: first-token KL(full || live) and top-1 agreement, whether both servers tokenized the same prompt ids,
each rung's KL, agreement and reuse on the same store, and whether the guard shadowed the call (its per-role
sample count, read from ``GET /v1/kvrelay/quality`` once the run's shadows are done).

Per role (agent): rung calls, KL and agreement over the calls after the first 20, reuse against the best single
rung that meets the target on that role in hindsight (each rung probed on the store as the guarded run left it),
and a PNG of rung and live KL over calls. ``--calls-json`` scores the rows an earlier run kept (no servers).
"""

from __future__ import annotations

import argparse
import dataclasses
import gzip
import json
import os
import platform
import subprocess
import sys
import time
import uuid
from collections import defaultdict
from pathlib import Path
from typing import TypedDict

import httpx
import quality_guard
from agent_tools import ServerProcess
from quality_guard import QUALITY_AFTER_CALLS, meets, plot_role, quality, reuse

from kvrelay.eval.fidelity import first_token_agrees, kl_first_token
from kvrelay.eval.result_files import read_json, write_json_gz
from kvrelay.pipeline.workloads import DOC_ROWS, mmlu_doc3
from kvrelay.quality import QualityConfig
from kvrelay.server.textstream import decode_logprobs

REPO = Path(__file__).resolve().parents[1]
DEFAULT_DATA = REPO.parent / "shared" / "data" / "mmlu"
PROBE_AGENT = "bench-probe"  # the probes' own role: the live roles' call counts and samples stay the guard's own
FLOW = mmlu_doc3()  # the agents' prompts and the documents
ASK = {"debug": True, "first_token_logprobs": True}  # what the benchmark reads from every reply


def documents(data: Path, num_runs: int) -> list[dict]:
    """One document per run (``mmlu-doc3``'s problems): its subject, document, question and answer letter."""
    return [{"subject": p.problem_id.removeprefix("mmlu-doc-").rsplit("-", 1)[0], **p.inputs, "answer": p.reference}
            for p in FLOW.problems(str(data), num_runs)]


# ---------------------------------------------------------------------- recording and probing
def probe_body(body: dict, **kvrelay) -> dict:
    """``body`` as a one-token probe that is not stored, with ``kvrelay`` options (the method to run, say)."""
    out = {k: v for k, v in body.items() if k not in ("max_completion_tokens", "stream", "stream_options")}
    return {**out, "max_tokens": 1, "kvrelay": {**ASK, **kvrelay, "cache_output": False}}


def first_token(reply: dict) -> dict:
    """What a (non-streamed) reply says about its first token and its reuse."""
    ext = reply["kvrelay"]
    return {"logprobs": decode_logprobs(ext["first_token_logprobs"]), "prompt_ids": ext["debug"]["prompt_ids"],
            "prompt_tokens": reply["usage"]["prompt_tokens"], "reuse_rate": ext["reuse_rate"],
            "method": ext["method"], "ttft_ms": ext["ttft_ms"], "quality": ext.get("quality")}


class Recorder:
    """The framework's requests: each is probed once per rung before it is sent, its reply kept."""

    def __init__(self, url: str, rung_specs: dict[str, str]) -> None:
        self.rung_specs = rung_specs
        self.probes = httpx.Client(base_url=url, timeout=600, headers={"x-kvrelay-agent": PROBE_AGENT})
        self.client = httpx.Client(event_hooks={"request": [self.on_request], "response": [self.on_response]},
                                   timeout=600)
        self.agent = ""
        self.calls: list[dict] = []

    def on_request(self, request: httpx.Request) -> None:
        if not request.url.path.endswith("/chat/completions"):
            return
        body = json.loads(request.content)
        rungs = {}
        for name, spec in self.rung_specs.items():
            r = self.probes.post("/v1/chat/completions", json=probe_body(body, method=spec))
            r.raise_for_status()
            rungs[name] = first_token(r.json())
        self.calls.append({"agent": self.agent, "body": body, "rungs": rungs})

    def on_response(self, response: httpx.Response) -> None:
        if not response.request.url.path.endswith("/chat/completions"):
            return
        response.read()
        response.raise_for_status()
        self.calls[-1]["live"] = first_token(response.json())

    def close(self) -> None:
        self.probes.close()
        self.client.close()


def build_flow(url: str, model_id: str, salt: str, recorder: Recorder):
    """The compiled LangGraph graph: analyst -> answerer -> checker, each one chat call."""
    from langchain_openai import ChatOpenAI
    from langgraph.graph import END, START, StateGraph

    class State(TypedDict, total=False):
        document: str
        question: str
        notes: str
        answer: str
        verdict: str

    def llm(name: str) -> ChatOpenAI:
        return ChatOpenAI(model=model_id, base_url=f"{url}/v1", api_key="none", temperature=0,
                          max_tokens=FLOW.spec.agent(name).max_new_tokens,
                          extra_body={"cache_salt": salt, "kvrelay": ASK}, http_client=recorder.client, max_retries=0)

    llms = {name: llm(name) for name in FLOW.spec.order}

    def ask(name: str, **values: str) -> str:
        recorder.agent = name
        agent = FLOW.spec.agent(name)
        return llms[name].invoke([("system", agent.system), ("user", agent.user.format(**values))]).content

    def analyse(s: State) -> State:
        return {"notes": ask("analyst", document=s["document"], question=s["question"])}

    def answer(s: State) -> State:
        return {"answer": ask("answerer", document=s["document"], analyst=s["notes"], question=s["question"])}

    def check(s: State) -> State:
        return {"verdict": ask("checker", document=s["document"], question=s["question"], answerer=s["answer"])}

    graph = StateGraph(State)
    for name, node in (("analyse", analyse), ("answer", answer), ("check", check)):
        graph.add_node(name, node)
    graph.add_edge(START, "analyse")
    graph.add_edge("analyse", "answer")
    graph.add_edge("answer", "check")
    graph.add_edge("check", END)
    return graph.compile()


# ---------------------------------------------------------------------- scoring
def compare(full: dict, got: dict) -> dict:
    """One call (live or a rung's probe) against the ``full`` reference on the same body."""
    return {"kl": kl_first_token(full["logprobs"], got["logprobs"]),
            "agree": first_token_agrees(full["logprobs"], got["logprobs"]),
            "same_prompt_ids": full["prompt_ids"] == got["prompt_ids"],
            "prompt_tokens": got["prompt_tokens"], "reuse_rate": got["reuse_rate"], "ttft_ms": got["ttft_ms"]}


def call_row(run: int, call: dict, full: dict) -> dict:
    """A recorded call's row: the live call and every rung against ``full``."""
    live = call["live"]
    return {"run": run, "agent": call["agent"], "role": live["quality"]["role"], "rung": live["quality"]["rung"],
            "method": live["method"], **compare(full, live),
            # the recorded body as the reference server tokenized it: the same ids, or (False) ``reference``'s case
            "chat_same_prompt_ids": full["chat_same_prompt_ids"],
            "chat_prompt_tokens": full.get("chat_prompt_tokens", full["prompt_tokens"]),
            # the live call and its own rung's probe ran the same method on the same store: they should agree
            "live_vs_probe_kl": kl_first_token(call["rungs"][live["quality"]["rung"]]["logprobs"], live["logprobs"]),
            "rungs": {name: compare(full, got) for name, got in call["rungs"].items()}}


def _token_layers(row: dict) -> dict:
    """A row as ``quality_guard``'s ``quality``/``reuse`` read it (token-layers up to the model's layer count)."""
    return {"kl": row["kl"], "agree": row["agree"], "reused_token_layers": row["reuse_rate"] * row["prompt_tokens"],
            "prompt_token_layers": row["prompt_tokens"]}


def role_report(rows: list[dict], config: QualityConfig) -> dict:
    """One role's calls in order: the guard's live quality and reuse, and every rung's, against the target."""
    names = [r.name for r in config.ladder]
    live = [_token_layers(r) for r in rows]
    after = live[QUALITY_AFTER_CALLS:]
    static = {}
    for name in names:
        calls = [_token_layers(r["rungs"][name]) for r in rows]
        static[name] = {**quality(calls), "quality_after_20": quality(calls[QUALITY_AFTER_CALLS:]),
                        "reuse": reuse(calls), "reuse_after_20": reuse(calls[QUALITY_AFTER_CALLS:])}
        static[name]["meets_target"] = meets(static[name], config)
    meeting = [n for n in names if static[n]["meets_target"]]
    best = max(meeting, key=lambda n: static[n]["reuse"]) if meeting else None
    guard_reuse = reuse(live)
    return {"num_calls": len(rows), "num_shadowed": sum(bool(r.get("shadowed")) for r in rows),
            "num_chat_prompt_id_mismatches": sum(not r["chat_same_prompt_ids"] for r in rows),
            "num_reference_prompt_id_mismatches": sum(not r["same_prompt_ids"] for r in rows)
            + sum(not g["same_prompt_ids"] for r in rows for g in r["rungs"].values()),
            "quality_all": quality(live), "quality_after_20": quality(after),
            "meets_target_after_20": meets(quality(after), config) if after else None,
            "reuse": guard_reuse, "reuse_after_20": reuse(after) if after else None,
            "best_static": best, "best_static_reuse": static[best]["reuse"] if best else None,
            "reuse_vs_best_static": guard_reuse / static[best]["reuse"] if best and static[best]["reuse"] else None,
            "reuse_after_20_vs_best_static": (reuse(after) / static[best]["reuse_after_20"]
                                              if best and after and static[best]["reuse_after_20"] else None),
            "rung_calls": {n: sum(r["rung"] == n for r in rows) for n in names},
            # [call (1-based), from, to]: the rung the guard served moved between two calls of the role
            "rung_changes": [[i + 1, rows[i - 1]["rung"], rows[i]["rung"]] for i in range(1, len(rows))
                             if rows[i - 1]["rung"] != rows[i]["rung"]],
            "max_live_vs_probe_kl": max(r["live_vs_probe_kl"] for r in rows),
            "static": static,
            # per call: [rung, shadowed, live KL, top-1 agrees] (quality_guard.plot_role's form)
            "trace": [[r["rung"], int(bool(r.get("shadowed"))), round(r["kl"], 5), int(r["agree"])] for r in rows]}


def guard_rows(rows: list[dict]) -> list[dict]:
    """One role's rows in ``quality_guard``'s form, every rung from its probe: what an offline replay of the guard
    reads (no decode time and no reference prefill time were kept, so the replay reports no shadow cost)."""
    return [{"workload": "flow", "agent": r["agent"], "decode_ms": None,
             "rungs": {**{name: {**_token_layers(got), "ttft_ms": got["ttft_ms"]} for name, got in r["rungs"].items()},
                       "full": {"ttft_ms": 0.0}}} for r in rows]


# ---------------------------------------------------------------------- the run
def samples_per_role(client: httpx.Client, salt: str, wait_s: float = 60.0) -> dict[str, int]:
    """Each role's shadow comparisons so far, once they stop changing (the run's shadows run in idle turns)."""
    def read() -> dict[str, int]:
        r = client.get("/v1/kvrelay/quality", params={"cache_salt": salt})
        r.raise_for_status()
        return {role: sum(e["num_samples_total"] for e in state["estimates"].values())
                for role, state in r.json().get("roles", {}).items()}

    last, deadline = read(), time.monotonic() + wait_s
    while time.monotonic() < deadline:
        time.sleep(1.0)
        now = read()
        if now == last:
            return now
        last = now
    return last


def reference(full_client: httpx.Client, body: dict, live_ids: list[int]) -> dict:
    """``full`` on the recorded body; when the reference server tokenized it otherwise than the guarded one (which
    splices a completion it returned as the ids it generated), ``full`` again on the guarded call's prompt ids (a
    token-id completions prompt), so the comparison is always on the same prompt ids, as the guard's shadows are."""
    r = full_client.post("/v1/chat/completions", json=probe_body(body))
    r.raise_for_status()
    ref = first_token(r.json())
    ref["chat_same_prompt_ids"] = ref["prompt_ids"] == live_ids
    if not ref["chat_same_prompt_ids"]:
        r = full_client.post("/v1/completions", json={"model": body["model"], "prompt": live_ids, "max_tokens": 1,
                                                      "temperature": 0, "kvrelay": {**ASK, "cache_output": False}})
        r.raise_for_status()
        ref = {**first_token(r.json()), "chat_same_prompt_ids": False, "chat_prompt_tokens": ref["prompt_tokens"]}
    return ref


def measure(args: argparse.Namespace, config: QualityConfig) -> tuple[list[dict], dict]:
    """Run the flows against the guarded server, every call against the ``full`` one: the per-call rows (kept in
    ``.calls.json.gz`` beside ``--json`` after every run, the request bodies in ``.bodies.json.gz``) and the guard's
    view at the end."""
    docs = documents(args.data, args.runs)
    log_dir = Path(os.environ.get("TMPDIR", "/tmp"))
    salt = uuid.uuid4().hex
    guarded = ServerProcess(args.model, "guard", log_dir, flags=[])
    full = ServerProcess(args.model, "full", log_dir)
    rows: list[dict] = []
    bodies: list[dict] = []
    recorder = Recorder(guarded.url, {r.name: r.method_spec for r in config.ladder})
    try:
        flow = build_flow(guarded.url, args.model, salt, recorder)
        full_client = httpx.Client(base_url=full.url, timeout=600)
        before = samples_per_role(recorder.probes, salt)
        for run, doc in enumerate(docs):
            started = time.perf_counter()
            recorder.calls = []
            flow.invoke({"document": doc["document"], "question": doc["question"]})
            new_rows = [call_row(run, call, reference(full_client, call["body"], call["live"]["prompt_ids"]))
                        for call in recorder.calls]
            after = samples_per_role(recorder.probes, salt)  # the run's shadows ran while the references did
            for row, call in zip(new_rows, recorder.calls, strict=True):
                row["subject"] = doc["subject"]
                row["shadowed"] = after.get(row["role"], 0) > before.get(row["role"], 0)
                bodies.append({"run": run, "agent": call["agent"], "body": call["body"]})
            rows += new_rows
            before = after
            print(f"run {run + 1}/{len(docs)} {doc['subject']} {time.perf_counter() - started:.1f}s: "
                  + "  ".join(f"{r['agent']} {r['rung']} KL {r['kl']:.4f} reuse {r['reuse_rate']:.2f}"
                              f"{' S' if r['shadowed'] else ''}" for r in new_rows), flush=True)
            if args.json:  # keep what is measured so far
                args.json.parent.mkdir(parents=True, exist_ok=True)
                write_json_gz(args.json.with_suffix(".calls.json.gz"), {"rows": rows})
                # the request bodies quote the model's answers: compressed, a tenth of their size
                args.json.with_suffix(".bodies.json.gz").write_bytes(gzip.compress(json.dumps(bodies).encode()))
        guard_view = recorder.probes.get("/v1/kvrelay/quality", params={"cache_salt": salt}).json()
        full_client.close()
    finally:
        recorder.close()
        guarded.stop()
        full.stop()
    return rows, guard_view


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--runs", type=int, default=40, help="flows, one document each (calls per role)")
    p.add_argument("--data", type=Path, default=DEFAULT_DATA, help="a folder of MMLU *_test.csv files")
    p.add_argument("--json", type=Path,
                   help="the report (the per-call rows beside it, .calls.json.gz; the request bodies, .bodies.json.gz)")
    p.add_argument("--calls-json", type=Path, help="score the rows of an earlier run's .calls.json.gz (no servers)")
    p.add_argument("--plots", type=Path, help="folder for one PNG per role")
    p.add_argument("--replay", action="store_true",
                   help="with --calls-json: run the guard of this tree offline over each role's probed rungs (the "
                        "rungs it picks may differ from the live run's) and report it as quality_guard.py does")
    args = p.parse_args(argv)
    config = QualityConfig()  # what `kvrelay serve` runs with its defaults
    if args.replay:
        if not args.calls_json:
            p.error("--replay needs --calls-json")
        by_role: dict[str, list[dict]] = defaultdict(list)
        for row in read_json(args.calls_json)["rows"]:
            by_role[row["agent"]].append(row)
        replays = {agent: quality_guard.role_report(guard_rows(got), config) for agent, got in by_role.items()}
        for agent, rep in replays.items():
            after = rep["quality_after_20"]
            print(f"{agent}: calls {rep['num_calls']} shadowed {rep['num_shadowed']} rungs {rep['rung_calls']} | "
                  f"after 20: KL {after['kl_mean']:.4f} agree {after['agreement']:.3f} meets "
                  f"{rep['meets_target_after_20']} | reuse {rep['reuse']:.3f} best static {rep['best_static']} ratio "
                  f"{rep['reuse_vs_best_static']:.3f} (after 20 {rep['reuse_after_20_vs_best_static']:.3f})")
        if args.json:
            args.json.write_text(json.dumps({"sources": str(args.calls_json), "config": str(config.target),
                                             "roles": replays}, separators=(",", ":")))
        return
    if args.calls_json:
        rows, guard_view = read_json(args.calls_json)["rows"], None
    else:
        rows, guard_view = measure(args, config)
    by_agent: dict[str, list[dict]] = defaultdict(list)
    for row in rows:
        by_agent[row["agent"]].append(row)
    reports = {agent: role_report(agent_rows, config) for agent, agent_rows in by_agent.items()}
    for agent, rep in reports.items():
        if guard_view is not None:
            rep["moves"] = guard_view["roles"].get(by_agent[agent][0]["role"], {}).get("moves")
        after = rep["quality_after_20"]
        print(f"{agent}: calls {rep['num_calls']} shadowed {rep['num_shadowed']} rungs {rep['rung_calls']} | after 20:"
              f" KL {after['kl_mean']} agree {after['agreement']} meets {rep['meets_target_after_20']} | reuse "
              f"{rep['reuse']:.3f} best static {rep['best_static']} {rep['best_static_reuse']} ratio "
              f"{rep['reuse_vs_best_static']} | prompt ids: chat body differs {rep['num_chat_prompt_id_mismatches']}, "
              f"reference differs {rep['num_reference_prompt_id_mismatches']}, "
              f"live vs own-rung probe KL <= {rep['max_live_vs_probe_kl']:.2g}")
        if args.plots:
            plot_role(args.plots / f"{agent}.png", f"{args.model} LangGraph shared-document flow / {agent}", rep,
                      config)
    if args.json:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=REPO)
        out = {"command": " ".join([Path(sys.argv[0]).name, *(argv if argv is not None else sys.argv[1:])]),
               "env": {"machine": f"{platform.node()} {platform.machine()}, {os.cpu_count()} CPUs",
                       "cpu_threads": os.environ.get("OMP_NUM_THREADS"), "commit": commit.stdout.strip(),
                       "python": sys.version.split()[0]},
               "model": args.model, "framework": "langgraph (langchain-openai ChatOpenAI)",
               "runs": 1 + max(r["run"] for r in rows), "sources": str(args.calls_json or ""),
               "namespace": "one cache_salt for every run", "workload": FLOW.name,
               "doc_rows": [DOC_ROWS.start, DOC_ROWS.stop],
               "config": {"target": str(config.target), "sample_rate": config.sample_rate,
                          "ladder": [dataclasses.asdict(r) for r in config.ladder], "start": config.start},
               "agents": {a.name: {"system": a.system, "max_tokens": a.max_new_tokens} for a in FLOW.spec.agents},
               "roles": reports, "guard_view": guard_view}
        args.json.write_text(json.dumps(out, separators=(",", ":")))


if __name__ == "__main__":
    main()
