"""Live TTFT under concurrent load with the quality guard's shadow references running, against the guard off.

Issue 57's target "TTFT of live requests unchanged within noise": ``kvrelay serve`` with its defaults (the guard
on) and with ``--quality-target off --method relay`` (the guard's start rung, so both arms serve the same method and
differ by the shadows and the guard's rung moves) are driven by the same workload: ``--clients`` concurrent
clients (the official ``openai`` client, streaming, temperature 0), each running its own fixed list of gsm8k-chain3
chains (solver -> critic -> finalizer, each agent quoting the earlier answers as text, so downstream agents reuse
upstream KV), all in one namespace (one tenant: the guard keys roles by namespace, so a namespace per chain would
make every call its role's first). The arms alternate on a fresh server each phase (on, off, on, off, ...) with the
same request list, so the spread between two phases of the same arm is the noise of the (shared, noisy) machine,
and the on/off ratio of TTFT medians is read against it.

``--salt chain`` sends each chain under a fresh ``cache_salt`` instead, as clients that keep one namespace per
conversation do: every call is then its role's first, the calls the guard would shadow one by one, and the server's
shadow share (``--quality-shadow-share``, kvrelay.server.shadow_pacer) is what holds their cost. ``--workload
mmlu-doc3`` runs analyst -> answerer -> checker over a shared document instead, ``--pause-s`` waits before each chain
(a user's pause between conversations, idle time the shadows may use), and each call's decode rate (tokens after
the first over the time after the first) shows what shadow pieces between decode steps cost the streams.

Per request: client TTFT (sent -> first content chunk), the server's engine TTFT and queue wait, method, rung,
role and cached tokens (from the stream's ``kvrelay`` object and usage). Per phase, from ``/metrics`` and
``/proc`` before and after (after the shadows queued by the phase have drained): shadow references run and their
compute seconds (engine wall time) against the phase's wall time and the live requests' engine TTFT seconds, and the
server process's CPU seconds, whose on/off ratio over the same requests is the guard's whole cost (wall and CPU
seconds differ on a machine other jobs share, so a shadow's seconds are set against wall time only). A role's
first ``first_calls_per_role`` calls are all shadowed, later ones one in 20: TTFT is also split into each role's
first calls (by send order) and the calls after. No chain starts past ``--phase-deadline-s`` into a phase, and
the phases are compared on the calls all of them ran.

    OMP_NUM_THREADS=1 python benchmarks/quality_shadow_load.py --model smollm2-135m --clients 4 --chains 8 \
        --max-tokens 24,16,12 --phase-deadline-s 180 --repeats 2 --json benchmarks/results/quality-shadow-load-cpu.json
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import subprocess
import sys
import threading
import time
import urllib.request
import uuid
from pathlib import Path

from agent_tools import REPO, ServerProcess
from openai import OpenAI
from shadow_load_stats import (
    common_calls,
    compare_arms,
    decode_rate,
    metric_values,
    metrics_delta,
    phase_plan,
    ttft_summary,
    with_call_index,
)

from kvrelay.eval.result_files import read_json, write_json_gz
from kvrelay.pipeline.workloads import get_workload
from kvrelay.quality import QualityConfig

ARM_FLAGS = {"on": [], "off": ["--quality-target", "off", "--method", "relay"]}
SHADOW_METRICS = ("kvrelay_quality_shadow_runs_total", "kvrelay_quality_shadow_compute_seconds_total",
                  "kvrelay_quality_shadow_failed_total", "kvrelay_engine_ttft_seconds_sum",
                  "kvrelay_engine_ttft_seconds_count", "kvrelay_generated_tokens_total",
                  "kvrelay_live_engine_seconds_total", "kvrelay_quality_shadow_unaffordable_total")


# ------------------------------------------------------------------------------------------------ the run
def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of process ``pid`` so far (its threads included)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime, stime: fields 14, 15 of stat


def scrape(url: str) -> dict[str, float]:
    return metric_values(urllib.request.urlopen(url + "/metrics", timeout=60).read().decode())


def wait_for_shadows(url: str, timeout_s: float = 600) -> float:
    """Seconds until no shadow reference is pending (a server with the guard off has none)."""
    t0 = time.perf_counter()
    while time.perf_counter() - t0 < timeout_s and scrape(url).get("kvrelay_quality_shadows_pending", 0) > 0:
        time.sleep(0.5)
    return time.perf_counter() - t0


class ChainClient(threading.Thread):
    """Runs its chains one after another, each agent a streamed chat request; one row per request."""

    def __init__(self, url: str, model: str, index: int, chains: list[dict], max_tokens: dict[str, int],
                 salt: str | None, t0: float, deadline: float, workload: str = "gsm8k-chain3",
                 pause_s: float = 0.0, on_chain=None) -> None:
        """``chains``: each chain's inputs (a problem's); ``salt`` None: a fresh ``cache_salt`` per chain."""
        super().__init__(daemon=True)
        self.client = OpenAI(base_url=url + "/v1", api_key="none", timeout=600, max_retries=0)
        self.model, self.index, self.chains, self.max_tokens, self.salt, self.t0 = (model, index, chains,
                                                                                    max_tokens, salt, t0)
        self.spec, self.pause_s, self.on_chain = get_workload(workload).spec, pause_s, on_chain
        self.deadline = deadline  # no chain starts after it (the chains not run are left out of every phase)
        self.rows: list[dict] = []
        self.errors: list[str] = []

    def ask(self, agent: str, system: str, user: str, salt: str) -> tuple[str, dict]:
        sent = time.perf_counter()
        first, text, ext, usage = None, "", {}, None
        stream = self.client.chat.completions.create(
            model=self.model, messages=[{"role": "system", "content": system}, {"role": "user", "content": user}],
            max_tokens=self.max_tokens[agent], temperature=0, stream=True, stream_options={"include_usage": True},
            extra_body={"cache_salt": salt})
        for chunk in stream:
            if chunk.choices and chunk.choices[0].delta.content:
                first = first or time.perf_counter()
                text += chunk.choices[0].delta.content
            ext = (chunk.model_extra or {}).get("kvrelay") or ext
            usage = chunk.usage or usage
        end = time.perf_counter()
        quality = ext.get("quality") or {}
        return text, {"client": self.index, "agent": agent, "role": quality.get("role", agent),
                      "rung": quality.get("rung"), "method": ext.get("method"), "sent_s": sent - self.t0,
                      "ttft_ms": ((first or end) - sent) * 1e3, "total_ms": (end - sent) * 1e3,
                      "engine_ttft_ms": ext.get("ttft_ms"), "queue_ms": ext.get("queue_ms"),
                      "reuse_rate": ext.get("reuse_rate"), "prompt_tokens": usage.prompt_tokens if usage else None,
                      "cached_tokens": usage.prompt_tokens_details.cached_tokens if usage else None,
                      "completion_tokens": usage.completion_tokens if usage else None,
                      "decode_tokens_per_s": decode_rate(usage.completion_tokens if usage else None,
                                                         first, end)}

    def run(self) -> None:
        for chain, inputs in enumerate(self.chains):
            time.sleep(self.pause_s)
            if time.perf_counter() > self.deadline:
                return
            if self.on_chain is not None:
                self.on_chain(chain)
            values, salt = dict(inputs), self.salt or uuid.uuid4().hex
            for step, name in enumerate(self.spec.order):
                agent = self.spec.agent(name)
                try:
                    values[name], row = self.ask(name, agent.system, agent.user.format(**values), salt)
                except Exception as exc:  # counted; the rest of this chain is skipped
                    self.errors.append(repr(exc))
                    break
                self.rows.append({**row, "chain": chain, "step": step})


def warm_up(url: str, model: str) -> None:
    """Two requests in a namespace and role of their own (lazy imports, first allocations), their shadows drained."""
    client = OpenAI(base_url=url + "/v1", api_key="none", timeout=600, max_retries=0)
    for _ in range(2):
        client.chat.completions.create(model=model, messages=[{"role": "user", "content": "What is 2+3?"}],
                                       max_tokens=8, temperature=0,
                                       extra_body={"cache_salt": uuid.uuid4().hex},
                                       extra_headers={"x-kvrelay-agent": "warm-up"})
    wait_for_shadows(url)


def run_phase(args: argparse.Namespace, arm: str, repeat: int, work: list[list[str]],
              max_tokens: dict[str, int], log_dir: Path) -> tuple[dict, list[dict]]:
    """One phase on a fresh server: its row (timings, /metrics and CPU deltas, the guard's view) and its calls."""
    server = ServerProcess(args.model, f"shadow-load-{arm}{repeat}", log_dir, flags=ARM_FLAGS[arm])
    try:
        warm_up(server.url, args.model)
        salt = uuid.uuid4().hex if args.salt == "tenant" else None
        load_start = os.getloadavg()
        before, cpu_before = scrape(server.url), cpu_seconds(server.proc.pid)
        t0 = time.perf_counter()
        split: dict[str, float] = {}

        def at_chain(chain: int) -> None:  # client 0 at the start of chain --split-after-chains: a mid-run scrape
            if chain == args.split_after_chains and not split:
                split.update(scrape(server.url))

        clients = [ChainClient(server.url, args.model, k, chains, max_tokens, salt, t0, t0 + args.phase_deadline_s,
                               args.workload, args.pause_s, at_chain if k == 0 else None)
                   for k, chains in enumerate(work)]
        for c in clients:
            c.start()
        for c in clients:
            c.join()
        live_s = time.perf_counter() - t0
        cpu_live = cpu_seconds(server.proc.pid) - cpu_before
        drain_s = wait_for_shadows(server.url)
        after, cpu_all = scrape(server.url), cpu_seconds(server.proc.pid) - cpu_before
        view = {} if salt is None else json.loads(urllib.request.urlopen(
            f"{server.url}/v1/kvrelay/quality?cache_salt={salt}", timeout=60).read())
    finally:
        server.stop()
    calls = with_call_index([{**r, "arm": arm, "repeat": repeat} for c in clients for r in c.rows],
                            "agent" if salt is not None else ("client", "chain", "agent"))
    delta = metrics_delta(before, after, SHADOW_METRICS)
    shadow_s = delta.get("kvrelay_quality_shadow_compute_seconds_total", 0.0)
    late = metrics_delta(split, after, SHADOW_METRICS) if split else {}  # from the split on
    num_first = QualityConfig().first_calls_per_role
    row = {"arm": arm, "repeat": repeat, "flags": ARM_FLAGS[arm], "num_calls_run": len(calls),
           "num_calls_run_in_first_calls": sum(c["call_index"] < num_first for c in calls),
           "num_errors": sum(len(c.errors) for c in clients), "errors": [e for c in clients for e in c.errors][:5],
           "live_wall_s": live_s, "shadow_drain_s": drain_s, "server_cpu_s_live": cpu_live, "server_cpu_s": cpu_all,
           "metrics_delta": delta, "shadow_compute_s": shadow_s,
           "shadow_share_of_live_engine_s": shadow_s / delta["kvrelay_live_engine_seconds_total"]
           if delta.get("kvrelay_live_engine_seconds_total") else None,
           "num_shadows": delta.get("kvrelay_quality_shadow_runs_total", 0.0),
           "shadow_share_of_phase_wall": shadow_s / (live_s + drain_s),
           "shadow_s_per_live_engine_ttft_s": shadow_s / delta["kvrelay_engine_ttft_seconds_sum"]
           if delta.get("kvrelay_engine_ttft_seconds_sum") else None,
           "load_average_start_end": [load_start, os.getloadavg()], "guard_roles": view.get("roles"),
           "metrics_delta_after_split": late,
           "shadow_share_of_live_engine_s_after_split": late.get("kvrelay_quality_shadow_compute_seconds_total", 0.0)
           / late["kvrelay_live_engine_seconds_total"] if late.get("kvrelay_live_engine_seconds_total") else None}
    quick = ttft_summary(calls, num_first)
    print(json.dumps({**{k: v for k, v in row.items() if not isinstance(v, dict)},
                      **{k: v for k, v in quick.items() if not isinstance(v, dict)}}), flush=True)
    return row, calls


def _commit() -> str | None:
    out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=REPO)
    return out.stdout.strip() or None


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--clients", type=int, default=4, help="concurrent clients, each running its own chains")
    p.add_argument("--chains", type=int, default=6, help="gsm8k-chain3 chains per client, one after another")
    p.add_argument("--repeats", type=int, default=2, help="phases per arm (the arms alternate: on, off, on, off)")
    p.add_argument("--workload", default="gsm8k-chain3", choices=("gsm8k-chain3", "mmlu-doc3"))
    p.add_argument("--max-tokens", default=None, help="the agents' completion tokens, in order (default: the "
                                                       "workload's own, e.g. gsm8k-chain3's solver,critic,finalizer)")
    p.add_argument("--salt", default="tenant", choices=("tenant", "chain"),
                   help="one cache_salt for the phase (tenant) or a fresh one per chain (a namespace per "
                        "conversation: every call its role's first)")
    p.add_argument("--pause-s", type=float, default=0.0, help="each client waits this long before each chain")
    p.add_argument("--split-after-chains", type=int, default=0,
                   help="also report the shadows' share from the start of the first client's chain K on (0: none): "
                        "after a paced tenant has been judged")
    p.add_argument("--phase-deadline-s", type=float, default=600,
                   help="no chain starts later in a phase; the phases are compared on the calls all of them ran")
    p.add_argument("--offset", type=int, default=0, help="index of the first GSM8K test problem")
    p.add_argument("--data", default=None)
    p.add_argument("--json", type=Path, default=None, help="the report (per-call rows beside it, .calls.json.gz)")
    p.add_argument("--rescore", action="store_true", help="recompute --json's report from it and its .calls.json.gz")
    args = p.parse_args(argv)
    if args.rescore:
        result = rescore(args.json)
        args.json.write_text(json.dumps(result, indent=1))
        print(json.dumps(result.get("compare")), flush=True)
        return
    os.environ.setdefault("OMP_NUM_THREADS", "1")  # the servers' (they inherit this environment): one thread each
    workload = get_workload(args.workload)
    spec = workload.spec
    max_tokens = ({a: spec.agent(a).max_new_tokens for a in spec.order} if args.max_tokens is None else
                  dict(zip(spec.order, (int(t) for t in args.max_tokens.split(",")), strict=True)))
    problems = workload.problems(args.data, args.offset + args.clients * args.chains)[args.offset:]
    inputs = [dict(pr.inputs) for pr in problems]
    work = [inputs[k * args.chains:(k + 1) * args.chains] for k in range(args.clients)]
    log_dir = Path(os.environ.get("TMPDIR", "/tmp"))
    head = {"command": " ".join(sys.argv), "model": args.model, "workload": args.workload, "salt": args.salt,
            "pause_s": args.pause_s, "clients": args.clients,
            "chains_per_client": args.chains, "max_tokens": max_tokens, "offset": args.offset,
            "first_calls_per_role": QualityConfig().first_calls_per_role, "sample_rate": QualityConfig().sample_rate,
            "env": {"machine": f"{platform.node()} {platform.machine()}", "cpus": os.cpu_count(),
                    "omp_num_threads": os.environ.get("OMP_NUM_THREADS"), "commit": _commit(),
                    "uptime_start": _uptime()}}
    phases, phase_calls, result = [], [], {}
    for arm, repeat in phase_plan(tuple(ARM_FLAGS), args.repeats):
        row, calls = run_phase(args, arm, repeat, work, max_tokens, log_dir)
        phases.append(row)
        phase_calls.append(calls)
        result = report(head, phases, phase_calls)  # after every phase: a run cut short keeps its phases
        if args.json:
            args.json.parent.mkdir(parents=True, exist_ok=True)
            args.json.write_text(json.dumps(result, indent=1))
            write_json_gz(args.json.with_suffix(".calls.json.gz"), {"calls": [c for cs in phase_calls for c in cs]})
    print(json.dumps(result.get("compare")), flush=True)


