"""The development runs of the KVCOMM unseen-subject study: a bench run that also records every kvcomm pool's
anchor lengths after the warm-up and after the run (where the length rule and the gate's pool sizes come from).

Usage: python research/kvcomm_unseen_probe.py MODEL MEASURED_DIR WARM_DIR LIMIT OUT.json "SPEC;SPEC;..."
(MEASURED_DIR / WARM_DIR: folders of MMLU *_test.csv files, as research/kvcomm_unseen.sh builds them.)
"""

from __future__ import annotations

import json
import sys

from kvrelay.eval.harness import Bench, BenchConfig


def anchor_lengths(bench: Bench) -> dict[str, dict[str, list[int]]]:
    """Per kvcomm method and pool, its anchors' lengths in tokens, sorted."""
    return {m: {key: sorted(a.num_tokens for a in pool.anchors) for key, pool in meth.pools.items()}
            for m, meth in bench.methods.items() if hasattr(meth, "pools")}


def main(model: str, measured: str, warm: str, limit: int, out: str, specs: str) -> None:
    cfg = BenchConfig(workload="mmlu-fc3", methods=tuple(specs.split(";")), limit=limit, model=model, data=measured,
                      warm_problems=30, warm_data=warm, repeats=1)
    bench = Bench(cfg)
    after_warm: dict = {}
    warm_up = bench._warm_up

    def warm_then_record(progress: bool) -> list[str]:
        ids = warm_up(progress)
        after_warm.update(anchor_lengths(bench))
        return ids

    bench._warm_up = warm_then_record
    data = bench.run(progress=False)
    data["pools_after_warm"], data["pools_after_run"] = after_warm, anchor_lengths(bench)
    with open(out, "w", encoding="utf-8") as f:
        json.dump(data, f, default=str)
    print(json.dumps({"pools_after_warm": after_warm}))


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4]), sys.argv[5], sys.argv[6])
