"""A fresh process loading a model (conversion cached), with weights packed for oneDNN and without
(``KVRELAY_PACKED_WEIGHTS=0``), alternating: load_model's wall time and the process's resident memory after it.

Usage: python benchmarks/load_memory.py [--model smollm2-135m] [--runs 3] [--json OUT]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

CODE = """
import json, time
t0 = time.perf_counter()
from kvrelay.weights.loader import load_model
lm = load_model({model!r})
load_s = time.perf_counter() - t0
rss_kb = int(next(line for line in open("/proc/self/status") if line.startswith("VmRSS")).split()[1])
print(json.dumps({{"load_s": load_s, "rss_mb": rss_kb / 1024, "matmuls": lm.matmuls}}))
"""


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    runs: dict[str, list[dict]] = {"packed": [], "f_linear": []}
    for _ in range(args.runs):
        for name, flag in (("packed", "1"), ("f_linear", "0")):
            env = {**os.environ, "KVRELAY_PACKED_WEIGHTS": flag}
            out = subprocess.run([sys.executable, "-c", CODE.format(model=args.model)], env=env, check=True,
                                 capture_output=True, text=True).stdout
            runs[name].append(json.loads(out.strip().splitlines()[-1]))
    summary = {name: {"load_s_median": statistics.median(r["load_s"] for r in rs),
                      "rss_mb_median": statistics.median(r["rss_mb"] for r in rs), "matmuls": rs[0]["matmuls"]}
               for name, rs in runs.items()}
    print(json.dumps(summary, indent=1))
    if args.json:
        Path(args.json).write_text(json.dumps({"model": args.model, "summary": summary, "runs": runs}, indent=1) + "\n")


if __name__ == "__main__":
    main()