def _uptime() -> str:
    return subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()


def report(head: dict, phases: list[dict], phase_calls: list[list[dict]]) -> dict:
    """The phases so far, their TTFT over the calls every phase ran, and the arms compared once both ran."""
    # a phase's CPU and wall seconds cover every call it ran (more than the compared ones when others were cut short
    # by their deadline): per call run
    rows = [{**row, **ttft_summary(calls, head["first_calls_per_role"]),
             "server_cpu_s_per_call_run": row["server_cpu_s"] / max(1, row["num_calls_run"]),
             "live_wall_s_per_call_run": row["live_wall_s"] / max(1, row["num_calls_run"])}
            for row, calls in zip(phases, common_calls(phase_calls), strict=True)]
    result = {**head, "env": {**head["env"], "uptime_end": head["env"].get("uptime_end") or _uptime()},
              "phases": rows}
    if {"on", "off"} <= {row["arm"] for row in rows}:
        keys = ("ttft_ms_p50", "ttft_ms_p90", "ttft_ms_first_calls_p50", "ttft_ms_after_first_calls_p50",
                "downstream_ttft_ms_p50", "decode_tokens_per_s_p50", "total_ms_p50", "server_cpu_s_per_call_run",
                "live_wall_s_per_call_run")
        result["compare"] = {k: compare_arms(rows, k) for k in keys
                             if all(math.isfinite(row[k]) for row in rows)}  # none: no call after the first calls
    return result


def rescore(path: Path) -> dict:
    """The report of an earlier run recomputed from its JSON and its ``.calls.json.gz`` (no servers)."""
    old = json.loads(path.read_text())
    calls = read_json(path.with_suffix(".calls.json"))["calls"]
    head = {k: v for k, v in old.items() if k not in ("phases", "compare")}
    phases = old["phases"]
    phase_calls = [[c for c in calls if (c["arm"], c["repeat"]) == (p["arm"], p["repeat"])] for p in phases]
    return report(head, phases, phase_calls)

if __name__ == "__main__":
    main()
