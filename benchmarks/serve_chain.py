"""gsm8k-chain3 over HTTP as plain chat requests: reuse and fidelity per method against ``full``.

    kvrelay serve --model smollm2-135m --methods relay,prefix,naive --port 8011 &
    python benchmarks/serve_chain.py --base-url http://127.0.0.1:8011/v1 --limit 10 \
        --methods prefix,naive,epic,relay --json benchmarks/results/serve-chain.json

The agent-mode protocol of ``kvrelay bench``, through the API: per problem, a fresh namespace
(``cache_salt``); each agent's messages are the workload's templates with the question and the
upstream answers pasted in as *text*. For every downstream agent, each method first runs a probe
on those messages (greedy, 32 tokens, ``cache_output: false`` so the probe is not stored), then
``full`` runs the call for real (its output is stored and quoted by the next agent). So every
method sees exactly the upstream spans, as in the in-process bench. Fidelity is against that
``full`` call: first token equal, first 32 greedy tokens equal. Reuse is the server's reuse_rate
(token-layers), speedup the median of per-call server TTFT ratios full / method.

Several servers (``--base-url URL1,URL2``, e.g. replicas on one ``--store redis://...`` tier): the
agents go round-robin across them by position (solver on the first, critic on the second, ...), each
agent's probes on the server its real call goes to, so every downstream agent reads what an agent on
another process published.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import uuid

from openai import OpenAI

from kvrelay.eval.fidelity import first_token_margin, kl_first_token
from kvrelay.eval.harness import environment
from kvrelay.eval.report import NEAR_TIE_MARGIN
from kvrelay.pipeline.workloads import gsm8k_chain3
from kvrelay.server.textstream import decode_logprobs

GREEDY_TOKENS = 32


def call(client: OpenAI, model: str, messages: list[dict], method: str, max_tokens: int, salt: str,
         cache_output: bool, keep_debug: bool = False) -> dict:
    r = client.chat.completions.create(
        model=model, messages=messages, max_tokens=max_tokens, temperature=0,
        extra_body={"cache_salt": salt, "kvrelay": {"method": method, "debug": True, "cache_output": cache_output,
                                                    "first_token_logprobs": True}})
    ext = r.model_extra["kvrelay"]
    out = {"text": r.choices[0].message.content, "output_ids": ext["debug"]["output_ids"],
           "prompt_tokens": r.usage.prompt_tokens, "cached_tokens": r.usage.prompt_tokens_details.cached_tokens,
           "reuse_rate": ext["reuse_rate"], "ttft_ms": ext["ttft_ms"], "fallback": ext["fallback"],
           "recomputed_token_layers": ext["num_recomputed_token_layers"],
           "first_logprobs": decode_logprobs(ext["first_token_logprobs"])}
    if keep_debug:
        out["prompt_ids"], out["refs"] = ext["debug"]["prompt_ids"], ext["debug"]["refs"]
    return out


def summarize(rows: list[dict], method: str) -> dict:
    mine = [r for r in rows if r["method"] == method]
    tokens = sum(r["prompt_tokens"] for r in mine)
    clear = [r for r in mine if r["full_first_margin"] >= NEAR_TIE_MARGIN]
    return {"n_calls": len(mine),
            "reuse_rate": sum(r["reuse_rate"] * r["prompt_tokens"] for r in mine) / tokens,
            "cached_tokens_mean": statistics.mean(r["cached_tokens"] for r in mine),
            "first_token_agreement": statistics.mean(r["first_token_agree"] for r in mine),
            "first_token_agreement_clear": statistics.mean(r["first_token_agree"] for r in clear) if clear else None,
            "near_tie_rate": 1 - len(clear) / len(mine),
            "kl_first_token": statistics.mean(r["kl_first_token"] for r in mine),
            "greedy_match_rate": statistics.mean(r["greedy_match"] for r in mine),
            "speedup_vs_full": statistics.median(r["full_ttft_ms"] / r["ttft_ms"] for r in mine),
            "ttft_ms_median": statistics.median(r["ttft_ms"] for r in mine),
            "by_agent": {agent: {"n_calls": len(calls),
                                 "ttft_ms_median": statistics.median(r["ttft_ms"] for r in calls),
                                 "full_ttft_ms_median": statistics.median(r["full_ttft_ms"] for r in calls),
                                 "speedup_vs_full": statistics.median(r["full_ttft_ms"] / r["ttft_ms"] for r in calls)}
                         for agent in dict.fromkeys(r["agent"] for r in mine)
                         for calls in [[r for r in mine if r["agent"] == agent]]}}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--base-url", default="http://127.0.0.1:8000/v1",
                        help="one server, or several comma-separated (agents round-robin across them)")
    parser.add_argument("--limit", type=int, default=10)
    parser.add_argument("--methods", default="prefix,naive,epic,relay")
    parser.add_argument("--data", default=None)
    parser.add_argument("--offset", type=int, default=0, help="index of the first problem")
    parser.add_argument("--keep-debug", action="store_true", help="keep every call's prompt ids and refs in the JSON")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    clients = [OpenAI(base_url=url, api_key="none", timeout=600, max_retries=0) for url in args.base_url.split(",")]
    model = clients[0].models.list().data[0].id
    methods = [m for m in args.methods.split(",") if m]
    workload = gsm8k_chain3()
    spec = workload.spec
    rows: list[dict] = []
    for problem in workload.problems(args.data, args.offset + args.limit)[args.offset:]:
        salt = uuid.uuid4().hex
        values = dict(problem.inputs)
        for position, name in enumerate(spec.order):
            agent, client = spec.agent(name), clients[position % len(clients)]
            messages = [{"role": "system", "content": agent.system},
                        {"role": "user", "content": agent.user.format(**values)}]
            probes = {}
            if position > 0:
                for method in methods:
                    probes[method] = call(client, model, messages, method, GREEDY_TOKENS, salt, cache_output=False,
                                          keep_debug=args.keep_debug)
            ref = call(client, model, messages, "full", agent.max_new_tokens, salt, cache_output=True,
                       keep_debug=args.keep_debug)
            values[name] = ref["text"]
            full_logprobs = ref.pop("first_logprobs")
            for method, p in probes.items():
                logprobs = p.pop("first_logprobs")
                rows.append({"problem_id": problem.problem_id, "agent": name, "method": method, **p,
                             "full_ttft_ms": ref["ttft_ms"],
                             "full_first_margin": first_token_margin(full_logprobs),
                             "kl_first_token": kl_first_token(full_logprobs, logprobs),
                             "first_token_agree": p["output_ids"][:1] == ref["output_ids"][:1],
                             "greedy_match": p["output_ids"] == ref["output_ids"][:GREEDY_TOKENS],
                             **({"full_prompt_ids": ref["prompt_ids"]} if args.keep_debug else {})})
            if probes:
                line = "  ".join(f"{m} reuse {p['reuse_rate']:.2f} x{ref['ttft_ms'] / p['ttft_ms']:.2f}"
                                 for m, p in probes.items())
                print(f"{problem.problem_id} {name:9s} full {ref['ttft_ms']:6.0f} ms  {line}", flush=True)
    results = {m: summarize(rows, m) for m in methods}
    for m, s in results.items():
        print(f"{m:28s} reuse {s['reuse_rate']:.3f}  1st {s['first_token_agreement']:.2f}  "
              f"KL {s['kl_first_token']:.4f}  greedy@32 {s['greedy_match_rate']:.2f}  "
              f"speedup {s['speedup_vs_full']:.2f}x  "
              f"cached {s['cached_tokens_mean']:.0f} tok")
        for agent, a in s["by_agent"].items():
            print(f"    {agent:10s} TTFT {a['ttft_ms_median']:7.1f} ms, full {a['full_ttft_ms_median']:7.1f} ms, "
                  f"speedup {a['speedup_vs_full']:.2f}x ({a['n_calls']} calls)")
    if args.json:
        with open(args.json, "w") as f:
            env = {**environment("cpu"), "transport": "HTTP (kvrelay serve)", "servers": len(clients)}
            env["machine"] = f"{platform.node()} {platform.machine()} (the client; the server's threads are its own)"
            json.dump({"env": env, "model": model,
                       "workload": "gsm8k-chain3", "n": args.limit, "offset": args.offset, "results": results,
                       "calls": rows}, f, indent=1)


if __name__ == "__main__":
    main()
