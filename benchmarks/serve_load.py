"""A bounded load run against ``kvrelay serve``: N concurrent clients, each running 3-agent chains.

    kvrelay serve --model smollm2-135m --port 8012 &
    python benchmarks/serve_load.py --base-url http://127.0.0.1:8012/v1 --clients 1,8 --seconds 60,120 \
        --server-pid $! --json benchmarks/results/serve-load.json

Every client loops over GSM8K questions: solver (48 tokens) -> critic (32) -> finalizer (16), each
a streamed chat request quoting the earlier answers as text, in its own namespace. Reported per
phase: requests done and failed, client-side TTFT p50/p99 (request sent -> first content chunk),
aggregate completion tokens/s, and the server's RSS at the start and end (from /proc).
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import subprocess
import threading
import time
import urllib.request
import uuid
from pathlib import Path

from openai import OpenAI

from kvrelay.pipeline.workloads import gsm8k_chain3


def _commit() -> str | None:
    """The client's checkout (run the server from the same one)."""
    try:
        out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                             cwd=Path(__file__).parent)
    except OSError:
        return None
    return out.stdout.strip() or None


def rss_mb(pid: int | None) -> float | None:
    if pid is None:
        return None
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return None


def store_metrics(base_url: str) -> dict:
    """The server's store gauges and counters from /metrics (cumulative since the server started)."""
    wanted = {"kvrelay_store_bytes": "store_bytes", "kvrelay_store_peak_bytes": "store_peak_bytes",
              "kvrelay_store_budget_bytes": "store_budget_bytes", "kvrelay_store_namespaces": "namespaces",
              "kvrelay_store_namespaces_reclaimed_total": "namespaces_reclaimed",
              'kvrelay_store_puts_refused_total{reason="quota"}': "puts_refused_quota",
              'kvrelay_store_puts_refused_total{reason="store_full"}': "puts_refused_store_full",
              "kvrelay_publish_skipped_total": "publish_skipped", "kvrelay_rejected_queue_full_total": "rejected_429"}
    text = urllib.request.urlopen(base_url.removesuffix("/v1") + "/metrics", timeout=30).read().decode()
    out = {}
    for line in text.splitlines():
        name, _, value = line.rpartition(" ")
        if name in wanted:
            out[wanted[name]] = int(float(value))
    return out


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] if ordered else float("nan")


class Client(threading.Thread):
    def __init__(self, base_url: str, model: str, questions: list[str], deadline: float, seed: int) -> None:
        super().__init__(daemon=True)
        self.client = OpenAI(base_url=base_url, api_key="none", timeout=300, max_retries=0)
        self.model, self.questions, self.deadline, self.seed = model, questions, deadline, seed
        self.ttft_ms: list[float] = []
        self.tokens = 0
        self.done = 0
        self.failed = 0
        self.cached: list[int] = []

    def ask(self, system: str, user: str, max_tokens: int, salt: str) -> str:
        t0 = time.perf_counter()
        first = None
        text = ""
        stream = self.client.chat.completions.create(
            model=self.model, messages=[{"role": "system", "content": system}, {"role": "user", "content": user}],
            max_tokens=max_tokens, temperature=0, stream=True, stream_options={"include_usage": True},
            extra_body={"cache_salt": salt})
        for chunk in stream:
            if chunk.choices and chunk.choices[0].delta.content:
                first = first or time.perf_counter()
                text += chunk.choices[0].delta.content
            if chunk.usage is not None:
                self.tokens += chunk.usage.completion_tokens
                self.cached.append(chunk.usage.prompt_tokens_details.cached_tokens)
        self.ttft_ms.append(((first or time.perf_counter()) - t0) * 1e3)
        self.done += 1
        return text

    def run(self) -> None:
        spec = gsm8k_chain3().spec
        i = self.seed
        while time.perf_counter() < self.deadline:
            values = {"question": self.questions[i % len(self.questions)]}
            salt = uuid.uuid4().hex
            i += 1
            for name, max_tokens in (("solver", 48), ("critic", 32), ("finalizer", 16)):
                if time.perf_counter() >= self.deadline:
                    return
                agent = spec.agent(name)
                try:
                    values[name] = self.ask(agent.system, agent.user.format(**values), max_tokens, salt)
                except Exception as exc:  # counted, and this chain is abandoned
                    self.failed += 1
                    print(f"request failed: {exc!r}", flush=True)
                    break


def phase(base_url: str, model: str, questions: list[str], clients: int, seconds: float, pid: int | None) -> dict:
    rss_start = rss_mb(pid)
    t0 = time.perf_counter()
    workers = [Client(base_url, model, questions, t0 + seconds, seed=k * 7) for k in range(clients)]
    for w in workers:
        w.start()
    for w in workers:
        w.join()
    elapsed = time.perf_counter() - t0  # requests in flight at the deadline finish first
    ttft = [t for w in workers for t in w.ttft_ms]
    row = {"clients": clients, "seconds": round(elapsed, 1), "requests": sum(w.done for w in workers),
           "failed": sum(w.failed for w in workers), "ttft_ms_p50": percentile(ttft, 0.5),
           "ttft_ms_p99": percentile(ttft, 0.99), "tokens_per_s": sum(w.tokens for w in workers) / elapsed,
           "cached_tokens_mean": statistics.mean(c for w in workers for c in w.cached) if ttft else 0.0,
           "rss_mb_start": rss_start, "rss_mb_end": rss_mb(pid), "store_at_end": store_metrics(base_url)}
    print(json.dumps(row), flush=True)
    return row


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--base-url", default="http://127.0.0.1:8000/v1")
    parser.add_argument("--clients", default="1,8")
    parser.add_argument("--seconds", default="60,120", help="duration of each phase (one per --clients entry)")
    parser.add_argument("--server-pid", type=int, default=None)
    parser.add_argument("--data", default=None)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    model = OpenAI(base_url=args.base_url, api_key="none").models.list().data[0].id
    questions = [p.inputs["question"] for p in gsm8k_chain3().problems(args.data, 40)]
    rows = [phase(args.base_url, model, questions, int(c), float(s), args.server_pid)
            for c, s in zip(args.clients.split(","), args.seconds.split(","), strict=True)]
    if args.json:
        with open(args.json, "w") as f:
            env = {"machine": platform.machine(), "commit": _commit()}
            json.dump({"env": env, "model": model, "phases": rows}, f, indent=1)


if __name__ == "__main__":
    main()
