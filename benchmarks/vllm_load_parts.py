"""One downstream load of the connector broken into its parts, in one process (no HTTP, no second server).

    .venv-vllm/bin/python benchmarks/vllm_load_parts.py --model-dir SMOLLM2_DIR [--reps 7] [--json OUT]

vLLM's engine runs in this process with the kvrelay connector (``VLLM_ENABLE_V1_MULTIPROCESSING=0``, fp32, eager,
one OpenMP thread unless ``OMP_NUM_THREADS`` says otherwise). An upstream prompt is sent once (its K/V saved as a
span); each repetition then sends a critic-like downstream prompt quoting it in two moved runs behind new tokens
(``vllm_forward.downstream_prompt``: 280 tokens, 250 claimed, 82 computed by the connector under ``epic``), with
new leading tokens every time so vLLM's own prefix cache finds nothing. Per repetition, on the connector's own
objects and a scratch paged KV of vLLM's CPU layout:

- ``plan``: the scheduler side's matching and plan (``index.find`` + ``plan_load``);
- ``fetch``: the spans out of the store; ``place``: the sequence cache built and the spans loaded into it
  (copy + key re-rotation), and ``rotate`` the re-rotation alone;
- ``forward``: the connector's forward (``WorkerSide.transformer``: vLLM's decoder layers run as vLLM runs them,
  ``kvrelay.vllm.forward``), and ``forward.linear`` its linear products alone (vLLM's modules, timed by hooks in a
  pass of its own); ``generic``: the same tokens through kvrelay's modules bound to vLLM's (``binding``), with
  ``generic.linear`` and ``generic.layers``; ``kv_max_abs_diff``: the two forwards' K/V, largest difference;
- ``write``: the claimed positions' K/V into the paged KV;
- ``load``: ``WorkerSide.load`` whole;
- ``save.copy``, ``save.read``: the downstream's own save (what the next agent's load waits for): its blocks
  copied in the step, its K/V read out of the copy in the saver's thread;

then end to end through vLLM's ``generate`` (max_tokens 1): the call with the connector (its load as logged, vLLM's
model forward over the unclaimed tail) and the same prompt under another ``cache_salt`` (nothing reused: vLLM's
own prefill). Each part: median wall ms and median CPU ms of the calling thread (``time.thread_time``), so load
from other processes shows as wall above CPU.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from collections import defaultdict
from contextlib import contextmanager

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # the engine, its model and the connector here
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from benchmarks.vllm_forward import BLOCK_SIZE, UPSTREAM_TOKENS, downstream_prompt  # noqa: E402


class Timer:
    """Wall and thread-CPU milliseconds per named part, summed within a repetition."""

    def __init__(self) -> None:
        self.rep: dict[str, list[float]] = defaultdict(lambda: [0.0, 0.0])
        self.reps: dict[str, list[tuple[float, float]]] = defaultdict(list)

    @contextmanager
    def part(self, name: str):
        w0, c0 = time.perf_counter(), time.thread_time()
        try:
            yield
        finally:
            acc = self.rep[name]
            acc[0] += (time.perf_counter() - w0) * 1e3
            acc[1] += (time.thread_time() - c0) * 1e3

    def end_rep(self) -> None:
        for name, (wall, cpu) in self.rep.items():
            self.reps[name].append((wall, cpu))
        self.rep = defaultdict(lambda: [0.0, 0.0])

    def summary(self) -> dict:
        out = {}
        for name, values in self.reps.items():
            out[name] = {"wall_ms_median": statistics.median(w for w, _ in values),
                         "cpu_ms_median": statistics.median(c for _, c in values),
                         "wall_ms": [round(w, 2) for w, _ in values], "cpu_ms": [round(c, 2) for _, c in values]}
        return out


@contextmanager
def profiled(on: bool, title: str):
    """torch's CPU profile of the block, printed (self time, top 30), where ``on``."""
    if not on:
        yield
        return
    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        yield
    print(f"--- profile: {title}", flush=True)
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=30), flush=True)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model-dir", required=True)
    parser.add_argument("--reps", type=int, default=7)
    parser.add_argument("--json", default=None)
    parser.add_argument("--profile", action="store_true", help="print torch's profile of one connector forward")
    parser.add_argument("--profile-calls", action="store_true",
                        help="print torch's profile of the last repetition's two end-to-end calls")
    args = parser.parse_args()

    from vllm import LLM, SamplingParams
    from vllm.config import KVTransferConfig
    from vllm.distributed.kv_transfer import get_kv_transfer_group

    import kvrelay.vllm.binding as binding
    from kvrelay.cache.kv import SequenceKV
    from kvrelay.model import packed
    from kvrelay.vllm.forward import VllmLayersForward
    from kvrelay.vllm.paged import PagedKV
    from kvrelay.vllm.plan import Run, plan_load
    from kvrelay.vllm.worker import LoadJob, SaveJob, WorkerSide, compute_kv

    kv_config = KVTransferConfig(kv_connector="KVRelayConnector", kv_connector_module_path="kvrelay.vllm.connector",
                                 kv_role="kv_both", kv_connector_extra_config={"method": "epic"})
    llm = LLM(model=args.model_dir, dtype="float32", enforce_eager=True, enable_prefix_caching=True,
              max_model_len=2048, seed=0, kv_transfer_config=kv_config)
    connector = get_kv_transfer_group()
    worker: WorkerSide = connector._worker
    hub, cfg, fast = worker.hub, worker.config, worker.transformer
    assert isinstance(fast, VllmLayersForward), type(fast)
    vllm_model = llm.llm_engine.engine_core.engine_core.model_executor.driver_worker.worker.model_runner.model
    model = binding.bind_transformer(cfg, vllm_model)  # kvrelay's modules on vLLM's: the generic path
    greedy = SamplingParams(max_tokens=1, temperature=0)
    gen = torch.Generator().manual_seed(0)

    upstream = torch.randint(100, 20000, (UPSTREAM_TOKENS,), generator=gen).tolist()
    llm.generate([{"prompt_token_ids": upstream}], greedy, use_tqdm=False)  # its K/V saved as a span ...
    llm.generate([{"prompt_token_ids": upstream[:4]}], greedy, use_tqdm=False)  # ... in this call's step
    connector._saver.close()  # the span stored before the first load (the saver thread restarts below)
    from kvrelay.vllm.saver import BackgroundSaver
    connector._saver = BackgroundSaver(worker)

    timer = Timer()
    forward_ms: list[float] = []
    original_forward, original_call, original_run_layer = vllm_model.forward, binding._call, model._run_layer

    def timed_forward(*a, **k):
        t0 = time.perf_counter()
        out = original_forward(*a, **k)
        forward_ms.append((time.perf_counter() - t0) * 1e3)
        return out

    def timed_call(module, x):
        with timer.part("generic.linear"):
            return original_call(module, x)

    def timed_run_layer(*a, **k):
        with timer.part("generic.layers"):
            return original_run_layer(*a, **k)

    linear_modules = [m for layer in vllm_model.model.layers
                      for m in (layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj,
                                layer.mlp.down_proj)]
    linear_t0: list[tuple[float, float]] = []

    def linear_pre(module, inputs):
        linear_t0.append((time.perf_counter(), time.thread_time()))

    def linear_post(module, inputs, output):
        w0, c0 = linear_t0.pop()
        acc = timer.rep["forward.linear"]
        acc[0] += (time.perf_counter() - w0) * 1e3
        acc[1] += (time.thread_time() - c0) * 1e3

    num_blocks = -(-(UPSTREAM_TOKENS + 100) // BLOCK_SIZE) + 1
    scratch = [torch.zeros(num_blocks, cfg.num_kv_heads, BLOCK_SIZE, 2 * cfg.head_dim)
               for _ in range(cfg.num_layers)]
    key_layout = worker.paged.key_layout
    paged = PagedKV(scratch, BLOCK_SIZE, cfg.num_kv_heads, cfg.head_dim, key_layout)
    bench_worker = WorkerSide(hub, paged, cfg, model)
    block_ids = list(range(num_blocks))
    ends: dict[str, list[float]] = defaultdict(list)
    kv_diff: list[float] = []
    shape = {}
    for _ in range(args.reps):
        prompt = downstream_prompt(upstream, gen)
        with timer.part("plan"), hub.lock:
            found = hub.catalog.index.find(prompt, "", 16, None, "oldest")  # the upstream span's runs
            runs = [Run(m.start, m.end, m.span_id, m.src_start) for m in found if hub.store.contains(m.span_id, "")]
            plan = plan_load(prompt, 0, runs,
                             hub.catalog.index.token_ids, "epic", 16)
        shape = {"prompt_tokens": len(prompt), "claimed": plan.num_claimed, "computed": len(plan.recompute),
                 "pieces": [(p.dst_start, p.num_tokens, p.exact) for p in plan.pieces]}
        with timer.part("fetch"):
            spans = [hub.store.get(p.span_id, "") for p in plan.pieces]
        with timer.part("place"):
            cache = SequenceKV(cfg, paged.dtype, "cpu", capacity=plan.end + 1)
            for piece, span in zip(plan.pieces, spans, strict=True):
                cache.load_span(span, piece.dst_start, worker.rope, piece.src_start,
                                piece.src_start + piece.num_tokens)
        out = torch.empty_like(spans[0].k[:, :, : plan.pieces[0].num_tokens])
        with timer.part("rotate"):
            for piece, span in zip(plan.pieces, spans, strict=True):
                keys = span.k[:, :, piece.src_start: piece.src_start + piece.num_tokens]
                worker.rope.shift_keys_into(keys, piece.dst_start - piece.src_start, out[:, :, : piece.num_tokens])
        active = torch.tensor(plan.recompute, dtype=torch.long)
        token_ids = torch.tensor(prompt[: int(active[-1]) + 1])

        def placed(plan=plan, spans=spans) -> SequenceKV:
            placed_cache = SequenceKV(cfg, paged.dtype, "cpu", capacity=plan.end + 1)
            for piece, span in zip(plan.pieces, spans, strict=True):
                placed_cache.load_span(span, piece.dst_start, worker.rope, piece.src_start,
                                       piece.src_start + piece.num_tokens)
            return placed_cache

        generic_cache = placed()
        with timer.part("forward"):
            fast.compute_kv(token_ids, cache, active)
        hooks = [h for m in linear_modules for h in (m.register_forward_pre_hook(linear_pre),
                                                       m.register_forward_hook(linear_post))]
        try:  # the linear products' share, in a pass of its own (the hooks cost time of their own)
            fast.compute_kv(token_ids, placed(), active)
        finally:
            for h in hooks:
                h.remove()
        binding._call, model._run_layer = timed_call, timed_run_layer
        try:
            with timer.part("generic"), packed.unpacked():
                compute_kv(model, token_ids, generic_cache, active)
        finally:
            binding._call, model._run_layer = original_call, original_run_layer
        n = int(active[-1]) + 1
        kv_diff.append(max(float((cache.k[:, :, :n] - generic_cache.k[:, :, :n]).abs().max()),
                           float((cache.v[:, :, :n] - generic_cache.v[:, :, :n]).abs().max())))
        with timer.part("write"):
            k, v = cache.kv_all(plan.num_computed, plan.end)
            paged.write(paged.slots(block_ids, plan.num_computed, plan.end), k, v)
        with timer.part("load"):
            bench_worker.load(LoadJob("r", "", prompt[: plan.end], plan, block_ids))
        save = SaveJob("r", "saved", "", prompt, block_ids)  # the downstream's own save, as the next agent waits on
        with timer.part("save.copy"):
            copy = bench_worker.copy_blocks(save)
        with timer.part("save.read"):
            bench_worker.read_copy(copy, save)
        del copy
        if args.profile and len(ends["connector_call_ms"]) == args.reps - 1:
            from torch.profiler import ProfilerActivity, profile
            with profile(activities=[ProfilerActivity.CPU]) as prof:
                fast.compute_kv(token_ids, cache, active)
            print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=25), flush=True)

        # end to end: the connector's load, then vLLM's prefill of the tail; and vLLM alone on the same prompt
        vllm_model.forward = timed_forward
        profiling = args.profile_calls and len(ends["connector_call_ms"]) == args.reps - 1
        try:
            forward_ms.clear()
            t0 = time.perf_counter()
            with profiled(profiling, "the call with the connector"):
                llm.generate([{"prompt_token_ids": prompt}], greedy, use_tqdm=False)
            ends["connector_call_ms"].append((time.perf_counter() - t0) * 1e3)
            ends["connector_vllm_forward_ms"].append(forward_ms[0])
            ends["connector_load_ms"].append(worker.results[-1].load_ms)
            ends["connector_load_forward_ms"].append(worker.results[-1].forward_ms)
            ends["connector_claimed"].append(worker.results[-1].num_claimed)
            forward_ms.clear()
            t0 = time.perf_counter()
            with profiled(profiling, "the call alone"):
                llm.generate([{"prompt_token_ids": prompt, "cache_salt": f"alone{len(ends['alone_call_ms'])}"}],
                             greedy, use_tqdm=False)
            ends["alone_call_ms"].append((time.perf_counter() - t0) * 1e3)
            ends["alone_vllm_forward_ms"].append(forward_ms[0])
        finally:
            vllm_model.forward = original_forward
        timer.end_rep()

    parts = timer.summary()
    for name in parts:  # per-layer figures of the forward
        if name.startswith(("forward.", "generic.")):
            for key in ("wall_ms_median", "cpu_ms_median"):
                parts[name][key.replace("_median", "_per_layer")] = parts[name][key] / cfg.num_layers
    ratio = [c / a for c, a in zip(ends["connector_call_ms"], ends["alone_call_ms"], strict=True)]
    out = {"threads": torch.get_num_threads(), "load_avg_1_5_15_end": os.getloadavg(), "reps": args.reps,
           "key_layout": key_layout, **shape, "parts": parts,
           "end_to_end": {name: {"median": statistics.median(vals), "values": [round(x, 2) for x in vals]}
                          for name, vals in ends.items()},
           "call_ratio_median": statistics.median(ratio), "kv_max_abs_diff": max(kv_diff)}
    for name, p in parts.items():
        print(f"{name:16s} wall {p['wall_ms_median']:8.2f} ms  cpu {p['cpu_ms_median']:8.2f} ms", flush=True)
    for name, p in out["end_to_end"].items():
        print(f"{name:26s} {p['median']:8.2f}", flush=True)
    print(f"call ratio (connector / vLLM alone) median {out['call_ratio_median']:.3f}; load {os.getloadavg()}; "
          f"K/V of the two forwards: largest difference {out['kv_max_abs_diff']:.2e}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
