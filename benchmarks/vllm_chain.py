"""gsm8k-chain3 or a shared-document flow as plain chat requests: vLLM with kvrelay's connector, vLLM alone, and
``kvrelay serve``.

    python benchmarks/vllm_chain.py --model-dir SMOLLM2_DIR --limit 5 --json benchmarks/results/vllm-chain-cpu.json \
        [--kvrelay-serve]

starts both vLLM servers through ``kvrelay.vllm.launch`` with the same flags (``--dtype float32 --enforce-eager
--enable-prefix-caching --enable-prompt-tokens-details --max-logprobs 20``), one of them with kvrelay's connector
(``--kv-transfer-config``), and stops them at the end; ``--connector-url`` and ``--plain-url`` use servers
already running instead.

Per problem, a fresh ``cache_salt``; the chain runs on the connector's server (each agent's messages quote the
upstream answers as text, greedy), and each call is sent, with the very same messages, to the plain server right
after (both see the same history, and load that drifts over time falls on both). With ``--kvrelay-serve`` a
second pass follows: the connector's server is stopped (four servers at once do not fit the 2-core development
machine's memory), ``kvrelay serve`` processes start on the same model (the embedded GGUF, ``--kvrelay-model``,
that SMOLLM2_DIR was exported from: the same chat template and prompt ids), one with its default settings (the
quality guard, starting each role at its ``relay`` rung) and one with ``--quality-target off --method full``, each on
``--kvrelay-threads`` threads (default 1: vLLM's CPU worker runs its model on one thread of the two cores here, the
other reserved for its engine), and every recorded call is sent again, in order and under a new salt per problem,
to the plain server (``plain_again``, the reference of this pass) and to each.

Each server first answers one unmeasured request (its lazy set-up). Before each call the script waits
``--pause-s`` (default 1.5 s): a vLLM worker busy-polls for 1 s after its last step, both vLLM servers bind their
model thread to the same core, and a server stores the finished request's K/V in the background, so a call sent at
once would share the core with the previous server's leftovers. Per call: client-side TTFT (streamed), total
time, decode speed (tokens after the first over the time after the first), ``cached_tokens``, prompt tokens (each
side's own count: a mismatch with the reference is reported), kvrelay serve's reuse report, and the first token's
top logprobs; fidelity is each side's first token against its reference's (the plain server in the same pass) on
the same messages: top-1 agreement and KL over the reference's top tokens. A chain's time is the sum of its three
calls on that side, and per generated token that sum over the tokens the side generated (the sides' answers differ in
length).

``--workload mmlu-doc3`` runs three agents over a shared document instead (an analyst's notes, an answer, a check;
every agent reads the whole document, so the downstream two find it at an offset after their own system prompt).
``--connector-method`` and ``--connector-profile`` set the connector's ``method`` and relay ``profile``;
``--kvrelay-method`` runs ``kvrelay serve`` on that method with its quality guard off instead of its defaults,
``--kvrelay-also`` adds a ``kvrelay serve`` side per method named (``kvrelay_<method>``, the guard off: fidelity
against the connector's method), and ``--skip-kvrelay-full`` leaves out the ``full`` side.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import platform
import statistics
import subprocess
import sys
import time
import urllib.error
import urllib.request
import uuid

from openai import OpenAI

from kvrelay.pipeline.spec import PipelineSpec
from kvrelay.pipeline.workloads import get_workload, gsm8k_chain3
from kvrelay.vllm.server_process import VllmServer, VllmServerConfig, free_port

TOP_LOGPROBS = 20
CALL_NUMBERS = ("ttft_ms", "total_ms", "cached_tokens", "prompt_tokens", "completion_tokens", "decode_tokens_per_s",
                "kvrelay")


def reference_of(side: str) -> str | None:
    """The side a side's fidelity and TTFT ratio are measured against: vLLM without the connector at the same
    moments. kvrelay serve's sides (``kvrelay_*``) run in a second pass (the connector's server stopped for memory)
    beside a plain vLLM server again."""
    if side == "connector":
        return "plain"
    return "plain_again" if side.startswith("kvrelay_") else None


def chat(client: OpenAI, model: str, messages: list[dict], max_tokens: int, salt: str) -> dict:
    """One greedy streamed call: its text, client TTFT, cached tokens and first-token top logprobs."""
    t0 = time.perf_counter()
    stream = client.chat.completions.create(
        model=model, messages=messages, max_tokens=max_tokens, temperature=0, stream=True, logprobs=True,
        top_logprobs=TOP_LOGPROBS, stream_options={"include_usage": True}, extra_body={"cache_salt": salt})
    ttft_ms, text, first, usage, kvrelay = None, [], None, None, None
    for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        kvrelay = (chunk.model_extra or {}).get("kvrelay", kvrelay)  # kvrelay serve's reuse report
        if not chunk.choices:
            continue
        choice = chunk.choices[0]
        if ttft_ms is None and (choice.delta.content or choice.logprobs):
            ttft_ms = (time.perf_counter() - t0) * 1e3
        if first is None and choice.logprobs and choice.logprobs.content:
            first = {t.token: t.logprob for t in choice.logprobs.content[0].top_logprobs}
        text.append(choice.delta.content or "")
    total_ms = (time.perf_counter() - t0) * 1e3
    details = getattr(usage, "prompt_tokens_details", None)
    num_decoded = usage.completion_tokens - 1  # tokens after the first
    return {"text": "".join(text), "ttft_ms": ttft_ms, "total_ms": total_ms, "prompt_tokens": usage.prompt_tokens,
            "completion_tokens": usage.completion_tokens,
            "decode_tokens_per_s": (num_decoded / (total_ms - ttft_ms) * 1e3
                                    if num_decoded > 0 and ttft_ms is not None else None),
            "cached_tokens": getattr(details, "cached_tokens", 0) or 0, "first_logprobs": first or {},
            "kvrelay": kvrelay}


def first_token_fidelity(reference: dict[str, float], method: dict[str, float]) -> tuple[bool, float]:
    """(top-1 equal, KL(reference || method) over the reference's top tokens), each side's top-k renormalized;
    a reference token missing from the method's top-k gets the method's smallest logprob there."""
    agree = max(reference, key=reference.get) == max(method, key=method.get)
    floor = min(method.values())
    ref_z = math.log(sum(math.exp(lp) for lp in reference.values()))
    met_z = math.log(sum(math.exp(lp) for lp in method.values()))
    kl = sum(math.exp(lp - ref_z) * ((lp - ref_z) - (method.get(tok, floor) - met_z)) for tok, lp in reference.items())
    return agree, max(kl, 0.0)


def run_chain(driver: str, clients: dict[str, OpenAI], model: dict[str, str], inputs: dict[str, str], salt: str,
              max_tokens: dict[str, int] | None = None, pause_s: float = 0.0, spec: PipelineSpec | None = None
              ) -> list[dict]:
    """One problem (its ``inputs``) through the pipeline ``spec`` (default gsm8k-chain3) on ``clients[driver]``
    (its answers feed the next agent); each call is sent, with the very same messages, to every other side right
    after: a row per agent (its messages kept, for ``replay``), a dict of numbers per side."""
    spec = spec or gsm8k_chain3().spec
    values, rows = dict(inputs), []
    for name in spec.order:
        agent = spec.agent(name)
        messages = [{"role": "system", "content": agent.system},
                    {"role": "user", "content": agent.user.format(**values)}]
        row = {"agent": name, "messages": messages, "max_tokens": (max_tokens or {}).get(name, agent.max_new_tokens)}
        outs = call_sides(row, (driver, *(s for s in clients if s != driver)), clients, model, salt, pause_s)
        values[name] = outs[driver]["text"]
        rows.append({**row, "prompt_tokens": outs[driver]["prompt_tokens"], **numbers(outs)})
    return rows


def replay(rows: list[dict], clients: dict[str, OpenAI], model: dict[str, str], salt: str,
           pause_s: float = 0.0) -> None:
    """One problem's recorded calls (``run_chain``'s rows, in order) sent again, the same messages, to ``clients``
    (the first of them the reference), under a new ``salt``; their numbers join each row."""
    for row in rows:
        row.update(numbers(call_sides(row, tuple(clients), clients, model, salt, pause_s)))


def call_sides(row: dict, order: tuple[str, ...], clients: dict[str, OpenAI], model: dict[str, str], salt: str,
               pause_s: float) -> dict[str, dict]:
    outs = {}
    for side in order:
        time.sleep(pause_s)
        outs[side] = chat(clients[side], model[side], row["messages"], row["max_tokens"], salt)
    return outs


def numbers(outs: dict[str, dict]) -> dict[str, dict]:
    """Each side's call numbers; a side with a reference (``reference_of``) also its first-token fidelity."""
    out = {}
    for side, call in outs.items():
        out[side] = {k: call[k] for k in CALL_NUMBERS}
        ref = outs.get(reference_of(side) or "")
        if ref is not None:
            agree, kl = first_token_fidelity(ref["first_logprobs"], call["first_logprobs"])
            out[side].update(first_token_agree=agree, kl_first_token_top=kl, same_text=call["text"] == ref["text"])
    return out


