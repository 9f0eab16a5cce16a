"""A soak run: does a long-running ``kvrelay serve`` grow without bound under a mixed, many-tenant load?

    python benchmarks/soak.py --requests 3000 --sample-every 100 --json benchmarks/results/soak-cpu.json

Starts ``kvrelay serve`` on the embedded SmolLM2 (127.0.0.1, a free port, three API keys, a metrics key, every other
flag at its default) and sends ``--requests`` requests one after another through the official ``openai`` client,
cycling through a fixed mix (``MIX``): chat with and without tools (tool_choice auto / required / none), streams the
client drops after two chunks, Responses API calls with ``store: true`` that chain by ``previous_response_id`` and
are deleted, a tenant that sends a new ``cache_salt`` on every request, ``response_format`` json_schema with a new
schema each time (the grammar cache), logprobs, and bad requests that must answer 4xx. ``max_tokens`` stays small
(8-24), so a request is cheap and the run measures state, not compute.

Every ``--sample-every`` requests it records the server's RSS, threads and open fds (``/proc/<pid>``), the size and
series count of ``/metrics`` and the store gauges. The summary gives each series at the start, after the warm-up
(the first sample at or past ``--warmup-frac`` of the run), at the end, and its least-squares slope over the last
half of the run per 1,000 requests: growth keeps a slope; an allocator plateau has none.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import signal
import socket
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

import httpx
import openai

REPO = Path(__file__).resolve().parents[1]
MODEL = "smollm2-135m"
NUM_API_KEYS = 3
MIX = ("chat", "tools_auto", "tools_required", "tools_none", "stream_drop", "responses_chain", "salt_churn",
       "json_schema", "logprobs", "bad_request")
WEATHER_TOOL = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
QUESTIONS = ("What is 17 * 3?", "Name a prime above 20.", "What is the capital of France?",
             "Say hello in Spanish.", "What colour is the sky?", "How many legs has a spider?")
SAMPLED_GAUGES = ("kvrelay_store_bytes", "kvrelay_store_spans", "kvrelay_store_namespaces",
                  "kvrelay_store_namespaces_reclaimed_total", "kvrelay_quality_shadows_pending",
                  "kvrelay_sequence_kv_bytes", "kvrelay_cancelled_total")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def proc_stats(pid: int) -> dict:
    """RSS (MB), threads and open file descriptors of a process, from /proc."""
    out: dict = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            out["rss_mb"] = int(line.split()[1]) / 1024
        elif line.startswith("Threads:"):
            out["num_threads"] = int(line.split()[1])
    out["num_fds"] = len(os.listdir(f"/proc/{pid}/fd"))
    return out


def metrics_stats(base_url: str, metrics_key: str) -> dict:
    """The /metrics page's bytes and number of series (sample lines), and the sampled store gauges."""
    text = httpx.get(f"{base_url}/metrics", headers={"Authorization": f"Bearer {metrics_key}"}, timeout=60).text
    samples = [line for line in text.splitlines() if line and not line.startswith("#")]
    out = {"metrics_bytes": len(text.encode()), "num_metrics_series": len(samples)}
    for line in samples:
        name, _, value = line.rpartition(" ")
        if name in SAMPLED_GAUGES:
            out[name.removeprefix("kvrelay_")] = float(value)
    return out


