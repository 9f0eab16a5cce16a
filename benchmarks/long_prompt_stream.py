"""A long reused prompt, streamed: the gaps between its tokens, against a running ``kvrelay serve``.

kvrelay's main workload is a long context that every call reuses. With the quality guard on, a role's first calls
(its warm-up) are all shadowed: a ``full`` prefill of the whole prompt runs beside the live stream, and its pieces
between decode steps are what every streamed token waits for; TTFT does not show it. This sends one role's calls
one after another, each as soon as the last answer is back (an agent loop): a document of ``--words`` words drawn
from a fixed vocabulary by a fixed seed (about 1,940 tokens for 1,500 words on smollm2-135m), system "Summarise
documents.", user "Document:\\n<doc>\\n\\n<question>", ``max_tokens`` 8, temperature 0, streamed. From the second call
on, all but the question's tokens are cached. Per call: cached and prompt tokens, the first token's time, each gap
between content chunks, the request's end (seconds from sending); the rung the guard served. Run it against a
server with its defaults and one with ``--quality-target off``, back to back on the same machine:

    kvrelay serve --port 8000 --api-keys keys.txt          # keys.txt holds the --key line
    python benchmarks/long_prompt_stream.py --port 8000 --calls 7
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time

import httpx

WORDS = ("harbour crane pallet invoice shipment container vessel berth customs freight quay manifest tariff dock "
         "lading").split()


def document(num_words: int, seed: int = 7) -> str:
    rng = random.Random(seed)
    return " ".join(rng.choice(WORDS) for _ in range(num_words))


def one_call(client: httpx.Client, url: str, model: str, doc: str, question: str, max_tokens: int) -> dict:
    body = {"model": model, "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True},
            "messages": [{"role": "system", "content": "Summarise documents."},
                         {"role": "user", "content": f"Document:\n{doc}\n\n{question}"}]}
    start_s, token_s, usage, extra = time.perf_counter(), [], None, {}
    with client.stream("POST", url, json=body) as response:
        response.raise_for_status()
        for line in response.iter_lines():
            if not line.startswith("data: {"):
                continue
            chunk = json.loads(line[len("data: "):])
            if chunk.get("choices") and chunk["choices"][0]["delta"].get("content"):
                token_s.append(time.perf_counter() - start_s)
            if chunk.get("usage"):
                usage, extra = chunk["usage"], chunk.get("kvrelay", {})
    return {"question": question, "prompt_tokens": usage["prompt_tokens"],
            "cached_tokens": usage["prompt_tokens_details"]["cached_tokens"],
            "first_s": round(token_s[0], 3), "end_s": round(time.perf_counter() - start_s, 3),
            "gaps_s": [round(b - a, 3) for a, b in zip(token_s, token_s[1:], strict=False)],
            "quality": extra.get("quality")}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--key", default="tenant-one-key", help="the bearer token sent")
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--words", type=int, default=1500, help="the document's words")
    p.add_argument("--calls", type=int, default=7, help="calls of the one role, one after another")
    p.add_argument("--max-tokens", type=int, default=8)
    p.add_argument("--json", default=None, help="write the calls here")
    args = p.parse_args()
    doc = document(args.words)
    url = f"http://127.0.0.1:{args.port}/v1/chat/completions"
    calls = []
    with httpx.Client(headers={"Authorization": f"Bearer {args.key}"}, timeout=300) as client:
        for k in range(args.calls):
            calls.append(one_call(client, url, args.model, doc, f"q{k + 1}", args.max_tokens))
            print(json.dumps(calls[-1]), flush=True)
    cached = calls[1:]  # the first call prefills the document; the rest reuse it
    if cached:
        gaps = [g for c in cached for g in c["gaps_s"]]
        print(f"calls 2-{len(calls)}: first token p50 {statistics.median(c['first_s'] for c in cached):.2f} s; "
              f"gap p50 {statistics.median(gaps):.2f} s, max {max(gaps):.2f} s; "
              f"end p50 {statistics.median(c['end_s'] for c in cached):.2f} s")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "calls": calls}, f, indent=1)


if __name__ == "__main__":
    main()
