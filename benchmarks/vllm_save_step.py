"""The part of a kvrelay connector save that runs inside vLLM's engine step, against the whole save run there.

A finished request's K/V in a CPU paged cache shaped as vLLM's for the model (random values), saved ``--repeat``
times each way: ``WorkerSide.save`` (copy, gather and store in the caller's thread) and ``BackgroundSaver.submit``
(the block copy only; the saver's thread does the rest, awaited outside the timer). Medians in ms::

    .venv-vllm/bin/python benchmarks/vllm_save_step.py --model-dir /tmp/smollm2-135m --store redis://127.0.0.1:6379/0
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from kvrelay.vllm.hub import ConnectorConfig, Hub
from kvrelay.vllm.paged import PagedKV
from kvrelay.vllm.saver import BackgroundSaver
from kvrelay.vllm.worker import SaveJob, WorkerSide
from kvrelay.weights.configs import config_from_hf

BLOCK = 16  # vLLM's CPU block size


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model-dir", required=True, help="a Hugging Face folder (only its config.json is read)")
    parser.add_argument("--store", default="memory")
    parser.add_argument("--num-tokens", type=int, default=1000)
    parser.add_argument("--repeat", type=int, default=5)
    args = parser.parse_args()
    cfg = config_from_hf(json.loads((Path(args.model_dir) / "config.json").read_text()))
    num_blocks = -(-args.num_tokens // BLOCK)
    layers = [torch.randn(num_blocks, cfg.num_kv_heads, BLOCK, 2 * cfg.head_dim) for _ in range(cfg.num_layers)]
    hub = Hub(ConnectorConfig(store=args.store), "bench-" + str(time.time_ns()))
    worker = WorkerSide(hub, PagedKV(layers, BLOCK, cfg.num_kv_heads, cfg.head_dim), cfg, None)
    saver = BackgroundSaver(worker)
    block_ids = list(range(num_blocks))
    in_step_ms: dict[str, list[float]] = {"synchronous save": [], "submit (in the step)": []}
    for i in range(args.repeat):
        for n, name in enumerate(in_step_ms):
            job = SaveJob(f"r{i}-{n}", f"s{i}-{n}", "", [(i * 7919 + n + j) % 49000 for j in range(args.num_tokens)],
                          block_ids)
            t0 = time.perf_counter()
            if n == 0:
                worker.save(job)
            else:
                saver.submit(job)
            in_step_ms[name].append((time.perf_counter() - t0) * 1e3)
            saver.wait_stored("", job.span_id)
    saver.close()
    print(json.dumps({"store": args.store.split("://")[0], "num_tokens": args.num_tokens,
                      **{name: {"median_ms": round(statistics.median(v), 1), "ms": [round(x, 1) for x in v]}
                         for name, v in in_step_ms.items()}}))


if __name__ == "__main__":
    main()