def _median_rate(rows: list[dict], side: str) -> float | None:
    rates = [r[side]["decode_tokens_per_s"] for r in rows if r[side]["decode_tokens_per_s"] is not None]
    return statistics.median(rates) if rates else None


def summarize(rows: list[dict], sides: list[str]) -> dict:
    """Per agent and side: TTFT median and its ratio to the plain vLLM server's (median over calls), cached tokens,
    decode speed, fidelity; per side, the whole chain's time (its calls one after another, as the agents run)."""
    out: dict = {"by_agent": {}, "by_side": {}}
    for agent in dict.fromkeys(r["agent"] for r in rows):
        mine = [r for r in rows if r["agent"] == agent]
        stats: dict = {"n_calls": len(mine), "prompt_tokens_mean": statistics.mean(r["prompt_tokens"] for r in mine)}
        for side in sides:
            calls, ref = [r[side] for r in mine], reference_of(side) or side
            s = {"ttft_ms_median": statistics.median(c["ttft_ms"] for c in calls),
                 "ttft_ratio_median": statistics.median(c["ttft_ms"] / r[ref]["ttft_ms"]
                                                        for c, r in zip(calls, mine, strict=True)),
                 "cached_tokens_mean": statistics.mean(c["cached_tokens"] for c in calls),
                 "prompt_tokens_mismatches": sum(c["prompt_tokens"] != r[ref]["prompt_tokens"]
                                                 for c, r in zip(calls, mine, strict=True)),
                 "decode_tokens_per_s_median": _median_rate(mine, side)}
            if reference_of(side) is not None:
                s.update(first_token_agreement=statistics.mean(c["first_token_agree"] for c in calls),
                         kl_first_token_top_mean=statistics.mean(c["kl_first_token_top"] for c in calls),
                         same_text_share=statistics.mean(c["same_text"] for c in calls))
            stats[side] = s
        out["by_agent"][agent] = stats
    for side in sides:
        chains: dict[str, float] = {}
        for r in rows:
            chains[r["problem_id"]] = chains.get(r["problem_id"], 0.0) + r[side]["total_ms"]
        # outputs differ in length between sides: the chain's time over the tokens it generated compares sides whose
        # answers are longer or shorter (prefill and decode alike counted in)
        num_generated = sum(r[side]["completion_tokens"] or 0 for r in rows)
        out["by_side"][side] = {"chain_ms_median": statistics.median(chains.values()),
                                "chain_ms_total": sum(chains.values()),
                                "completion_tokens_total": num_generated,
                                "ms_per_completion_token": sum(chains.values()) / max(1, num_generated),
                                "decode_tokens_per_s_median": _median_rate(rows, side)}
    return out


