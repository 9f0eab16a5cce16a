"""``kvrelay serve`` on a GPU: a 3-agent chain reuses over HTTP, and batched decode under concurrent clients.

The server runs in this process (uvicorn in a thread, the app ``kvrelay serve`` builds) so that a random
preset can be given the default model's tokenizer from a folder (``--tokenizer``), as ``gpu_check.py`` does;
clients are plain ``httpx`` threads. Random weights: timing and reuse only, their text is noise.

1. chain: solver -> critic (quotes the solver's answer) -> finalizer (quotes both), in one namespace, with
   the server's default method and with ``relay`` (layers given: random weights have no profile); reports
   each call's cached tokens, reuse and server TTFT.
2. load: for each ``--clients`` count, that many threads send chat requests (``--max-tokens`` each, greedy,
   each in its own namespace) for ``--seconds``; reports requests, completion tokens/s and the server's
   TTFT and decode-batch size from /metrics.

Usage: python research/gpu_serve_check.py --json OUT [--device cuda] [--model random:llama3-8b] [--tokenizer DIR]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import threading
import time
import uuid
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))

from gpu_check import prepare  # noqa: E402

from kvrelay.eval.harness import environment  # noqa: E402

RELAY = "relay[band=2:3:31,keep_share=0.2,span_openings=4]"
QUESTION = ("Natalia sold clips to 48 of her friends in April, and then she sold half as many clips in May. "
            "How many clips did Natalia sell altogether in April and May?")


def start_server(model: str, device: str, port: int, max_running: int, relay: str):
    import uvicorn

    from kvrelay.server.cli import add_serve_parser, build_app

    parser = argparse.ArgumentParser()
    add_serve_parser(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["serve", "--model", model, "--device", device, "--port", str(port),
                              "--max-running", str(max_running), "--methods", relay])
    app = build_app(args)
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        try:
            if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                return server, thread, url
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    raise RuntimeError("the server did not come up in 120 s")


def chat(url: str, model: str, messages: list[dict], namespace: str, max_tokens: int, method: str | None = None
         ) -> dict:
    body = {"model": model, "messages": messages, "max_tokens": max_tokens, "temperature": 0,
            "cache_salt": namespace, "kvrelay": {"method": method} if method else {}}
    r = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=300)
    r.raise_for_status()
    return r.json()


def chain(url: str, model: str, method: str | None) -> list[dict]:
    ns = uuid.uuid4().hex
    rows = []
    solver = chat(url, model, [{"role": "system", "content": "You solve math problems."},
                               {"role": "user", "content": QUESTION}], ns, 128, method)
    answer = solver["choices"][0]["message"]["content"]
    critic = chat(url, model, [{"role": "system", "content": "You check solutions."},
                               {"role": "user", "content": f"Problem:\n{QUESTION}\n\nSolution:\n{answer}"}],
                  ns, 96, method)
    review = critic["choices"][0]["message"]["content"]
    final = chat(url, model, [{"role": "system", "content": "You give the final answer."},
                              {"role": "user", "content": f"Problem:\n{QUESTION}\n\nSolution:\n{answer}\n\n"
                                                          f"Review:\n{review}"}], ns, 32, method)
    for agent, r in (("solver", solver), ("critic", critic), ("finalizer", final)):
        ext = r["kvrelay"]
        rows.append({"agent": agent, "method": ext["method"], "prompt_tokens": r["usage"]["prompt_tokens"],
                     "cached_tokens": r["usage"]["prompt_tokens_details"]["cached_tokens"],
                     "reuse_rate": ext["reuse_rate"], "ttft_ms": ext["ttft_ms"], "fallback": ext["fallback"]})
        print(f"chain {ext['method'][:24]:24s} {agent:9s} prompt {rows[-1]['prompt_tokens']:5d} cached "
              f"{rows[-1]['cached_tokens']:5d} reuse {ext['reuse_rate']:.3f} TTFT {ext['ttft_ms']:.1f} ms", flush=True)
    return rows


def _metric(url: str, name: str) -> float:
    for line in httpx.get(f"{url}/metrics", timeout=10).text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    return float("nan")


def load(url: str, model: str, clients: int, seconds: float, max_tokens: int) -> dict:
    stop = time.monotonic() + seconds
    done: list[dict] = []
    failed = [0]
    lock = threading.Lock()

    def client(k: int) -> None:
        i = 0
        while time.monotonic() < stop:
            q = f"Client {k}, question {i}: {QUESTION}"
            try:
                r = chat(url, model, [{"role": "user", "content": q}], uuid.uuid4().hex, max_tokens)
                with lock:
                    done.append({"tokens": r["usage"]["completion_tokens"], "ttft_ms": r["kvrelay"]["ttft_ms"],
                                 "queue_ms": r["kvrelay"]["queue_ms"]})
            except httpx.HTTPError:
                with lock:
                    failed[0] += 1
            i += 1

    batch_sum = _metric(url, "kvrelay_decode_batch_size_sum")
    batch_count = _metric(url, "kvrelay_decode_batch_size_count")
    t0 = time.monotonic()
    threads = [threading.Thread(target=client, args=(k,)) for k in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall_s = time.monotonic() - t0
    batch_sum = _metric(url, "kvrelay_decode_batch_size_sum") - batch_sum
    batch_count = _metric(url, "kvrelay_decode_batch_size_count") - batch_count
    row = {"clients": clients, "seconds": wall_s, "requests": len(done), "failed": failed[0],
           "completion_tokens_per_s": sum(d["tokens"] for d in done) / wall_s,
           "engine_ttft_ms_p50": statistics.median(d["ttft_ms"] for d in done) if done else None,
           "queue_ms_p50": statistics.median(d["queue_ms"] for d in done) if done else None,
           "decode_batch_mean": batch_sum / batch_count if batch_count else None}
    print(f"load {clients:3d} clients: {row['requests']} requests, {row['failed']} failed, "
          f"{row['completion_tokens_per_s']:.1f} tok/s, mean decode batch {row['decode_batch_mean']}", flush=True)
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--model", default="random:llama3-8b")
    ap.add_argument("--json", required=True)
    ap.add_argument("--clients", default="1,8")
    ap.add_argument("--seconds", type=float, default=30.0)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--port", type=int, default=8061)
    ap.add_argument("--relay", default=RELAY, help="the relay spec of the chain (layers within the model's)")
    ap.add_argument("--tokenizer", default=None, help="folder with the default model's converted tokenizer")
    args = ap.parse_args()
    prepare("gpu_serve_check", args.device, args.json, args.tokenizer)
    counts = [int(c) for c in args.clients.split(",")]
    t0 = time.perf_counter()
    server, thread, url = start_server(args.model, args.device, args.port, max(counts), args.relay)
    result: dict = {"env": environment(args.device), "model": args.model, "start_s": time.perf_counter() - t0}
    try:
        result["chain"] = {"default": chain(url, args.model, None), "relay": chain(url, args.model, args.relay)}
        result["load"] = [load(url, args.model, c, args.seconds, args.max_tokens) for c in counts]
        one = result["load"][0]["completion_tokens_per_s"]
        for row in result["load"]:
            row["tokens_per_s_vs_first"] = row["completion_tokens_per_s"] / one if one else None
    finally:
        server.should_exit = True
        thread.join(timeout=30)
        Path(args.json).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
