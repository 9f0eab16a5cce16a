"""Issue 26: threads hammering one KVStore, and what the lock costs a single thread.

- For 2, 4 and 8 threads: ``--num-ops`` random operations in total (put/get/remove/pin/unpin/match/
  contains over three namespaces), a watcher thread checking the budget and the byte invariants
  meanwhile; prints budget violations, unexpected exceptions and ops/s.
- Single-threaded: the same operation sequence with the store's lock, and with the lock replaced
  by a no-op context (what the store cost before it was thread-safe).

    PYTHONPATH=. python research/tier_store_threads.py --num-ops 100000
"""

from __future__ import annotations

import argparse
import contextlib
import json
import random
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kvrelay.cache.store import KVStore  # noqa: E402
from kvrelay.errors import KvRelayError  # noqa: E402
from tests.cache.test_store_fuzz import BUDGET_BYTES, NAMESPACES, apply, hammer  # noqa: E402


def single_thread_ops(num_ops: int, seed: int) -> list[tuple]:
    rng = random.Random(seed)
    out = []
    for _ in range(num_ops):
        ns, sid = rng.choice(NAMESPACES), f"s{rng.randrange(12)}"
        kind = rng.choice(["put", "put", "get", "remove", "pin", "unpin", "match", "contains"])
        out.append((kind, ns, sid, rng.randrange(300), rng.random() < 0.1) if kind == "put" else
                   (kind, ns, [rng.randrange(4) for _ in range(6)]) if kind == "match" else (kind, ns, sid))
    return out


def time_single(ops: list[tuple], locked: bool) -> float:
    store = KVStore(BUDGET_BYTES, block_len=2)
    if not locked:
        store._lock = contextlib.nullcontext()
    t0 = time.perf_counter()
    for op in ops:
        try:
            apply(store, op)
        except KvRelayError:
            pass
    return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--num-ops", type=int, default=100_000)
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--unlocked", action="store_true",
                    help="no-op lock (as before issue 26): what the checks catch")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    results: dict = {"num_ops": args.num_ops, "threads": {}}
    for num_threads in (2, 4, 8):
        store = KVStore(BUDGET_BYTES, block_len=2)
        if args.unlocked:
            store._lock = contextlib.nullcontext()
        t0 = time.perf_counter()
        errors, violations = hammer(store, num_threads, args.num_ops // num_threads, seed=num_threads)
        elapsed_s = time.perf_counter() - t0
        if not args.unlocked:
            store.check_invariants()
        row = {"budget_violations": violations, "exceptions": len(errors), "peak_bytes": store.peak_bytes,
               "budget_bytes": BUDGET_BYTES, "ops_per_s": round(args.num_ops / elapsed_s)}
        results["threads"][num_threads] = row
        print(f"{num_threads} threads: {row}")
    if args.unlocked:
        return
    ops = single_thread_ops(args.num_ops, seed=1)
    times: dict[bool, list[float]] = {True: [], False: []}
    for _ in range(args.repeats):  # interleaved, so that a busy spell of the machine hits both
        for locked in (True, False):
            times[locked].append(time_single(ops, locked))
    locked, unlocked = min(times[True]), min(times[False])
    results["single_thread"] = {"locked_us_per_op": round(locked / len(ops) * 1e6, 3),
                                "unlocked_us_per_op": round(unlocked / len(ops) * 1e6, 3),
                                "lock_overhead_pct": round((locked / unlocked - 1) * 100, 1)}
    print(f"single thread: {results['single_thread']}")
    if args.json:
        args.json.write_text(json.dumps(results, indent=1) + "\n")


if __name__ == "__main__":
    main()