CONNECTOR_CONFIG = {"kv_connector": "KVRelayConnector", "kv_connector_module_path": "kvrelay.vllm.connector",
                    "kv_role": "kv_both", "kv_load_failure_policy": "recompute"}
KVRELAY_SIDES = {"kvrelay_serve": (), "kvrelay_full": ("--quality-target", "off", "--method", "full")}


def start_servers(model_dir: str, log_dir: str | None, extra_config: dict | None = None
                  ) -> tuple[VllmServer, VllmServer]:
    """The connector's server (``extra_config``: its ``kv_connector_extra_config``) and the plain one, with the same
    flags but ``--kv-transfer-config``."""
    common = {"model_dir": model_dir, "extra_args": ("--enable-prompt-tokens-details",), "startup_timeout_s": 3600,
              "env": {"VLLM_CPU_KVCACHE_SPACE": os.environ.get("VLLM_CPU_KVCACHE_SPACE") or "1"}}
    logs = {side: os.path.join(log_dir, f"vllm-chain-{side}.log") if log_dir else None
            for side in ("connector", "plain")}
    config = {**CONNECTOR_CONFIG, "kv_connector_extra_config": dict(extra_config or {})}
    connector = VllmServer(VllmServerConfig(kv_transfer_config=config, log_path=logs["connector"],
                                            **common))
    try:
        plain = VllmServer(VllmServerConfig(log_path=logs["plain"], **common))
    except BaseException:
        connector.stop()
        raise
    return connector, plain