class Mix:
    """The request mix: one call per kind, each a fresh small request; a kind's outcome is counted by status."""

    def __init__(self, base_url: str, api_keys: list[str]) -> None:
        self.clients = [openai.OpenAI(base_url=f"{base_url}/v1", api_key=k, max_retries=0, timeout=300)
                        for k in api_keys]
        self.base_url = base_url
        self.api_keys = api_keys
        self.chain_ids: list[str] = []  # the current previous_response_id chain (client 1)
        self.num_schemas = 0
        self.counts: dict[str, dict[str, int]] = {kind: {} for kind in MIX}

    def question(self, i: int) -> list[dict]:
        return [{"role": "user", "content": f"{QUESTIONS[i % len(QUESTIONS)]} (case {i % 97})"}]

    def run(self, kind: str, i: int) -> str:
        """Send request ``i`` of ``kind``; its outcome ("ok", "4xx", or the exception's class)."""
        try:
            getattr(self, kind)(i)
            outcome = "ok"
        except openai.APIStatusError as exc:
            outcome = f"{exc.status_code}"
        except Exception as exc:  # counted: a soak records failures instead of stopping on them
            outcome = type(exc).__name__
        self.counts[kind][outcome] = self.counts[kind].get(outcome, 0) + 1
        return outcome

    def chat(self, i: int) -> None:
        self.clients[0].chat.completions.create(model=MODEL, messages=self.question(i), max_tokens=16, temperature=0)

    def _tools(self, i: int, choice: str) -> None:
        self.clients[1].chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": f"What is the weather in city {i % 50}?"}],
            tools=[WEATHER_TOOL], tool_choice=choice, max_tokens=24, temperature=0)

    def tools_auto(self, i: int) -> None:
        self._tools(i, "auto")

    def tools_required(self, i: int) -> None:
        self._tools(i, "required")

    def tools_none(self, i: int) -> None:
        self._tools(i, "none")

    def stream_drop(self, i: int) -> None:
        stream = self.clients[2].chat.completions.create(
            model=MODEL, messages=self.question(i), max_tokens=24, temperature=0, stream=True)
        for n, _ in enumerate(stream):
            if n >= 1:
                break
        stream.close()  # the client goes away mid-answer: the server must cancel and free the request

    def responses_chain(self, i: int) -> None:
        """A conversation of three turns by previous_response_id, then every turn deleted."""
        client = self.clients[1]
        previous = self.chain_ids[-1] if self.chain_ids else None
        r = client.responses.create(model=MODEL, input=QUESTIONS[i % len(QUESTIONS)], store=True,
                                    max_output_tokens=16, previous_response_id=previous)
        self.chain_ids.append(r.id)
        if len(self.chain_ids) >= 3:
            for rid in self.chain_ids:
                client.responses.delete(rid)
            self.chain_ids = []

    def salt_churn(self, i: int) -> None:
        """A tenant that sends a new cache_salt on every request (a namespace per conversation)."""
        self.clients[2].chat.completions.create(
            model=MODEL, messages=self.question(i), max_tokens=8, temperature=0,
            extra_body={"cache_salt": uuid.uuid4().hex}, extra_headers={"x-kvrelay-agent": f"role-{i % 5}"})

    def json_schema(self, i: int) -> None:
        """A schema never sent before: one more compiled grammar."""
        self.num_schemas += 1
        schema = {"type": "object", "properties": {f"field_{self.num_schemas}": {"type": "integer"}},
                  "required": [f"field_{self.num_schemas}"], "additionalProperties": False}
        self.clients[i % len(self.clients)].chat.completions.create(
            model=MODEL, messages=self.question(i), max_tokens=16, temperature=0,
            response_format={"type": "json_schema", "json_schema": {"name": f"s{self.num_schemas}", "schema": schema}})

    def logprobs(self, i: int) -> None:
        self.clients[0].chat.completions.create(model=MODEL, messages=self.question(i), max_tokens=8, temperature=0,
                                                logprobs=True, top_logprobs=3)

    def bad_request(self, i: int) -> None:
        """One of a few malformed requests; each must be a 4xx."""
        client = self.clients[i % len(self.clients)]
        variant = (i // len(MIX)) % 4
        if variant == 0:
            client.chat.completions.create(model=MODEL, messages=self.question(i), max_tokens=-3)
        elif variant == 1:
            client.chat.completions.create(model=MODEL, messages=self.question(i), temperature="hot")  # type: ignore[arg-type]
        elif variant == 2:
            client.responses.create(model=MODEL, input="hi", previous_response_id=f"resp_{uuid.uuid4().hex}",
                                    max_output_tokens=8)
        else:
            client.chat.completions.create(model=MODEL, messages=self.question(i), max_tokens=8,
                                           response_format={"type": "json_schema", "json_schema": {
                                               "name": "bad", "schema": {"type": "nonsense"}}})


def start_server(workdir: Path, extra_flags: list[str]) -> tuple[subprocess.Popen, str, list[str], str]:
    keys = [uuid.uuid4().hex for _ in range(NUM_API_KEYS)]
    metrics_key = uuid.uuid4().hex
    (workdir / "keys.txt").write_text("\n".join(keys) + "\n")
    (workdir / "metrics.key").write_text(metrics_key + "\n")
    port = free_port()
    log = open(workdir / "server.log", "w")
    cmd = [sys.executable, "-m", "kvrelay", "serve", "--model", MODEL, "--host", "127.0.0.1", "--port", str(port),
           "--api-keys", str(workdir / "keys.txt"), "--metrics-key", str(workdir / "metrics.key"), *extra_flags]
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=REPO,
                            env={**os.environ, "PYTHONPATH": str(REPO)})
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode}: see {workdir / 'server.log'}")
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return proc, url, keys, metrics_key
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    proc.terminate()
    raise RuntimeError("server did not start in 600 s")


