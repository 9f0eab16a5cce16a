"""gsm8k-chain3 as plain chat requests against vLLM's OpenAI server: with kvrelay's connector, and vLLM alone.

    python benchmarks/vllm_chain.py --model-dir SMOLLM2_DIR --limit 5 --json benchmarks/results/vllm-chain-cpu.json

starts both servers through ``kvrelay.vllm.launch`` with the same flags (``--dtype float32 --enforce-eager
--enable-prefix-caching --enable-prompt-tokens-details --max-logprobs 20``), one of them with kvrelay's connector
(``--kv-transfer-config``), and stops them at the end; ``--connector-url`` and ``--plain-url`` use servers
already running instead.

Each server first answers one unmeasured request (its lazy set-up). Per problem, a fresh ``cache_salt``; the chain
runs on the connector's server (each agent's messages quote the upstream answers as text, greedy), and each call
is sent, with the very same messages, to the plain server right after (its prefix cache sees the same history,
and load that drifts over time falls on both). Per call: client-side TTFT (streamed), total time, decode speed
(tokens after the first over the time after the first), ``cached_tokens``, and the first token's top logprobs;
fidelity is the connector's first token against the plain server's on the same prompt (same template, same
ids): top-1 agreement and KL over the plain server's top tokens. A chain's time is the sum of its three calls.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import statistics
import time
import uuid

from openai import OpenAI

from kvrelay.pipeline.workloads import gsm8k_chain3
from kvrelay.vllm.server_process import VllmServer, VllmServerConfig

TOP_LOGPROBS = 20
CALL_NUMBERS = ("ttft_ms", "total_ms", "cached_tokens", "completion_tokens", "decode_tokens_per_s")


def chat(client: OpenAI, model: str, messages: list[dict], max_tokens: int, salt: str) -> dict:
    """One greedy streamed call: its text, client TTFT, cached tokens and first-token top logprobs."""
    t0 = time.perf_counter()
    stream = client.chat.completions.create(
        model=model, messages=messages, max_tokens=max_tokens, temperature=0, stream=True, logprobs=True,
        top_logprobs=TOP_LOGPROBS, stream_options={"include_usage": True}, extra_body={"cache_salt": salt})
    ttft_ms, text, first, usage = None, [], None, None
    for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
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
            "cached_tokens": getattr(details, "cached_tokens", 0) or 0, "first_logprobs": first or {}}


def first_token_fidelity(reference: dict[str, float], method: dict[str, float]) -> tuple[bool, float]:
    """(top-1 equal, KL(reference || method) over the reference's top tokens), each side's top-k renormalized;
    a reference token missing from the method's top-k gets the method's smallest logprob there."""
    agree = max(reference, key=reference.get) == max(method, key=method.get)
    floor = min(method.values())
    ref_z = math.log(sum(math.exp(lp) for lp in reference.values()))
    met_z = math.log(sum(math.exp(lp) for lp in method.values()))
    kl = sum(math.exp(lp - ref_z) * ((lp - ref_z) - (method.get(tok, floor) - met_z)) for tok, lp in reference.items())
    return agree, max(kl, 0.0)


def run_chain(connector: OpenAI, plain: OpenAI, model: str, question: str, salt: str,
              max_tokens: dict[str, int] | None = None) -> list[dict]:
    """One problem through the chain on ``connector``; each call is sent at once to ``plain`` too (the very same
    messages, so both servers see the same history, and load that drifts over time falls on both): a row per
    agent."""
    spec = gsm8k_chain3().spec
    values, rows = {"question": question}, []
    for name in spec.order:
        agent = spec.agent(name)
        messages = [{"role": "system", "content": agent.system},
                    {"role": "user", "content": agent.user.format(**values)}]
        tokens = (max_tokens or {}).get(name, agent.max_new_tokens)
        out = chat(connector, model, messages, tokens, salt)
        values[name] = out["text"]
        ref = chat(plain, model, messages, tokens, salt)
        agree, kl = first_token_fidelity(ref["first_logprobs"], out["first_logprobs"])
        rows.append({"agent": name, "prompt_tokens": out["prompt_tokens"],
                     "connector": {k: out[k] for k in CALL_NUMBERS}, "plain": {k: ref[k] for k in CALL_NUMBERS},
                     "first_token_agree": agree, "kl_first_token_top": kl,
                     "same_text": out["text"] == ref["text"]})
    return rows


def _median_rate(rows: list[dict], side: str) -> float | None:
    rates = [r[side]["decode_tokens_per_s"] for r in rows if r[side]["decode_tokens_per_s"] is not None]
    return statistics.median(rates) if rates else None


def summarize(rows: list[dict]) -> dict:
    """Per agent: TTFT medians and their ratio, cached tokens, decode speed, fidelity; and per side, the whole
    chain's time (its calls one after another, as the agents run) per problem."""
    out: dict = {"by_agent": {}}
    for agent in dict.fromkeys(r["agent"] for r in rows):
        mine = [r for r in rows if r["agent"] == agent]
        out["by_agent"][agent] = {
            "n_calls": len(mine),
            "prompt_tokens_mean": statistics.mean(r["prompt_tokens"] for r in mine),
            "ttft_ms_median_connector": statistics.median(r["connector"]["ttft_ms"] for r in mine),
            "ttft_ms_median_plain": statistics.median(r["plain"]["ttft_ms"] for r in mine),
            "ttft_ratio_median": statistics.median(r["connector"]["ttft_ms"] / r["plain"]["ttft_ms"] for r in mine),
            "cached_tokens_mean_connector": statistics.mean(r["connector"]["cached_tokens"] for r in mine),
            "cached_tokens_mean_plain": statistics.mean(r["plain"]["cached_tokens"] for r in mine),
            "decode_tokens_per_s_median_connector": _median_rate(mine, "connector"),
            "decode_tokens_per_s_median_plain": _median_rate(mine, "plain"),
            "first_token_agreement": statistics.mean(r["first_token_agree"] for r in mine),
            "kl_first_token_top_mean": statistics.mean(r["kl_first_token_top"] for r in mine)}
    for side in ("connector", "plain"):
        chains: dict[str, float] = {}
        for r in rows:
            chains[r["problem_id"]] = chains.get(r["problem_id"], 0.0) + r[side]["total_ms"]
        out[f"chain_ms_median_{side}"] = statistics.median(chains.values())
        out[f"chain_ms_total_{side}"] = sum(chains.values())
        out[f"decode_tokens_per_s_median_{side}"] = _median_rate(rows, side)
    return out


CONNECTOR_CONFIG = {"kv_connector": "KVRelayConnector", "kv_connector_module_path": "kvrelay.vllm.connector",
                    "kv_role": "kv_both", "kv_load_failure_policy": "recompute"}


def start_servers(model_dir: str, log_dir: str | None) -> tuple[VllmServer, VllmServer]:
    """The connector's server and the plain one, with the same flags but ``--kv-transfer-config``."""
    common = {"model_dir": model_dir, "extra_args": ("--enable-prompt-tokens-details",), "startup_timeout_s": 3600,
              "env": {"VLLM_CPU_KVCACHE_SPACE": os.environ.get("VLLM_CPU_KVCACHE_SPACE") or "1"}}
    logs = {side: os.path.join(log_dir, f"vllm-chain-{side}.log") if log_dir else None
            for side in ("connector", "plain")}
    connector = VllmServer(VllmServerConfig(kv_transfer_config=CONNECTOR_CONFIG, log_path=logs["connector"],
                                            **common))
    try:
        plain = VllmServer(VllmServerConfig(log_path=logs["plain"], **common))
    except BaseException:
        connector.stop()
        raise
    return connector, plain


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model-dir", default=None, help="start both servers here on this folder (same flags)")
    parser.add_argument("--log-dir", default=None, help="with --model-dir: where the servers' logs go")
    parser.add_argument("--connector-url", default=None)
    parser.add_argument("--plain-url", default=None)
    parser.add_argument("--limit", type=int, default=5)
    parser.add_argument("--offset", type=int, default=0)
    parser.add_argument("--data", default=None)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    if (args.model_dir is None) == (args.connector_url is None or args.plain_url is None):
        parser.error("give --model-dir, or both --connector-url and --plain-url")
    servers: tuple[VllmServer, ...] = ()
    if args.model_dir:
        servers = start_servers(args.model_dir, args.log_dir)
        args.connector_url, args.plain_url = servers[0].base_url, servers[1].base_url
    try:
        run(args, servers)
    finally:
        for server in servers:
            server.stop()


def run(args: argparse.Namespace, servers: tuple[VllmServer, ...]) -> None:
    connector = OpenAI(base_url=args.connector_url, api_key="none", timeout=600, max_retries=0)
    plain = OpenAI(base_url=args.plain_url, api_key="none", timeout=600, max_retries=0)
    model = connector.models.list().data[0].id
    for client in (connector, plain):  # a server's first request pays its lazy set-up: not measured, either side
        chat(client, model, [{"role": "user", "content": "Say hello."}], 4, uuid.uuid4().hex)
    load_start = os.getloadavg()
    rows = []
    for problem in gsm8k_chain3().problems(args.data, args.offset + args.limit)[args.offset:]:
        for row in run_chain(connector, plain, model, problem.inputs["question"], uuid.uuid4().hex):
            rows.append({"problem_id": problem.problem_id, **row})
            print(f"{problem.problem_id} {row['agent']:9s} TTFT {row['connector']['ttft_ms']:7.0f} ms "
                  f"(plain {row['plain']['ttft_ms']:7.0f}) cached {row['connector']['cached_tokens']:4d} "
                  f"(plain {row['plain']['cached_tokens']:4d}) of {row['prompt_tokens']:4d}  "
                  f"agree {row['first_token_agree']}  KL {row['kl_first_token_top']:.4f}", flush=True)
    summary = summarize(rows)
    for agent, s in summary["by_agent"].items():
        print(f"{agent:9s} TTFT median {s['ttft_ms_median_connector']:.0f} ms vs {s['ttft_ms_median_plain']:.0f} ms "
              f"(ratio {s['ttft_ratio_median']:.2f}), cached {s['cached_tokens_mean_connector']:.0f} vs "
              f"{s['cached_tokens_mean_plain']:.0f} of {s['prompt_tokens_mean']:.0f}, agree "
              f"{s['first_token_agreement']:.2f}, KL {s['kl_first_token_top_mean']:.4f}")
    print(f"chain median {summary['chain_ms_median_connector']:.0f} ms vs {summary['chain_ms_median_plain']:.0f} ms, "
          f"decode {summary['decode_tokens_per_s_median_connector']:.1f} vs "
          f"{summary['decode_tokens_per_s_median_plain']:.1f} tokens/s (median over calls)", flush=True)
    if args.json:
        env = {"machine": f"{platform.node()} {platform.machine()}", "num_cpus": os.cpu_count(),
               "transport": "vLLM OpenAI server", "client": "openai (streamed)",
               "load_avg_1_5_15_start": load_start, "load_avg_1_5_15_end": os.getloadavg()}
        if servers:
            env["server_args"] = {side: server.config.serve_args(0)[1:] for side, server in
                                  zip(("connector", "plain"), servers, strict=True)}
        with open(args.json, "w") as f:
            json.dump({"env": env, "workload": "gsm8k-chain3", "n": args.limit, "offset": args.offset, **summary,
                       "calls": rows}, f, indent=1)


if __name__ == "__main__":
    main()
