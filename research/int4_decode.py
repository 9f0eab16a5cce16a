"""Decode on the GGUF's 4-bit weights (``load_model(int4_decode=True)``) against the fp32 path.

- fidelity: GSM8K test questions under the chat template; the fp32 model's greedy continuation of T tokens
  is fed to both models (teacher forcing), and each step's next-token distributions are compared:
  KL(fp32 || int4), argmax agreement; then each model decodes greedily on its own and the share of the
  T tokens that match (greedy@T) is recorded.
- rows: a decode step over B sequences (one row each) with the fp32 weights and with the 4-bit ones, at
  each B of ``--rows``, interleaved, median of R steps: how far the int4 kernel keeps paying in a batch.
  ``--busy K`` runs K busy-loop processes beside that phase (a machine shared with other work), and
  ``--threads T`` sets the torch threads.

"fp32" is the default path: its matmuls on weights packed for oneDNN where torch can (``kvrelay.model.packed``);
the session-17 JSONs predate that and compared against ``F.linear``.

Usage: python research/int4_decode.py [--model M] [--problems 20] [--tokens 64] [--rows 1,8] [--busy 0]
       [--threads 2] [--json OUT]      (--problems 0: the rows phase alone)
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

from kvrelay.cache.kv import SequenceKV
from kvrelay.data.datasets import load_gsm8k
from kvrelay.eval.harness import environment
from kvrelay.model.lm import LoadedModel
from kvrelay.pipeline.prompt import chat_prompt_ids
from kvrelay.weights.loader import load_model


def _prefilled(lm: LoadedModel, ids: list[int], extra: int) -> SequenceKV:
    cache = SequenceKV(lm.config, lm.dtype, "cpu", capacity=len(ids) + extra + 1)
    lm.model.prefill(torch.tensor(ids), cache)
    return cache


@torch.inference_mode()
def fidelity(lm32: LoadedModel, lm4: LoadedModel, prompts: list[list[int]], num_tokens: int) -> dict:
    kls, agree, greedy = [], [], []
    for ids in prompts:
        c32, c4 = _prefilled(lm32, ids, num_tokens), _prefilled(lm4, ids, num_tokens)
        token = int(lm32.model.prefill(torch.tensor(ids), SequenceKV(lm32.config, lm32.dtype, "cpu")).logits.argmax())
        ref_tokens = [token]
        for _ in range(num_tokens - 1):  # teacher forcing: both read the fp32 model's tokens
            p, q = (m.model.decode([token], [c]).log_softmax(-1)[0] for m, c in ((lm32, c32), (lm4, c4)))
            kls.append(float((p.exp() * (p - q)).sum()))
            agree.append(int(p.argmax()) == int(q.argmax()))
            token = int(p.argmax())
            ref_tokens.append(token)
        c4 = _prefilled(lm4, ids, num_tokens)
        own = [ref_tokens[0]]
        for _ in range(num_tokens - 1):
            own.append(int(lm4.model.decode([own[-1]], [c4]).argmax()))
        same = next((i for i, (a, b) in enumerate(zip(own, ref_tokens, strict=True)) if a != b), num_tokens)
        greedy.append(same / num_tokens)
    return {"prompts": len(prompts), "tokens": num_tokens, "steps": len(kls),
            "kl_mean": statistics.fmean(kls), "kl_median": statistics.median(kls), "kl_max": max(kls),
            "argmax_agreement": statistics.fmean(agree), "greedy_match_mean": statistics.fmean(greedy),
            "greedy_all_match": sum(g == 1.0 for g in greedy)}


@torch.inference_mode()
def step_ms_by_rows(lm32: LoadedModel, lm4: LoadedModel, prompt: list[int], rows: list[int],
                    repeats: int) -> list[dict]:
    out = []
    for b in rows:
        times = {"fp32": [], "int4": []}
        caches = {name: [_prefilled(m, prompt, repeats + 2) for _ in range(b)]
                  for name, m in (("fp32", lm32), ("int4", lm4))}
        for _ in range(repeats + 1):
            for name, m in (("fp32", lm32), ("int4", lm4)):
                t0 = time.perf_counter()
                m.model.decode([1] * b, caches[name])
                times[name].append((time.perf_counter() - t0) * 1e3)
        row = {"rows": b, **{f"{k}_step_ms_median": statistics.median(v[1:]) for k, v in times.items()}}
        row["int4_over_fp32"] = row["int4_step_ms_median"] / row["fp32_step_ms_median"]
        out.append(row)
        print(json.dumps(row))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--problems", type=int, default=20)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--rows", default="1,2,4,8,12,16,24,32")
    ap.add_argument("--repeats", type=int, default=9)
    ap.add_argument("--busy", type=int, default=0, help="busy-loop processes beside the rows phase")
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)

    lm32, lm4 = load_model(args.model), load_model(args.model, int4_decode=True)
    problems = load_gsm8k(split="test_dev", limit=max(args.problems, 1))
    prompts = [chat_prompt_ids(lm32.tokenizer, [{"role": "user", "content": p.question}]).ids for p in problems]
    result = {"env": environment("cpu"), "model": lm32.name, "decode_weights": lm4.decode_weights,
              "busy_processes": args.busy}
    if args.problems > 0:
        result["fidelity"] = fidelity(lm32, lm4, prompts, args.tokens)
        print(json.dumps(result["fidelity"], indent=1))
    busy = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(args.busy)]
    try:
        result["rows"] = step_ms_by_rows(lm32, lm4, prompts[0], [int(r) for r in args.rows.split(",")],
                                         args.repeats)
    finally:
        for proc in busy:
            proc.kill()
            proc.wait()
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
