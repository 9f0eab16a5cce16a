"""Where the forward's time goes on CPU: a decode step, a 1,024-token prefill against transformers', and the
output projection's GEMV in fp32 and bf16 (what fewer weight bytes would buy).

    OMP_NUM_THREADS=2 python benchmarks/profile_forward.py --json benchmarks/results/profile-forward-<machine>.json

- decode: ``--steps`` decode steps of ours at a 128-token context under the torch profiler, one thread (a
  step is a row of GEMVs; one thread shows their share without thread-pool noise); wall time per step
  measured outside the profiler.
- prefill: ``--prefills`` 1,024-token prefills each, ours and transformers' (same weights, SDPA), under the
  profiler at the process's thread count; self time per op class (matrix products, attention, the rest).
- gemv: the tied output projection [vocab, hidden] times one hidden state, fp32 against bf16, one thread.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_engine import _hf_twin  # noqa: E402

from kvrelay.cache.kv import SequenceKV  # noqa: E402
from kvrelay.eval.harness import environment  # noqa: E402
from kvrelay.eval.stats import timed_median_ms  # noqa: E402
from kvrelay.weights.loader import load_model  # noqa: E402

# the last: products on weights packed for oneDNN (kvrelay.model.packed)
MATMUL_OPS = ("aten::mm", "aten::addmm", "aten::bmm", "mkldnn::_linear_pointwise")
ATTENTION_PREFIX = "aten::_scaled_dot_product"


def _by_class(prof) -> dict[str, float]:
    """Self CPU ms per op class over the profiled region, and the matrix-product call count."""
    out = {"matmul_ms": 0.0, "attention_ms": 0.0, "other_ms": 0.0, "num_matmuls": 0}
    for e in prof.key_averages():
        ms = e.self_cpu_time_total / 1e3
        if e.key in MATMUL_OPS:
            out["matmul_ms"] += ms
            out["num_matmuls"] += e.count
        elif e.key.startswith(ATTENTION_PREFIX):
            out["attention_ms"] += ms
        else:
            out["other_ms"] += ms
    return out


def _median_us(fn, repeats: int = 200) -> float:
    return timed_median_ms(fn, repeats, warmup=20) * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--prefills", type=int, default=3)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    threads = torch.get_num_threads()
    lm = load_model(args.model, progress=False)
    result: dict = {"env": environment("cpu"), "model": lm.name}

    # decode, one thread
    torch.set_num_threads(1)
    ids = torch.randint(0, 20000, (128,), generator=torch.Generator().manual_seed(0))
    cache = SequenceKV(lm.config, lm.dtype, "cpu", capacity=128 + 64 + 4 * args.steps)
    lm.model.prefill(ids, cache)
    step_ms = _median_us(lambda: lm.model.decode_step(1, cache), repeats=2 * args.steps) / 1e3
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(args.steps):
            lm.model.decode_step(1, cache)
    per_step = {k: v / args.steps for k, v in _by_class(prof).items()}
    result["decode_one_thread"] = {"step_ms_median": step_ms, "profiled_per_step": per_step,
                                   "weight_bytes": sum(p.numel() * p.element_size() for p in lm.model.parameters())}
    print(f"decode step {step_ms:.1f} ms; profiled per step: {per_step}", flush=True)

    # prefill, the process's threads, ours against transformers'
    torch.set_num_threads(threads)
    hf = _hf_twin(lm)
    ids = torch.randint(0, 20000, (1024,), generator=torch.Generator().manual_seed(0))

    def ours() -> None:
        lm.model.prefill(ids, SequenceKV(lm.config, lm.dtype, "cpu", capacity=1024))

    @torch.inference_mode()
    def theirs() -> None:
        hf(ids[None], logits_to_keep=1, use_cache=True)

    result["prefill"] = {"threads": threads, "prompt_tokens": 1024, "prefills": args.prefills}
    for name, fn in (("ours", ours), ("transformers", theirs)):
        fn()
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            for _ in range(args.prefills):
                fn()
        result["prefill"][name] = classes = _by_class(prof)
        print(f"prefill {name}: {classes}", flush=True)

    # the output projection's GEMV, fp32 against bf16, one thread
    torch.set_num_threads(1)
    w = lm.model.lm_head.weight.detach()
    x = torch.randn(1, w.shape[1])
    gemv = {"shape": list(w.shape)}
    for dtype in (torch.float32, torch.bfloat16):
        wd, xd = w.to(dtype), x.to(dtype)
        gemv[str(dtype).removeprefix("torch.") + "_us"] = _median_us(lambda wd=wd, xd=xd: F.linear(xd, wd))
    result["output_projection_gemv_one_thread"] = gemv
    print(f"output projection GEMV: {gemv}", flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
