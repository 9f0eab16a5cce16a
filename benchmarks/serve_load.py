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
import os
import platform
import statistics
import subprocess
import sys
import threading
import time
import urllib.error
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


def wait_for_shadows(base_url: str, timeout_s: float = 900) -> float:
    """Wait until the server has no shadow reference pending (its quality guard's ``full`` runs of sampled
    requests, done in otherwise idle turns); the seconds waited. A server without the gauge is not waited for."""
    t0 = time.perf_counter()
    while time.perf_counter() - t0 < timeout_s:
        text = urllib.request.urlopen(base_url.removesuffix("/v1") + "/metrics", timeout=30).read().decode()
        pending = [float(line.split()[-1]) for line in text.splitlines()
                   if line.startswith("kvrelay_quality_shadows_pending ")]
        if not pending or pending[0] == 0:
            break
        time.sleep(1.0)
    return time.perf_counter() - t0


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


# ---------------------------------------------------------------------------------------------- hostile requests
_WORDS = ("the of and to in is was for on that with as by at from his her are were which this be or an had not but "
          "have they").split()
HOSTILE_KINDS = ("tiny_temperature", "chunked_huge_body", "long_prompt", "lone_surrogate", "bad_types")


def _post_raw(base_url: str, body: bytes, chunked: bool = False, timeout_s: float = 900,
              replies: list | None = None) -> int:
    """POST a raw body to chat completions (chunked: no Content-Length, sent in 64 KB pieces); the status (the
    JSON reply appended to ``replies``)."""
    headers = {"Content-Type": "application/json"}
    data = body
    if chunked:
        data = (body[i : i + (64 << 10)] for i in range(0, len(body), 64 << 10))  # urllib sends an iterable chunked
        headers["Transfer-Encoding"] = "chunked"
    req = urllib.request.Request(base_url + "/chat/completions", data=data, headers=headers, method="POST")
    try:
        with urllib.request.urlopen(req, timeout=timeout_s) as r:
            reply = r.read()
            if replies is not None:
                replies.append(json.loads(reply))
            return r.status
    except urllib.error.HTTPError as e:
        if replies is not None:  # the error's message (e.g. why a body was refused)
            replies.append({"status": e.code, "body": e.read()[:400].decode(errors="replace")})
        return e.code
    except (urllib.error.URLError, ConnectionError, TimeoutError):
        return -1  # the server answered 413 and closed the connection while this client was still sending


