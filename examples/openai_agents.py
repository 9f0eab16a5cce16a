"""Three agents (solver -> critic -> finalizer) against ``kvrelay serve``, with only the openai client (not in
``make demo``'s install: ``.venv/bin/pip install openai``, or the ``agents`` extra, which ``make test`` installs).

    kvrelay serve --model smollm2-135m          # in another terminal
    python examples/openai_agents.py [--base-url http://127.0.0.1:8000/v1] [--method epic]

Each agent is a plain chat request; later agents quote the earlier answers as text. The server
finds those answers (and the question they repeat) in its cache by itself and reuses their KV.
Per agent this prints the time to first token seen by the client, the server's own TTFT, and how
many prompt tokens came from the cache (``usage.prompt_tokens_details.cached_tokens``).
"""

from __future__ import annotations

import argparse
import time
import uuid

from openai import OpenAI

QUESTION = ("Natalia sold clips to 48 of her friends in April, and then she sold half as many clips in May. "
            "How many clips did Natalia sell altogether in April and May?")


def agent(client: OpenAI, model: str, name: str, system: str, user: str, extra: dict, max_tokens: int) -> str:
    t0 = time.perf_counter()
    client_ttft_ms = None
    text, usage, ext = "", None, {}
    stream = client.chat.completions.create(
        model=model, messages=[{"role": "system", "content": system}, {"role": "user", "content": user}],
        max_tokens=max_tokens, temperature=0, stream=True, stream_options={"include_usage": True},
        extra_headers={"x-kvrelay-agent": name}, extra_body=extra)
    for chunk in stream:
        if chunk.choices and chunk.choices[0].delta.content:
            if client_ttft_ms is None:
                client_ttft_ms = (time.perf_counter() - t0) * 1e3
            text += chunk.choices[0].delta.content
        if chunk.usage is not None:
            usage = chunk.usage
        ext = (chunk.model_extra or {}).get("kvrelay", ext)
    cached = usage.prompt_tokens_details.cached_tokens if usage and usage.prompt_tokens_details else 0
    print(f"{name:10s} prompt {usage.prompt_tokens:4d} tok  cached {cached:4d}  "
          f"client TTFT {client_ttft_ms or 0:7.1f} ms  server TTFT {ext.get('ttft_ms', 0):7.1f} ms  "
          f"method {ext.get('method')}  reuse {ext.get('reuse_rate', 0):.2f}")
    return text


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--base-url", default="http://127.0.0.1:8000/v1")
    parser.add_argument("--api-key", default="none")
    parser.add_argument("--method", default=None, help="reuse method for these requests (default: the server's)")
    parser.add_argument("--max-tokens", type=int, default=128, help="each agent's answer bound (default 128)")
    args = parser.parse_args()
    client = OpenAI(base_url=args.base_url, api_key=args.api_key)
    model = client.models.list().data[0].id
    # a fresh cache namespace per run, so the numbers do not depend on earlier runs
    extra: dict = {"cache_salt": uuid.uuid4().hex}
    if args.method:
        extra["kvrelay"] = {"method": args.method}
    solution = agent(client, model, "solver", "You are a careful math solver. Reason step by step.", QUESTION, extra,
                     args.max_tokens)
    review = agent(client, model, "critic", "You check math solutions and point out mistakes.",
                   f"Problem:\n{QUESTION}\n\nSolution:\n{solution}\n\nIs this solution correct?", extra,
                   args.max_tokens)
    final = agent(client, model, "finalizer", "You give the final answer to a math problem.",
                  f"Problem:\n{QUESTION}\n\nSolution:\n{solution}\n\nReview:\n{review}\n\n"
                  "End with 'Answer: <number>'.", extra, args.max_tokens)
    print("\nfinal answer:\n" + final)


if __name__ == "__main__":
    main()