def slope_per_1k(points: list[tuple[int, float]]) -> float | None:
    """Least-squares slope of value over requests, per 1,000 requests."""
    if len(points) < 2:
        return None
    n = len(points)
    mean_x = sum(x for x, _ in points) / n
    mean_y = sum(y for _, y in points) / n
    var_x = sum((x - mean_x) ** 2 for x, _ in points)
    return 1000 * sum((x - mean_x) * (y - mean_y) for x, y in points) / var_x if var_x else None


def summarize(samples: list[dict], num_requests: int, warmup_frac: float) -> dict:
    """Per series: start, after warm-up, end, and the slope over the last half of the run (per 1,000 requests)."""
    warm = next((s for s in samples if s["requests"] >= warmup_frac * num_requests), samples[-1])
    out = {}
    for key in samples[0]:
        if key in ("requests", "elapsed_s") or not isinstance(samples[0][key], (int, float)):
            continue
        points = [(s["requests"], s[key]) for s in samples if s["requests"] >= num_requests / 2 and key in s]
        out[key] = {"start": samples[0].get(key), "after_warmup": warm.get(key), "end": samples[-1].get(key),
                    "slope_last_half_per_1k_requests": slope_per_1k(points)}
    return out


def write_result(path: Path | None, args: argparse.Namespace, mix: Mix, samples: list[dict], done: bool) -> dict:
    """The run so far (``complete`` False until the last sample): written at every sample, so a run stopped early
    still leaves its series."""
    result = {"env": {"machine": platform.node(), "cpus": os.cpu_count(), "python": platform.python_version(),
                      "commit": subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                                               text=True, cwd=REPO).stdout.strip()},
              "model": MODEL, "requests": args.requests, "sample_every": args.sample_every, "complete": done,
              "server_flags": args.server_flags, "outcomes": mix.counts,
              "summary": summarize(samples, samples[-1]["requests"], args.warmup_frac), "samples": samples}
    if path is not None:
        path.write_text(json.dumps(result, indent=1) + "\n")
    return result


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--requests", type=int, default=300, help="requests to send in all")
    ap.add_argument("--sample-every", type=int, default=30, help="requests between two samples")
    ap.add_argument("--warmup-frac", type=float, default=0.2, help="share of the run reported as the warm-up")
    ap.add_argument("--server-flags", default="", help="more flags for kvrelay serve (split on spaces)")
    ap.add_argument("--json", type=Path, help="write the series and the summary here")
    args = ap.parse_args(argv)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # stop the server too (the finally below)
    with tempfile.TemporaryDirectory(prefix="kvrelay-soak-") as tmp:
        proc, url, keys, metrics_key = start_server(Path(tmp), args.server_flags.split())
        try:
            mix = Mix(url, keys)
            samples = []
            t0 = time.perf_counter()
            for i in range(args.requests + 1):
                if i % args.sample_every == 0 or i == args.requests:
                    sample = {"requests": i, "elapsed_s": round(time.perf_counter() - t0, 1),
                              **proc_stats(proc.pid), **metrics_stats(url, metrics_key)}
                    samples.append(sample)
                    print(json.dumps(sample), flush=True)
                    write_result(args.json, args, mix, samples, done=i == args.requests)
                if i < args.requests:
                    mix.run(MIX[i % len(MIX)], i)
                if proc.poll() is not None:
                    raise RuntimeError(f"server exited with {proc.returncode} after {i} requests")
        finally:
            proc.terminate()
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                proc.kill()
    result = write_result(args.json, args, mix, samples, done=True)
    print(json.dumps(result["summary"], indent=1))
    print(json.dumps(result["outcomes"]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