class KvrelayServe:
    """A ``kvrelay serve`` process on a free 127.0.0.1 port (``python -m kvrelay.server``), stopped by ``stop``."""

    def __init__(self, model: str, flags: tuple[str, ...], threads: int, log_path: str | None,
                 startup_timeout_s: float = 1800.0) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.args = ["--model", model, "--threads", str(threads), "--port", str(self.port), *flags]
        self.log_path = log_path or os.path.join(os.environ.get("TMPDIR", "/tmp"), f"kvrelay-serve-{self.port}.log")
        self._log = open(self.log_path, "w+")  # noqa: SIM115 - closed in stop()
        self.proc = subprocess.Popen([sys.executable, "-m", "kvrelay.server", *self.args], stdout=self._log,
                                     stderr=subprocess.STDOUT, env={**os.environ, "OMP_NUM_THREADS": str(threads)})
        deadline = time.monotonic() + startup_timeout_s
        try:
            while not self._healthy():
                if self.proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"kvrelay serve {' '.join(self.args)} did not start:\n"
                                       f"{open(self.log_path).read()[-4000:]}")
                time.sleep(0.5)
        except BaseException:
            self.stop()
            raise

    def _healthy(self) -> bool:
        with contextlib.suppress(urllib.error.URLError, OSError):
            with urllib.request.urlopen(f"{self.url}/health", timeout=2) as response:
                return response.status == 200
        return False

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=5)
        if not self._log.closed:
            self._log.close()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model-dir", default=None, help="start both vLLM servers here on this folder (same flags)")
    parser.add_argument("--log-dir", default=None, help="where the started servers' logs go")
    parser.add_argument("--connector-url", default=None)
    parser.add_argument("--plain-url", default=None)
    parser.add_argument("--kvrelay-serve", action="store_true",
                        help="also kvrelay serve with its defaults and with --quality-target off --method full")
    parser.add_argument("--kvrelay-model", default="smollm2-135m", help="kvrelay serve's --model (the GGUF the "
                        "vLLM folder was exported from)")
    parser.add_argument("--kvrelay-threads", type=int, default=1)
    parser.add_argument("--connector-method", default=None, help="the connector's method (default: its own, epic), "
                        "e.g. relay")
    parser.add_argument("--connector-profile", default=None, help="the connector's relay layer profile JSON")
    parser.add_argument("--skip-kvrelay-full", action="store_true", help="leave out kvrelay serve --method full")
    parser.add_argument("--kvrelay-method", default=None, help="kvrelay serve runs this method with the quality guard "
                        "off (default: its defaults, the guard)")
    parser.add_argument("--kvrelay-also", default="", help="more kvrelay serve sides, one per method "
                        "(comma-separated, e.g. epic), each with the quality guard off: sides kvrelay_<method>")
    parser.add_argument("--pause-s", type=float, default=1.5, help="wait before each call")
    parser.add_argument("--workload", default="gsm8k-chain3", choices=("gsm8k-chain3", "mmlu-doc3"),
                        help="the pipeline: a chain of answers, or three agents over a shared document")
    parser.add_argument("--limit", type=int, default=5)
    parser.add_argument("--offset", type=int, default=0)
    parser.add_argument("--data", default=None)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    if (args.model_dir is None) == (args.connector_url is None or args.plain_url is None):
        parser.error("give --model-dir, or both --connector-url and --plain-url")
    servers: dict[str, VllmServer | KvrelayServe] = {}
    started: dict[str, list[str]] = {}  # each started server's arguments, for the report
    try:
        if args.model_dir:
            extra = {k: v for k, v in (("method", args.connector_method), ("profile", args.connector_profile)) if v}
            servers["connector"], servers["plain"] = start_servers(args.model_dir, args.log_dir, extra)
            started.update({side: server.config.serve_args(0)[1:] for side, server in servers.items()})
            args.connector_url, args.plain_url = servers["connector"].base_url, servers["plain"].base_url
        clients, model = open_clients({"connector": args.connector_url, "plain": args.plain_url})
        load_start = os.getloadavg()
        rows = []
        workload = get_workload(args.workload)
        problems = workload.problems(args.data, args.offset + args.limit)[args.offset:]
        for problem in problems:
            for row in run_chain("connector", clients, model, problem.inputs, uuid.uuid4().hex,
                                 pause_s=args.pause_s, spec=workload.spec):
                rows.append({"problem_id": problem.problem_id, **row})
                show(rows[-1], list(clients))
        sides = list(clients)
        if args.kvrelay_serve:  # a second pass: the same calls to kvrelay serve, beside the plain server again
            if "connector" in servers:
                servers.pop("connector").stop()  # its memory, for kvrelay serve's two processes
            urls = {"plain_again": args.plain_url}
            sides_flags = dict(KVRELAY_SIDES)
            if args.kvrelay_method:
                sides_flags["kvrelay_serve"] = ("--quality-target", "off", "--method", args.kvrelay_method)
            if args.skip_kvrelay_full:
                sides_flags.pop("kvrelay_full")
            for method in filter(None, args.kvrelay_also.split(",")):
                sides_flags[f"kvrelay_{method}"] = ("--quality-target", "off", "--method", method)
            for side, flags in sides_flags.items():
                log = os.path.join(args.log_dir, f"vllm-chain-{side}.log") if args.log_dir else None
                servers[side] = KvrelayServe(args.kvrelay_model, flags, args.kvrelay_threads, log)
                urls[side], started[side] = f"{servers[side].url}/v1", servers[side].args
            clients, model = open_clients(urls)
            for problem in problems:
                mine = [r for r in rows if r["problem_id"] == problem.problem_id]
                replay(mine, clients, model, uuid.uuid4().hex, args.pause_s)
                for row in mine:
                    show(row, list(clients))
            sides += list(clients)
        report(args, rows, sides, load_start, started)
    finally:
        for server in servers.values():
            server.stop()


