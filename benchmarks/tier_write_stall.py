"""What a shared tier's writes cost the streams beside them: ``kvrelay serve``'s app on a real Redis, writes on the
``TierWriter``'s thread (the server's default) against writes inline on the engine thread (the writer stopped).

One client streams answers (short prompt, ``--stream-tokens`` tokens each, one after another); another sends
documents of about ``--doc-tokens`` tokens, each new (``max_tokens`` 1), one after another: each finished document
publishes a span of that size, which the tier must take. Per mode: the engine thread's time in each publish (p50,
max; the streams' answers publish too), the streaming client's gaps between tokens (p50, p99, max) and the documents'
time to answer, in one run on one model. Both modes run in this process, alternating
for ``--rounds`` rounds, each on a fresh Redis server and a fresh app (uvicorn on a free loopback port).

    python benchmarks/tier_write_stall.py --model smollm2-135m --docs 8
"""

from __future__ import annotations

import argparse
import json
import os
import random
import socket
import statistics
import sys
import threading
import time

import httpx
import uvicorn

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.tier_fetch import local_redis  # noqa: E402
from kvrelay.engine import Engine  # noqa: E402
from kvrelay.server.app import ServerSettings, create_app  # noqa: E402
from kvrelay.server.catalog import SpanCatalog  # noqa: E402
from kvrelay.tier.tiered import open_store  # noqa: E402
from kvrelay.weights.loader import load_model  # noqa: E402

WORDS = "harbour crane pallet invoice shipment container vessel berth customs freight quay manifest tariff dock".split()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def document(index: int, num_words: int) -> str:
    rng = random.Random(index)
    return " ".join(rng.choice(WORDS) for _ in range(num_words))


def stream_gaps(url: str, model: str, num_tokens: int, stop: threading.Event, gaps_s: list[float]) -> None:
    """Stream answers until ``stop``; every gap between two content chunks into ``gaps_s``."""
    body = {"model": model, "max_tokens": num_tokens, "temperature": 0, "stream": True,
            "messages": [{"role": "user", "content": "Count from one to one hundred."}]}
    with httpx.Client(timeout=120) as client:
        while not stop.is_set():
            last = None
            with client.stream("POST", url, json=body) as response:
                for line in response.iter_lines():
                    if line.startswith("data: {") and json.loads(line[6:])["choices"][0]["delta"].get("content"):
                        now = time.perf_counter()
                        if last is not None:
                            gaps_s.append(now - last)
                        last = now


def one_mode(lm, redis_url: str, inline: bool, num_docs: int, doc_words: int, stream_tokens: int) -> dict:
    store = open_store(redis_url, 2 << 30, fingerprint=lm.fingerprint)
    catalog = SpanCatalog(store, lm.fingerprint, block_len=store.block_len, decode=lm.tokenizer.decode)
    publish_s: list[float] = []  # the engine thread's time in each publish (memory, index and, inline, the tier)
    put = catalog.put

    def timed_put(*args, **kwargs):
        start = time.perf_counter()
        try:
            return put(*args, **kwargs)
        finally:
            publish_s.append(time.perf_counter() - start)

    catalog.put = timed_put
    app = create_app(Engine(lm, store, methods=("full",)), catalog, ServerSettings(method="full", quality=None))
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    while not server.started:
        time.sleep(0.05)
    if inline:
        store.writer.stop()  # puts write through on the engine thread again
    url = f"http://127.0.0.1:{port}/v1/chat/completions"
    stop, gaps_s, doc_s, num_prompt_tokens = threading.Event(), [], [], []
    streamer = threading.Thread(target=stream_gaps, args=(url, lm.name, stream_tokens, stop, gaps_s))
    streamer.start()
    with httpx.Client(timeout=300) as client:
        for i in range(num_docs):
            start = time.perf_counter()
            r = client.post(url, json={"model": lm.name, "max_tokens": 1, "temperature": 0, "messages": [
                {"role": "user", "content": f"Document {i}:\n{document(i, doc_words)}\nSummarise it."}]})
            r.raise_for_status()
            doc_s.append(time.perf_counter() - start)
            num_prompt_tokens.append(r.json()["usage"]["prompt_tokens"])
    stop.set()
    streamer.join()
    written = store.writer.wait_written(60) if store.writer is not None else True
    server.should_exit = True
    thread.join()
    store.close()
    gaps = sorted(gaps_s)
    return {"mode": "inline" if inline else "writer", "num_gaps": len(gaps),
            "gap_p50_s": round(statistics.median(gaps), 3), "gap_p99_s": round(gaps[int(0.99 * (len(gaps) - 1))], 3),
            "gap_max_s": round(gaps[-1], 3), "publish_p50_ms": round(1000 * statistics.median(publish_s), 1),
            "publish_max_ms": round(1000 * max(publish_s), 1), "doc_p50_s": round(statistics.median(doc_s), 3),
            "doc_prompt_tokens": round(statistics.median(num_prompt_tokens)), "all_written": written}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--docs", type=int, default=8, help="documents per mode")
    p.add_argument("--doc-words", type=int, default=800, help="words per document (~1,000 tokens on SmolLM2)")
    p.add_argument("--stream-tokens", type=int, default=32)
    p.add_argument("--rounds", type=int, default=2, help="rounds of both modes, alternating")
    p.add_argument("--json", help="write the rows here too")
    args = p.parse_args()
    lm = load_model(args.model)
    rows = []
    for round_index in range(args.rounds):  # modes alternate (ABAB): the machine's load drifts between rounds
        for inline in (True, False):
            with local_redis() as url:
                rows.append({"round": round_index,
                             **one_mode(lm, url, inline, args.docs, args.doc_words, args.stream_tokens)})
            print(json.dumps(rows[-1]), flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"model": args.model, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
