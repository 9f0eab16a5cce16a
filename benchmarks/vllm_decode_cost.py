"""What kvrelay's connector costs vLLM outside a load: decode speed with and without it, and its hooks per request.

    .venv-vllm/bin/python benchmarks/vllm_decode_cost.py --model-dir SMOLLM2_DIR [--requests 8] [--json OUT]

Each side runs in a process of its own (vLLM's engine in that process, ``VLLM_ENABLE_V1_MULTIPROCESSING=0``, fp32,
eager, one OpenMP thread, ``VLLM_CPU_NUM_OF_RESERVED_CPU=1`` as ``kvrelay.vllm.launch`` sets it for the connector):
plain vLLM, then vLLM with the connector (``epic``, memory store). Both get the same requests one after another, as a
chain sends them: random prompts (nothing to reuse, so no load runs), greedy, ``--max-tokens`` tokens each with EOS
ignored. Per request: decode milliseconds a token (vLLM's own first- and last-token timestamps; wall time, which other
processes' load moves), the engine thread's CPU milliseconds a token (scheduler, worker and model run in the
calling thread here: what the connector adds to them shows even on a loaded machine), and on the
connector's side the CPU time of each connector hook (the calling thread's ``time.thread_time``), summed per
request: the scheduler side's (matching and planning a new request, the step's metadata, indexing a finished
request) and the worker side's per step (``start_load_kv``, ``get_finished``, the report), with the save of each
finished request: its blocks copied in the step, its K/V read and stored in the saver's thread (CPU of that thread,
which shares the model's core).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from collections import defaultdict

MARK = "DECODE-COST-JSON "
SCHEDULER_HOOKS = ("get_num_new_matched_tokens", "update_state_after_alloc", "build_connector_meta",
                   "request_finished", "update_connector_output")
WORKER_HOOKS = ("start_load_kv", "wait_for_layer_load", "save_kv_layer", "wait_for_save", "get_finished",
                "build_connector_worker_meta", "get_block_ids_with_load_errors")


def _timed(obj, name: str, acc: dict) -> None:
    """Wrap ``obj.name`` so that its calls' thread CPU ms and count add up in ``acc[name]``."""
    original = getattr(obj, name)

    def wrapper(*args, **kwargs):
        c0 = time.thread_time()
        try:
            return original(*args, **kwargs)
        finally:
            entry = acc[name]
            entry[0] += (time.thread_time() - c0) * 1e3
            entry[1] += 1

    setattr(obj, name, wrapper)


def run_side(args: argparse.Namespace) -> dict:
    import torch
    from vllm import LLM, SamplingParams
    from vllm.config import KVTransferConfig

    connector = args.side == "connector"
    kv_config = KVTransferConfig(kv_connector="KVRelayConnector", kv_connector_module_path="kvrelay.vllm.connector",
                                 kv_role="kv_both", kv_connector_extra_config={"method": "epic"}) if connector else None
    llm = LLM(model=args.model_dir, dtype="float32", enforce_eager=True, enable_prefix_caching=True,
              max_model_len=2048, seed=0, kv_transfer_config=kv_config, disable_log_stats=False)
    hooks: dict[str, list[float]] = defaultdict(lambda: [0.0, 0])
    saves: list[dict] = []
    if connector:
        from vllm.distributed.kv_transfer import get_kv_transfer_group

        core = llm.llm_engine.engine_core.engine_core
        scheduler_side, worker_side = core.scheduler.connector, get_kv_transfer_group()
        for name in SCHEDULER_HOOKS:
            _timed(scheduler_side, name, hooks)
        for name in WORKER_HOOKS:
            _timed(worker_side, name, hooks)
        worker = worker_side.load_worker
        original_store, original_read = worker.store, worker.read_copy

        def timed_read(copy, job):
            c0 = time.thread_time()
            out = original_read(copy, job)
            saves.append({"req_id": job.req_id, "read_cpu_ms": (time.thread_time() - c0) * 1e3})
            return out

        def timed_store(job, k, v):
            c0 = time.thread_time()
            try:
                return original_store(job, k, v)
            finally:
                saves[-1]["store_cpu_ms"] = (time.thread_time() - c0) * 1e3

        worker.read_copy, worker.store = timed_read, timed_store
        _timed(worker, "copy_blocks", hooks)
    gen = torch.Generator().manual_seed(0)
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0, ignore_eos=True)
    llm.generate([{"prompt_token_ids": list(range(100, 140))}], params, use_tqdm=False)  # lazy set-up, unmeasured
    hooks.clear()
    saves.clear()
    requests = []
    for i in range(args.requests):
        prompt = torch.randint(100, 20000, (args.prompt_tokens,), generator=gen).tolist()
        before = {name: list(v) for name, v in hooks.items()}
        t0, c0 = time.perf_counter(), time.thread_time()
        out = llm.generate([{"prompt_token_ids": prompt, "cache_salt": f"r{i}"}], params, use_tqdm=False)[0]
        wall_ms, cpu_ms = (time.perf_counter() - t0) * 1e3, (time.thread_time() - c0) * 1e3
        m = out.metrics
        num = len(out.outputs[0].token_ids)
        decode_ms = (m.last_token_ts - m.first_token_ts) * 1e3 / max(1, num - 1) if m is not None else None
        requests.append({"wall_ms": wall_ms, "cpu_ms": cpu_ms, "completion_tokens": num,
                         "decode_ms_per_token": decode_ms,
                         "ttft_ms": (m.first_token_ts - m.scheduled_ts) * 1e3 if m is not None else None,
                         "hooks_cpu_ms": {name: v[0] - before.get(name, [0.0, 0])[0] for name, v in hooks.items()},
                         "hook_calls": {name: v[1] - before.get(name, [0.0, 0])[1] for name, v in hooks.items()}})
    if connector:
        worker_side.background_saver.close()  # the last request's save stored before the numbers are read
    return {"side": args.side, "requests": requests, "saves": saves, "threads": torch.get_num_threads(),
            "load_avg_end": os.getloadavg()}