def long_text(long_words: int) -> str:
    return " ".join(_WORDS[(k * 7 + k // 31) % len(_WORDS)] for k in range(long_words))  # one token a word


def hostile_body(kind: str, model: str, long_words: int, salt: str | None = None) -> tuple[bytes, bool]:
    """One hostile request of ``kind`` (issue 54's list): (raw body, send chunked). ``reused_long_prompt``: the long
    text after a preamble of its own, in namespace ``salt``, where the text is stored already (relay reuses it moved
    to a new position: its band has span tokens)."""
    msg = [{"role": "user", "content": "What is 2+2?"}]
    if kind == "tiny_temperature":
        return json.dumps({"model": model, "messages": msg, "max_tokens": 24, "temperature": 1e-37}).encode(), False
    if kind == "chunked_huge_body":
        return json.dumps({"model": model, "messages": [{"role": "user", "content": "x" * (30 << 20)}]}).encode(), True
    if kind == "eight_mb_body":  # just under the server's 8 MiB limit: read, tokenized, refused for its length
        head = json.dumps({"model": model, "messages": [{"role": "user", "content": ""}]}).encode()
        return head[:-4] + b"y " * (((8 << 20) - len(head) - 16) // 2) + head[-4:], False
    if kind == "long_prompt":
        return json.dumps({"model": model, "messages": [{"role": "user", "content": long_text(long_words)}],
                           "max_tokens": 4, "cache_salt": uuid.uuid4().hex}).encode(), False  # nothing reused
    if kind == "reused_long_prompt":
        text = f"Note {uuid.uuid4().hex[:6]}. " + long_text(long_words)
        return json.dumps({"model": model, "messages": [{"role": "user", "content": text}], "max_tokens": 4,
                           "cache_salt": salt}).encode(), False
    if kind == "lone_surrogate":
        return b'{"model": "%s", "prompt": "\\udfff", "max_tokens": 2}' % model.encode(), False
    return json.dumps({"model": model, "messages": msg, "max_tokens": True, "stream": "yes"}).encode(), False


class Hostile(threading.Thread):
    """Sends hostile requests of ``kinds`` in turn until the deadline; counts statuses (5xx is a failure)."""

    def __init__(self, base_url: str, model: str, kinds: tuple[str, ...], deadline: float, long_words: int,
                 salt: str | None = None) -> None:
        super().__init__(daemon=True)
        self.base_url, self.model, self.kinds, self.deadline, self.long_words = (base_url, model, kinds, deadline,
                                                                                  long_words)
        self.salt = salt
        self.statuses: dict[str, list[int]] = {k: [] for k in kinds}
        self.replies: list[dict] = []  # 200 replies (their kvrelay extension: TTFT, prefill chunks)
        self.errors: list[dict] = []  # error replies: status and the start of the body
        self.seconds: dict[str, list[float]] = {k: [] for k in kinds}  # each request's time to its answer

    def run(self) -> None:
        i = 0
        while time.perf_counter() < self.deadline:
            kind = self.kinds[i % len(self.kinds)]
            i += 1
            body, chunked = hostile_body(kind, self.model, self.long_words, self.salt)
            if kind == "lone_surrogate":
                url = self.base_url
                req = urllib.request.Request(url + "/completions", data=body,
                                             headers={"Content-Type": "application/json"}, method="POST")
                try:
                    with urllib.request.urlopen(req, timeout=300) as r:
                        status = r.status
                except urllib.error.HTTPError as e:
                    status = e.code
            else:
                start_s, replies = time.perf_counter(), []
                status = _post_raw(self.base_url, body, chunked, replies=replies)
                self.seconds[kind].append(time.perf_counter() - start_s)
                (self.replies if status == 200 else self.errors).extend(replies)
            self.statuses[kind].append(status)


_NUM_WARMUP_PROBES = 2  # probes after the seed request, not counted as idle
_MIN_IDLE_PROBES = 5  # the idle baseline is their median: one probe is one sample of a noisy machine


def probe_ttft(base_url: str, model: str, seconds: float, words: int = 8,
               second_ms: list[float] | None = None, min_probes: int = 1) -> list[float]:
    """A short streamed request after another (each in a fresh namespace) for ``seconds`` and at least
    ``min_probes`` times: client TTFTs (ms). With
    ``second_ms``, each one's time to its second content chunk is appended there (a stall right after the first
    token, e.g. another request's prefill run whole, hides from TTFT but not from it)."""
    client = OpenAI(base_url=base_url, api_key="none", timeout=600, max_retries=0)
    out: list[float] = []
    deadline = time.perf_counter() + seconds
    while len(out) < min_probes or time.perf_counter() < deadline:
        t0 = time.perf_counter()
        stream = client.chat.completions.create(
            model=model, messages=[{"role": "user", "content": " ".join(["ping"] * words)}], max_tokens=4,
            temperature=0, stream=True, extra_body={"cache_salt": uuid.uuid4().hex})
        arrivals = [time.perf_counter() for chunk in stream if chunk.choices and chunk.choices[0].delta.content]
        end = time.perf_counter()
        out.append(((arrivals[0] if arrivals else end) - t0) * 1e3)
        if second_ms is not None:
            second_ms.append(((arrivals[1] if len(arrivals) > 1 else end) - t0) * 1e3)
    return out


_NUM_CHUNK_PROBES = 3  # prompts of one chunk each, prefilled alone: the chunk's time is their median


def one_chunk_ms(base_url: str, model: str, chunk_tokens: int) -> tuple[float, list[int]]:
    """The server's own prefill time (its ``ttft_ms``) of a fresh prompt of ``chunk_tokens`` tokens, i.e. of one
    full prefill chunk at the prompt's start, alone on the server: the median over a few, and the prompt sizes sent
    (the template's tokens are measured by a first call and taken off the words)."""
    num_words, times_ms, sizes = chunk_tokens, [], []
    for k in range(_NUM_CHUNK_PROBES + 1):
        body = json.dumps({"model": model, "messages": [{"role": "user", "content": long_text(num_words)}],
                           "max_tokens": 1, "temperature": 0, "cache_salt": uuid.uuid4().hex}).encode()
        replies: list[dict] = []
        if _post_raw(base_url, body, replies=replies) != 200:
            raise RuntimeError(f"a one-chunk prompt was refused: {replies[-1:]}")
        num_tokens = replies[0]["usage"]["prompt_tokens"]
        wait_for_shadows(base_url)  # a sampled call's shadow reference runs after it: not beside the next one
        if k == 0:  # sizing call: words are about a token each, the chat template adds the rest
            num_words -= num_tokens - chunk_tokens
            if num_words < 1:
                raise ValueError(f"--chunk-tokens {chunk_tokens} is below the chat template's own tokens")
            continue
        sizes.append(num_tokens)
        times_ms.append(replies[0]["kvrelay"]["ttft_ms"])  # the engine's prefill time, no HTTP or template
    return statistics.median(times_ms), sizes


def stall_phase(base_url: str, model: str, seconds: float, long_words: int, chunk_tokens: int) -> dict:
    """Issue 54's target: a short request's TTFT p99 while one client sends an 8K-token prompt and another an 8 MB
    body, against 3 x its idle TTFT + one prefill chunk (a chunk's time: the server's prefill time of a fresh prompt
    of ``chunk_tokens`` tokens, measured alone; beside it, the long prompt's prefill wall time over its number of
    pieces, which counts its short last pieces and the relay band's lighter ones); its second token's time beside
    it. The long prompt reuses a
    stored copy of its text (sent once first, untimed) at a new position, as an agent's prompt quoting an earlier
    one does: under the default server (guard on: relay) its prefill runs relay's band with span tokens. Probes run
    until the long prompts are done."""
    load_start = os.getloadavg()
    salt = uuid.uuid4().hex
    seed_body = json.dumps({"model": model, "messages": [{"role": "user", "content": long_text(long_words)}],
                            "max_tokens": 1, "cache_salt": salt}).encode()
    seed_status = _post_raw(base_url, seed_body)  # stores the text the timed long prompts reuse (answered once
    # its span is published)
    seed_shadow_wait_s = wait_for_shadows(base_url)  # its shadow reference (an 8K full prefill) is no idle server
    warmup = probe_ttft(base_url, model, 0.0, min_probes=_NUM_WARMUP_PROBES)  # lazy imports, allocations, the
    # seed's freed 8K-token buffers: the first probes after it are not what an idle server answers in
    chunk_ms, chunk_prompt_tokens = one_chunk_ms(base_url, model, chunk_tokens)
    idle_second: list[float] = []
    idle = probe_ttft(base_url, model, seconds / 3, second_ms=idle_second, min_probes=_MIN_IDLE_PROBES)
    deadline = time.perf_counter() + seconds
    long_client = Hostile(base_url, model, ("reused_long_prompt",), deadline, long_words, salt)
    body_client = Hostile(base_url, model, ("eight_mb_body",), deadline, long_words)
    long_client.start()
    body_client.start()
    loaded: list[float] = []
    loaded_second: list[float] = []
    load_1min = []  # sampled between probes: the machine is shared
    while long_client.is_alive():  # short requests one after another for as long as a long prompt is in flight
        loaded += probe_ttft(base_url, model, 0.0, second_ms=loaded_second)
        load_1min.append(os.getloadavg()[0])
    body_client.join()
    exts = [r["kvrelay"] for r in long_client.replies]
    piece_ms = statistics.mean(e["ttft_ms"] / e["num_prefill_chunks"] for e in exts) if exts else float("nan")
    bound = 3 * percentile(idle, 0.5) + chunk_ms
    row = {"idle_ttft_ms_p50": percentile(idle, 0.5), "idle_ttft_ms_p99": percentile(idle, 0.99),
           "idle_ttft_ms_all": idle, "warmup_ttft_ms_all": warmup, "seed_shadow_wait_s": seed_shadow_wait_s,
           "idle_second_token_ms_p50": percentile(idle_second, 0.5), "idle_second_token_ms_all": idle_second,
           "chunk_prefill_ms": chunk_ms, "chunk_prompt_tokens": chunk_prompt_tokens, "chunk_tokens": chunk_tokens,
           "long_prompt_piece_ms_mean": piece_ms, "seed_status": seed_status,
           "bound_with_piece_mean_ms": 3 * percentile(idle, 0.5) + piece_ms,
           "long_prompt_tokens": [r["usage"]["prompt_tokens"] for r in long_client.replies],
           "long_prompt_methods": [e["method"] for e in exts],
           "long_prompt_reused_tokens": [e["num_reused_tokens"] for e in exts],
           "long_prompt_ttft_ms": [e["ttft_ms"] for e in exts],
           "long_prompt_chunks": [e["num_prefill_chunks"] for e in exts],
           "loaded_ttft_ms_p50": percentile(loaded, 0.5), "loaded_ttft_ms_max": max(loaded),
           "loaded_ttft_ms_p99": percentile(loaded, 0.99), "num_probes": len(loaded),
           "loaded_second_token_ms_p50": percentile(loaded_second, 0.5),
           "loaded_second_token_ms_p99": percentile(loaded_second, 0.99),
           "loaded_second_token_ms_max": max(loaded_second),
           "loaded_ttft_ms_all": loaded, "loaded_second_token_ms_all": loaded_second,
           "bound_ms": bound, "within_bound": percentile(loaded, 0.99) <= bound,
           "second_token_within_bound": percentile(loaded_second, 0.99) <= bound,
           "long_prompt_statuses": long_client.statuses["reused_long_prompt"],
           "eight_mb_statuses": body_client.statuses["eight_mb_body"],
           "eight_mb_seconds": body_client.seconds["eight_mb_body"], "eight_mb_errors": body_client.errors[:2],
           "load_average_1min_during": load_1min,
           "load_average_start_end": [load_start, os.getloadavg()]}
    print(json.dumps(row), flush=True)
    return row


def hostile_phase(base_url: str, model: str, questions: list[str], clients: int, seconds: float, pid: int | None,
                  long_words: int) -> dict:
    """``clients`` normal streaming clients with a thread sending every hostile kind in turn among them."""
    hostile = Hostile(base_url, model, HOSTILE_KINDS, time.perf_counter() + seconds, long_words)
    hostile.start()
    row = phase(base_url, model, questions, clients, seconds, pid)
    hostile.join()
    row["hostile_statuses"] = hostile.statuses
    row["hostile_5xx"] = sum(s >= 500 for v in hostile.statuses.values() for s in v)
    print(json.dumps({"hostile_statuses": hostile.statuses}), flush=True)
    return row


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--base-url", default="http://127.0.0.1:8000/v1")
    parser.add_argument("--clients", default="1,8")
    parser.add_argument("--seconds", default="60,120", help="duration of each phase (one per --clients entry)")
    parser.add_argument("--server-pid", type=int, default=None)
    parser.add_argument("--data", default=None)
    parser.add_argument("--json", default=None)
    parser.add_argument("--hostile", action="store_true",
                        help="issue 54's runs: the stall phase (a short request beside an 8K-token prompt and an 8 MB "
                             "body), then each --clients phase without and with hostile requests among the clients")
    parser.add_argument("--long-words", type=int, default=8000, help="words of the long prompt (about one token each)")
    parser.add_argument("--chunk-tokens", type=int, default=512, help="the server's --prefill-chunk-tokens")
    parser.add_argument("--stall-seconds", type=float, default=60,
                        help="with --hostile: how long long prompts and 8 MB bodies are sent (0: no stall phase)")
    parser.add_argument("--section", default=None,
                        help="write this run under this key of --json, keeping what the file holds (runs on two "
                             "servers, e.g. two models, in one file)")
    args = parser.parse_args()
    model = OpenAI(base_url=args.base_url, api_key="none").models.list().data[0].id
    questions = [p.inputs["question"] for p in gsm8k_chain3().problems(args.data, 40)]
    extra = {}
    if args.hostile and args.stall_seconds > 0:
        extra["stall"] = stall_phase(args.base_url, model, args.stall_seconds, args.long_words, args.chunk_tokens)
    rows = []
    for c, s in zip(args.clients.split(","), args.seconds.split(","), strict=True) if args.clients else ():
        rows.append(phase(args.base_url, model, questions, int(c), float(s), args.server_pid))
        if args.hostile:
            rows.append({**hostile_phase(args.base_url, model, questions, int(c), float(s), args.server_pid,
                                         args.long_words), "hostile": True})
    if args.json:
        env = {"machine": platform.machine(), "commit": _commit()}
        result = {"env": env, "model": model, "command": " ".join(sys.argv), "phases": rows, **extra}
        if args.section:
            path = Path(args.json)
            result = {**(json.loads(path.read_text()) if path.exists() else {}), args.section: result}
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
