"""The connector's forward against vLLM's own prefill, per token, in one process (no HTTP, no second server).

    .venv-vllm/bin/python benchmarks/vllm_forward.py --model-dir SMOLLM2_DIR [--reps 5] [--json OUT]

vLLM's engine runs in this process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``, fp32, eager, one OpenMP thread unless
``OMP_NUM_THREADS`` says otherwise: a vLLM CPU worker on the 2-core development machine gets one), and the
connector's worker code runs beside it on the same model: kvrelay's transformer bound to vLLM's modules
(``kvrelay.vllm.binding``), a span stored from an upstream prompt, a downstream
prompt that quotes it in two runs behind new tokens, the load vLLM would hand the connector (``plan_load``,
``epic``), and ``WorkerSide.load`` writing a paged KV of vLLM's CPU layout. Per repetition (medians reported):

- the load: its forward (the tokens it computes: gaps and ``epic``'s first tokens of each run) and the whole load;
- the same plan through ``Transformer.prefill`` (the scheduled prefill with its logits, as loads ran it before);
- vLLM's model forward over a prompt of the same length, once with nothing cached and once with its first
  128-token block from vLLM's own prefix cache, timed around the model's ``forward``;

and each as milliseconds per computed token. Random token ids: the cost does not depend on the text.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # the engine (and its model) in this process
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")

import torch  # noqa: E402

UPSTREAM_TOKENS, NEW_TOKENS, FRAMING_TOKENS, TAIL_TOKENS = 200, 40, 10, 30
BLOCK_SIZE = 128  # vLLM's CPU block


def downstream_prompt(upstream: list[int], gen: torch.Generator) -> list[int]:
    """New tokens, the upstream's first 120 tokens, framing, the rest of the upstream, a new tail."""
    def fresh(n: int) -> list[int]:
        return torch.randint(100, 20000, (n,), generator=gen).tolist()

    return fresh(NEW_TOKENS) + upstream[:120] + fresh(FRAMING_TOKENS) + upstream[120:] + fresh(TAIL_TOKENS)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model-dir", required=True)
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()

    from vllm import LLM, SamplingParams

    from kvrelay.cache.kv import SequenceKV
    from kvrelay.model import packed
    from kvrelay.model.schedule import StaticSchedule
    from kvrelay.vllm.binding import bind_transformer
    from kvrelay.vllm.hub import ConnectorConfig, Hub
    from kvrelay.vllm.paged import PagedKV
    from kvrelay.vllm.plan import Run, plan_load
    from kvrelay.vllm.worker import LoadJob, WorkerSide
    from kvrelay.weights.configs import config_from_hf

    llm = LLM(model=args.model_dir, dtype="float32", enforce_eager=True, enable_prefix_caching=True,
              max_model_len=2048, seed=0)
    # the model vLLM's in-process worker loaded (the connector, with no handle on it, finds it with ``find_model``)
    vllm_model = llm.llm_engine.engine_core.engine_core.model_executor.driver_worker.worker.model_runner.model
    with open(os.path.join(args.model_dir, "config.json")) as f:
        cfg = config_from_hf(json.load(f))
    model = bind_transformer(cfg, vllm_model)
    gen = torch.Generator().manual_seed(0)

    hub = Hub(ConnectorConfig(), "bench")
    upstream = torch.randint(100, 20000, (UPSTREAM_TOKENS,), generator=gen).tolist()
    up_cache = SequenceKV(cfg, torch.float32, "cpu", capacity=UPSTREAM_TOKENS + 1)
    with packed.unpacked():
        model.prefill(torch.tensor(upstream), up_cache)
    hub.catalog.put("", "up", up_cache.export(0, UPSTREAM_TOKENS, upstream, "bench"))
    prompt = downstream_prompt(upstream, gen)
    found = hub.catalog.index.find(prompt, "", 16)
    plan = plan_load(prompt, 0, [Run(m.start, m.end, m.span_id, m.src_start) for m in found],
                     hub.catalog.index.token_ids, "epic", 16)
    num_blocks = -(-len(prompt) // BLOCK_SIZE) + 1
    layers = [torch.zeros(num_blocks, cfg.num_kv_heads, BLOCK_SIZE, 2 * cfg.head_dim) for _ in range(cfg.num_layers)]
    worker = WorkerSide(hub, PagedKV(layers, BLOCK_SIZE, cfg.num_kv_heads, cfg.head_dim), cfg, model)
    block_ids = list(range(num_blocks))
    active = torch.tensor(plan.recompute)

    forward_ms, timed = [], {"load_forward": [], "load": [], "prefill_with_head": [], "vllm_fresh": [],
                             "vllm_after_block": []}
    original_forward = vllm_model.forward

    def timed_forward(*a, **k):
        t0 = time.perf_counter()
        out = original_forward(*a, **k)
        forward_ms.append((time.perf_counter() - t0) * 1e3)
        return out

    vllm_model.forward = timed_forward
    greedy = SamplingParams(max_tokens=1, temperature=0)
    for _ in range(args.reps):
        result = worker.load(LoadJob("r", "", prompt[: plan.end], plan, block_ids))
        timed["load_forward"].append(result.forward_ms)
        timed["load"].append(result.load_ms)
        cache = SequenceKV(cfg, torch.float32, "cpu", capacity=plan.end + 1)
        for piece in plan.pieces:
            cache.load_span(hub.store.get("up"), piece.dst_start, model.rope, piece.src_start,
                            piece.src_start + piece.num_tokens)
        t0 = time.perf_counter()
        with packed.unpacked():
            model.prefill(torch.tensor(prompt[: int(active[-1]) + 1]), cache, StaticSchedule(active))
        timed["prefill_with_head"].append((time.perf_counter() - t0) * 1e3)
        salt_prompt = torch.randint(20000, 40000, (1,), generator=gen).tolist() + prompt[1:]  # nothing cached
        forward_ms.clear()
        llm.generate([{"prompt_token_ids": salt_prompt}], greedy, use_tqdm=False)
        timed["vllm_fresh"].append(forward_ms[0])
        forward_ms.clear()  # the same first block, new tokens after it: that block comes from vLLM's prefix cache
        rest = torch.randint(100, 20000, (len(prompt) - BLOCK_SIZE,), generator=gen).tolist()
        after = salt_prompt[:BLOCK_SIZE] + rest
        llm.generate([{"prompt_token_ids": after}], greedy, use_tqdm=False)
        timed["vllm_after_block"].append(forward_ms[0])
    vllm_model.forward = original_forward

    num_tokens = {"load_forward": len(plan.recompute), "load": len(plan.recompute),
                  "prefill_with_head": len(plan.recompute), "vllm_fresh": len(prompt),
                  "vllm_after_block": len(prompt) - BLOCK_SIZE}
    out = {"threads": torch.get_num_threads(), "prompt_tokens": len(prompt), "claimed": plan.num_claimed,
           "computed_by_connector": len(plan.recompute), "load_avg_1_5_15": os.getloadavg(), "reps": args.reps}
    for name, values in timed.items():
        median = statistics.median(values)
        out[name] = {"ms_median": median, "tokens": num_tokens[name], "ms_per_token": median / num_tokens[name],
                     "ms": values}
        print(f"{name:18s} {num_tokens[name]:4d} tokens  median {median:7.1f} ms  "
              f"{median / num_tokens[name]:5.2f} ms/token", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