def summary(side: dict) -> dict:
    reqs = side["requests"]
    out = {"decode_ms_per_token_median": statistics.median(r["decode_ms_per_token"] for r in reqs),
           "wall_ms_median": statistics.median(r["wall_ms"] for r in reqs),
           # the engine's thread (scheduler, worker, model: one thread here), robust to other processes' load
           "cpu_ms_per_token_median": statistics.median(r["cpu_ms"] / r["completion_tokens"] for r in reqs),
           "ttft_ms_median": statistics.median(r["ttft_ms"] for r in reqs)}
    names = sorted({n for r in reqs for n in r["hooks_cpu_ms"]})
    if names:
        out["hooks_cpu_ms_per_request_median"] = {n: statistics.median(r["hooks_cpu_ms"].get(n, 0.0) for r in reqs)
                                                  for n in names}
        out["hook_calls_per_request_median"] = {n: statistics.median(r["hook_calls"].get(n, 0) for r in reqs)
                                                for n in names}
        out["hooks_cpu_ms_per_request_total_median"] = statistics.median(sum(r["hooks_cpu_ms"].values())
                                                                         for r in reqs)
    if side["saves"]:
        out["save_read_cpu_ms_median"] = statistics.median(s["read_cpu_ms"] for s in side["saves"])
        out["save_store_cpu_ms_median"] = statistics.median(s.get("store_cpu_ms", 0.0) for s in side["saves"])
    return out


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model-dir", required=True)
    parser.add_argument("--requests", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--prompt-tokens", type=int, default=200)
    parser.add_argument("--order", default="plain,connector", help="the sides, in the order they run")
    parser.add_argument("--side", choices=("plain", "connector"), default=None, help="(internal) run one side")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    if args.side is not None:
        print(MARK + json.dumps(run_side(args)), flush=True)
        return
    env = {**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_CPU_KVCACHE_SPACE": "1",
           "VLLM_CPU_NUM_OF_RESERVED_CPU": "1", "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    sides, load_start = {}, os.getloadavg()
    for side in args.order.split(","):
        proc = subprocess.run([sys.executable, __file__, "--model-dir", args.model_dir, "--requests",
                               str(args.requests), "--max-tokens", str(args.max_tokens), "--prompt-tokens",
                               str(args.prompt_tokens), "--side", side], env=env, capture_output=True, text=True)
        lines = [line for line in proc.stdout.splitlines() if line.startswith(MARK)]
        if proc.returncode or not lines:
            sys.exit(f"{side} side failed:\n{proc.stderr[-3000:]}")
        sides[side] = json.loads(lines[-1][len(MARK):])
        sides[side]["summary"] = summary(sides[side])
        print(side, json.dumps(sides[side]["summary"], indent=1), flush=True)
    plain, conn = sides["plain"]["summary"], sides["connector"]["summary"]
    out = {"load_avg_start": load_start, "load_avg_end": os.getloadavg(), "requests": args.requests,
           "max_tokens": args.max_tokens, "prompt_tokens": args.prompt_tokens, "sides": sides,
           "decode_ratio_connector_over_plain":
               conn["decode_ms_per_token_median"] / plain["decode_ms_per_token_median"],
           "cpu_per_token_ratio_connector_over_plain":
               conn["cpu_ms_per_token_median"] / plain["cpu_ms_per_token_median"]}
    print(f"decode ms a token: connector {conn['decode_ms_per_token_median']:.2f}, plain "
          f"{plain['decode_ms_per_token_median']:.2f} (ratio {out['decode_ratio_connector_over_plain']:.3f}); "
          f"engine-thread CPU ms a token: connector {conn['cpu_ms_per_token_median']:.2f}, plain "
          f"{plain['cpu_ms_per_token_median']:.2f} (ratio {out['cpu_per_token_ratio_connector_over_plain']:.3f}); "
          f"load {load_start} -> {out['load_avg_end']}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