def open_clients(urls: dict[str, str]) -> tuple[dict[str, OpenAI], dict[str, str]]:
    """A client per side and the model each serves; each server answers one unmeasured request first (its lazy
    set-up)."""
    clients = {side: OpenAI(base_url=url, api_key="none", timeout=600, max_retries=0) for side, url in urls.items()}
    model = {side: client.models.list().data[0].id for side, client in clients.items()}
    for side, client in clients.items():
        chat(client, model[side], [{"role": "user", "content": "Say hello."}], 4, uuid.uuid4().hex)
    return clients, model


def show(row: dict, sides: list[str]) -> None:
    print(f"{row['problem_id']} {row['agent']:9s} prompt {row['prompt_tokens']:4d}  " + "  ".join(
        f"{side} TTFT {row[side]['ttft_ms']:6.0f} cached {row[side]['cached_tokens']:4d}"
        + (f" KL {row[side]['kl_first_token_top']:.4f}" if reference_of(side) is not None else "") for side in sides),
        flush=True)


def report(args: argparse.Namespace, rows: list[dict], sides: list[str], load_start: tuple[float, ...],
           started: dict[str, list[str]]) -> None:
    summary = summarize(rows, sides)
    for agent, stats in summary["by_agent"].items():
        for side in sides:
            s = stats[side]
            print(f"{agent:9s} {side:14s} TTFT median {s['ttft_ms_median']:6.0f} ms (x{s['ttft_ratio_median']:.2f} "
                  f"plain), cached {s['cached_tokens_mean']:5.1f} of {stats['prompt_tokens_mean']:.0f}"
                  + (f", agree {s['first_token_agreement']:.2f}, KL {s['kl_first_token_top_mean']:.4f}"
                     if reference_of(side) is not None else "")
                  + (f", {s['prompt_tokens_mismatches']} prompt-token mismatches" if s["prompt_tokens_mismatches"]
                     else ""))
    for side, s in summary["by_side"].items():
        print(f"{side:14s} chain median {s['chain_ms_median']:.0f} ms, total {s['chain_ms_total'] / 1e3:.1f} s, "
              f"{s['ms_per_completion_token']:.1f} ms per generated token, decode "
              f"{s['decode_tokens_per_s_median']:.1f} tokens/s (median over calls)", flush=True)
    if args.json:
        env = {"machine": f"{platform.node()} {platform.machine()}", "num_cpus": os.cpu_count(),
               "transport": "OpenAI HTTP servers", "client": "openai (streamed)", "pause_s": args.pause_s,
               "load_avg_1_5_15_start": load_start, "load_avg_1_5_15_end": os.getloadavg(),
               "references": {side: reference_of(side) for side in sides if reference_of(side) is not None},
               "server_args": started}
        with open(args.json, "w") as f:
            json.dump({"env": env, "workload": args.workload, "n": args.limit, "offset": args.offset,
                       "sides": sides, **summary, "calls": rows}, f, indent=1)


if __name__ == "__main__":
    main()
