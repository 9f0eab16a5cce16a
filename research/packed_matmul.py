"""One matrix product per weight shape of a model, ``F.linear`` (torch's BLAS) against the weight packed for
oneDNN (``kvrelay.model.packed``), at several row counts, interleaved; and the largest difference of the
two from an fp64 product (both fp32).

Usage: OMP_NUM_THREADS=2 python research/packed_matmul.py [--model smollm2-135m] [--json OUT]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from kvrelay.eval.harness import environment
from kvrelay.model import packed
from kvrelay.weights.presets import PRESETS


def shapes(preset: str) -> dict[str, tuple[int, int]]:
    """(out, in) of each matmul weight of one layer, fused as the forward runs them, and the output head."""
    cfg = PRESETS[preset]
    q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    return {"qkv": (q + 2 * kv, cfg.hidden_size), "out": (cfg.hidden_size, q),
            "gate_up": (2 * cfg.intermediate_size, cfg.hidden_size), "down": (cfg.hidden_size, cfg.intermediate_size),
            "lm_head": (cfg.vocab_size, cfg.hidden_size)}


def median_ms(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


@torch.inference_mode()
def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m", help="a random preset's shapes")
    ap.add_argument("--rows", default="1,8,19,64,256,1024,2112")
    ap.add_argument("--repeats", type=int, default=21)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    if not packed.available():
        raise SystemExit("this torch cannot pack weights for oneDNN")
    gen = torch.Generator().manual_seed(0)
    rows_list = [int(r) for r in args.rows.split(",")]
    table = []
    for name, (n_out, n_in) in shapes(args.model).items():
        w = torch.randn(n_out, n_in, generator=gen) * n_in**-0.5
        pw = packed.packed_for(w)
        for rows in rows_list:
            x = torch.randn(rows, n_in, generator=gen)
            ref = x.double() @ w.double().T
            plain, fast = [], []
            for _ in range(3):  # interleaved rounds, each a median of repeats
                plain.append(median_ms(lambda x=x, w=w: F.linear(x, w), args.repeats))
                fast.append(median_ms(lambda x=x, pw=pw: pw(x, None), args.repeats))
            row = {"weight": name, "shape": [n_out, n_in], "rows": rows,
                   "f_linear_ms": statistics.median(plain), "packed_ms": statistics.median(fast),
                   "f_linear_err": float((F.linear(x, w).double() - ref).abs().max()),
                   "packed_err": float((pw(x, None).double() - ref).abs().max()),
                   "gflops_packed": 2 * rows * n_out * n_in / statistics.median(fast) / 1e6}
            row["ratio"] = row["packed_ms"] / row["f_linear_ms"]
            table.append(row)
            print(f"{name:8s} {n_out:6d}x{n_in:<5d} rows {rows:5d}: F.linear {row['f_linear_ms']:8.3f} ms, "
                  f"packed {row['packed_ms']:8.3f} ms ({row['ratio']:.2f}x); |err| vs fp64 "
                  f"{row['f_linear_err']:.1e} / {row['packed_err']:.1e}", flush=True)
    result = {"env": environment("cpu"), "model_shapes": args.model, "threads": torch.get_num_threads(),
              "table": table}
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
