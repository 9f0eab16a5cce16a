"""On a GPU: our forward against transformers, exact reuse, prefill time and every method's TTFT at an 8B shape.

One command does all of it, since GPU time is short (issue 24's plan, run when a task is lent a GPU):

1. parity: every tiny family of the parity tests (``tests/helpers.FAMILIES``) on the device, ours against
   transformers (SDPA) on the same weights: full prefill, a two-chunk prefill and 20 decode steps in fp32
   (bar: 1e-4, the CPU tests' bar); in bf16 both sides' error against the fp32 reference, and ours against
   theirs (bar: ours within 2x transformers' own bf16 error; bf16 keeps 8 bits of mantissa, so a bitwise
   bar makes no sense across kernels that sum in another order).
2. exact reuse on the device: RoPE shifts equal keys computed at the new position; ``prefix`` and a
   same-position ``naive`` load give ``full``'s logits.
3. prefill time: ``random:llama3-8b`` in bf16, ours against transformers' own model (SDPA) with the same
   weights, 1K / 4K / 8K tokens, median of ``--repeats`` after a warm-up, last token's logits on both sides.
3b. small calls: k new tokens over 3,752 cached ones (the bench's "ideal" call) and one decode step at that
   context, ours and transformers', and a torch profile of the 20-token call (host time against GPU time).
4. TTFT of every method on ``copy-agents:5`` at 512- and 1,024-token outputs (the last agent's prompt: 2,112
   and 3,752 tokens), random weights in bf16: timing only (random weights say nothing of fidelity).
5. selector: relay's TTFT against a static replay of its own per-layer kept sets on gsm8k-chain3's downstream
   calls (``relay_selector_cost.measure``; ``KVRELAY_DATA`` where ../shared/data is not beside the project):
   what relay's selection costs on the device (issue target: relay's speedup >= 0.8x the static one's).

Random presets need the default model's tokenizer only; ``--tokenizer DIR`` (a converted ``tokenizer.json``
+ ``tokenizer_meta.json``) gives it where the model package is not installed.

Usage: python research/gpu_check.py --json OUT [--device cuda] [--parts parity,...,selector] (default: every part)
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
import traceback
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests.helpers: the parity tests' families
sys.path.insert(0, str(Path(__file__).resolve().parent))  # sibling studies (relay_selector_cost, gpu_cli)
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))  # bench_engine: hf_llama_config

from bench_engine import hf_llama_config  # noqa: E402
from gpu_cli import use_tokenizer  # noqa: E402
from relay_selector_cost import measure as selector_cost  # noqa: E402

from kvrelay.cache.kv import SequenceKV  # noqa: E402
from kvrelay.engine import sync_device  # noqa: E402
from kvrelay.errors import KvRelayError  # noqa: E402
from kvrelay.eval.harness import Bench, BenchConfig, environment  # noqa: E402
from kvrelay.model.lm import LoadedModel  # noqa: E402
from kvrelay.model.schedule import SuffixSchedule  # noqa: E402
from kvrelay.pipeline.workloads import copy_agents  # noqa: E402
from kvrelay.reuse import split_method_specs  # noqa: E402
from kvrelay.weights import loader  # noqa: E402
from kvrelay.weights.devices import check_device  # noqa: E402
from tests.helpers import FAMILIES, hf_model, ours_from_hf  # noqa: E402

FP32_ATOL = 1e-4
# random weights have no profile: SmolLM2's shipped band (entering and admitting at layer 2, to the top) and its
# shipped selector, on a 32-layer model
RELAY_8B = "relay[band=2:2:31,keep_share=0.3,span_openings=6,prune_share=0.1,drift=0.35]"
BENCH_METHODS = ("full", "prefix", "naive", "cacheblend", "epic", RELAY_8B, "kvcomm")


def _max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).abs().max())


def _ids(n: int, vocab: int, seed: int = 1) -> torch.Tensor:
    return torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(seed))


# ---------------------------------------------------------------------------- 1. parity
def _ours_logits(model, ids: torch.Tensor, dtype: torch.dtype, device: str) -> dict[str, torch.Tensor]:
    ids = ids.to(device)
    cache = SequenceKV(model.config, dtype, device)
    full = model.prefill(ids, cache, all_logits=True).logits
    cache2 = SequenceKV(model.config, dtype, device, capacity=8)  # growth exercised
    model.prefill(ids[:23], cache2)
    chunk = model.prefill(ids, cache2, SuffixSchedule(23), all_logits=True).logits
    cache3 = SequenceKV(model.config, dtype, device, capacity=4)
    logits = [model.prefill(ids[:12], cache3).logits]
    tokens = []
    for _ in range(20):
        tokens.append(int(logits[-1].argmax()))
        logits.append(model.decode_step(tokens[-1], cache3))
    return {"full": full, "chunk": chunk, "decode": torch.stack(logits[:-1]), "tokens": torch.tensor(tokens)}


def _hf_logits(hf, ids: torch.Tensor, device: str) -> dict[str, torch.Tensor]:
    ids = ids.to(device)
    full = hf(ids[None]).logits[0]
    out = hf.generate(ids[None, :12], max_new_tokens=20, min_new_tokens=20, do_sample=False, output_logits=True,
                      return_dict_in_generate=True)
    return {"full": full, "chunk": full[23:], "decode": torch.stack([x[0] for x in out.logits]),
            "tokens": out.sequences[0, 12:].cpu()}


def parity(device: str) -> dict:
    rows = {}
    for family in sorted(FAMILIES):
        try:
            rows[family] = _parity_one(family, device)
        except Exception:  # a family the installed transformers builds differently: say so, check the others
            rows[family] = {"error": traceback.format_exc()}
            print(rows[family]["error"], file=sys.stderr, flush=True)
    return rows


def _parity_one(family: str, device: str) -> dict:
    hf32 = hf_model(family).to(device)
    ours32 = ours_from_hf(hf_model(family)).to(device)
    ids = _ids(40, 300)
    with torch.no_grad():
        ref, ours = _hf_logits(hf32, ids, device), _ours_logits(ours32, ids, torch.float32, device)
        hf16 = hf_model(family).to(device, torch.bfloat16)
        ours16 = ours_from_hf(hf_model(family)).to(device, torch.bfloat16)
        ref16, got16 = _hf_logits(hf16, ids, device), _ours_logits(ours16, ids, torch.bfloat16, device)
    row = {"fp32_" + k: _max_diff(ours[k], ref[k]) for k in ("full", "chunk", "decode")}
    row["fp32_tokens_equal"] = bool(torch.equal(ours["tokens"].cpu(), ref["tokens"].cpu()))
    row["bf16_ours_vs_fp32"] = _max_diff(got16["full"], ref["full"])
    row["bf16_hf_vs_fp32"] = _max_diff(ref16["full"], ref["full"])
    row["bf16_ours_vs_hf"] = _max_diff(got16["full"], ref16["full"])
    row["bf16_argmax_agree_with_fp32"] = float((got16["full"].argmax(-1) == ref["full"].argmax(-1)).float().mean())
    row["fp32_ok"] = all(row["fp32_" + k] < FP32_ATOL for k in ("full", "chunk", "decode")) and \
        row["fp32_tokens_equal"]
    row["bf16_ok"] = row["bf16_ours_vs_fp32"] <= 2 * row["bf16_hf_vs_fp32"]
    print(f"parity {family:8s} fp32 full {row['fp32_full']:.2e} chunk {row['fp32_chunk']:.2e} decode "
          f"{row['fp32_decode']:.2e} | bf16 ours-fp32 {row['bf16_ours_vs_fp32']:.3f} hf-fp32 "
          f"{row['bf16_hf_vs_fp32']:.3f} ours-hf {row['bf16_ours_vs_hf']:.3f}", flush=True)
    return row


# ---------------------------------------------------------------------------- 2. exact reuse
def exact(device: str) -> dict:
    hf = hf_model("llama3")
    model = ours_from_hf(hf).to(device)
    cfg = model.config
    ids = _ids(30, 300, seed=3)
    out = {}
    with torch.no_grad():
        at_p = SequenceKV(cfg, torch.float32, device)
        model.prefill(ids.to(device), at_p)
        padded = torch.cat([_ids(9, 300, seed=4), ids])
        at_q = SequenceKV(cfg, torch.float32, device)
        model.prefill(padded.to(device), at_q)
        span = at_p.export(0, 30, ids.tolist(), "fp")
        moved = SequenceKV(cfg, torch.float32, device)
        moved.load_span(span, 9, model.rope)
        # layer 0's keys depend on the token and the position alone
        out["rope_shift_layer0_max_diff"] = _max_diff(moved.k[0, :, 9:39], at_q.k[0, :, 9:39])
        full = model.prefill(ids.to(device), SequenceKV(cfg, torch.float32, device)).logits
        cache = SequenceKV(cfg, torch.float32, device)
        cache.load_span(at_p.export(0, 20, ids[:20].tolist(), "fp"), 0, model.rope)
        suffix = model.prefill(ids.to(device), cache, SuffixSchedule(20)).logits
        out["prefix_vs_full_max_diff"] = _max_diff(suffix, full)
    # the methods through the engine: a downstream call holding the upstream's prompt and output at their own
    # positions; prefix (the stored prefix) and naive (the span loaded unmoved) must give full's logits
    from kvrelay.cache.store import KVStore
    from kvrelay.model.lm import LoadedModel
    from kvrelay.model.sampling import SamplingConfig
    from kvrelay.reuse import get_method
    from kvrelay.reuse.base import CallInput, SpanRef
    from tests.helpers import generate, publish, tiny_lm

    tl = tiny_lm("llama3")
    lm = LoadedModel(tl.name, tl.model.to(device), tl.tokenizer, tl.config, tl.fingerprint, tl.source)
    store = KVStore(1 << 30)
    up_prompt = ids[:20].tolist()
    up = generate(lm, up_prompt, "full", store, SamplingConfig(max_new_tokens=10), keep_cache=True)
    publish(store, "up", up, lm)
    call = CallInput(up_prompt + up.output_ids + ids[20:].tolist(), [SpanRef(20, 30, "up", 20, "output")])
    one = SamplingConfig(max_new_tokens=1)
    res = {m: generate(lm, call, get_method(m), store, one) for m in ("full", "prefix", "naive")}
    for m in ("prefix", "naive"):
        out[f"engine_{m}_vs_full_max_diff"] = _max_diff(res[m].first_logits, res["full"].first_logits)
        out[f"engine_{m}_reused_tokens"] = res[m].stats.num_reused_tokens
    print("exact", json.dumps(out), flush=True)
    return out


# ---------------------------------------------------------------------------- 3. prefill time at 8B
def _hf_twin_llama(lm: LoadedModel, device: str) -> torch.nn.Module:
    """transformers' Llama with exactly our weights (llama3 RoPE scaling included), built on the device."""
    from transformers import LlamaForCausalLM

    cfg = hf_llama_config(lm)
    with torch.device("meta"):
        hf = LlamaForCausalLM(cfg)
    hf.load_state_dict(lm.model.state_dict(), strict=False, assign=True)  # shares our tensors: no second copy
    if lm.config.tie_word_embeddings:
        hf.tie_weights()
    hf.model.rotary_emb = type(hf.model.rotary_emb)(cfg).to(device)  # built off meta; inv_freq stays fp32
    left = [n for n, t in [*hf.named_parameters(), *hf.named_buffers()] if t.is_meta]
    if left:
        raise RuntimeError(f"transformers twin: no weights for {left[:5]}")
    return hf.eval()


def _time_ms(fn, repeats: int, device: str) -> list[float]:
    device = torch.device(device)
    fn()  # warm-up (kernels, allocator)
    times = []
    for _ in range(repeats):
        sync_device(device)
        t0 = time.perf_counter()
        fn()
        sync_device(device)
        times.append((time.perf_counter() - t0) * 1e3)
    return times


def prefill(lm: LoadedModel, hf: torch.nn.Module, device: str, lengths: list[int], repeats: int) -> dict:
    rows = {}
    for n in lengths:
        ids = _ids(n, 20000).to(device)
        with torch.no_grad():
            ours_logits = lm.model.prefill(ids, SequenceKV(lm.config, lm.model.dtype, device, capacity=n)).logits
            hf_logits = hf(ids[None], logits_to_keep=1, use_cache=False).logits[0, -1]
            ours = _time_ms(lambda ids=ids, n=n: lm.model.prefill(
                ids, SequenceKV(lm.config, lm.model.dtype, device, capacity=n)), repeats, device)
            theirs = _time_ms(lambda ids=ids: hf(ids[None], logits_to_keep=1, use_cache=False), repeats, device)
        rows[n] = {"ours_ms": statistics.median(ours), "transformers_ms": statistics.median(theirs),
                   "ratio": statistics.median(ours) / statistics.median(theirs),
                   "ours_ms_all": ours, "transformers_ms_all": theirs,
                   "last_logits_max_diff": _max_diff(ours_logits, hf_logits),
                   "last_argmax_equal": bool(ours_logits.argmax() == hf_logits.argmax())}
        print(f"prefill {n:5d} tokens: ours {rows[n]['ours_ms']:.1f} ms, transformers "
              f"{rows[n]['transformers_ms']:.1f} ms, ratio {rows[n]['ratio']:.3f}, last-logit diff "
              f"{rows[n]['last_logits_max_diff']:.3f}", flush=True)
    return rows


# ---------------------------------------------------------------------------- 3b. small calls at 8B
def small_calls(lm: LoadedModel, hf: torch.nn.Module, device: str, context_len: int, new_lens: list[int],
                repeats: int) -> dict:
    """What a reuse method's best case costs: k new tokens over ``context_len`` cached ones (the bench's
    "ideal"), and one decode step at that context; then where the time of the 20-token call goes."""
    from kvrelay.model.schedule import StaticSchedule

    rows: dict = {}
    ids = _ids(context_len, 20000).to(device)

    def call(k: int) -> None:
        cache = SequenceKV(lm.config, lm.model.dtype, device, capacity=context_len + 1)
        cache.filled[:, :context_len] = True  # stands for reused KV, as in the bench's ideal
        lm.model.prefill(ids, cache, StaticSchedule(torch.arange(context_len - k, context_len)))

    with torch.no_grad():
        for k in new_lens:
            times = _time_ms(lambda k=k: call(k), repeats, device)
            rows[f"new_{k}_ms"] = statistics.median(times)
            print(f"small: {k:4d} new tokens over {context_len}: {rows[f'new_{k}_ms']:.2f} ms", flush=True)
        cache = SequenceKV(lm.config, lm.model.dtype, device, capacity=context_len + repeats + 8)
        lm.model.prefill(ids, cache)
        steps = _time_ms(lambda: lm.model.decode_step(1, cache), repeats, device)
        rows["decode_step_ms"] = statistics.median(steps)
        past = hf(ids[None], use_cache=True).past_key_values
        one = torch.ones(1, 1, dtype=torch.long, device=device)
        hf_steps = _time_ms(lambda: hf(one, past_key_values=past, use_cache=True), repeats, device)
        rows["transformers_decode_step_ms"] = statistics.median(hf_steps)
        print(f"small: decode step at {context_len}: ours {rows['decode_step_ms']:.2f} ms, transformers "
              f"{rows['transformers_decode_step_ms']:.2f} ms", flush=True)
        from torch.profiler import ProfilerActivity, profile

        acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
        with profile(activities=acts) as prof:
            call(20)
            sync_device(torch.device(device))
        key = "self_cuda_time_total" if torch.cuda.is_available() else "self_cpu_time_total"
        rows["profile_by_device_time"] = prof.key_averages().table(sort_by=key, row_limit=14)
        rows["profile_by_cpu_time"] = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=14)
    print(rows["profile_by_cpu_time"], flush=True)
    return rows


# ---------------------------------------------------------------------------- 3c. first call at a new length
def new_lengths(lm: LoadedModel, device: str, lengths: list[int]) -> dict:
    """A server sees a new prompt length on almost every request: the first call at each length, and the
    second, for a full prefill and a 20-token call over that context, with cuDNN's attention allowed (torch's
    default) and not (then SDPA picks flash or memory-efficient attention)."""
    from kvrelay.model.schedule import StaticSchedule

    def full(ids: torch.Tensor) -> None:
        lm.model.prefill(ids, SequenceKV(lm.config, lm.model.dtype, device, capacity=ids.numel()))

    def small(ids: torch.Tensor) -> None:
        n = ids.numel()
        cache = SequenceKV(lm.config, lm.model.dtype, device, capacity=n + 1)
        cache.filled[:, :n] = True
        lm.model.prefill(ids, cache, StaticSchedule(torch.arange(n - 20, n)))

    def once_ms(fn, ids: torch.Tensor) -> float:
        sync_device(torch.device(device))
        t0 = time.perf_counter()
        fn(ids)
        sync_device(torch.device(device))
        return (time.perf_counter() - t0) * 1e3

    rows: dict = {}
    cuda = torch.cuda.is_available() and device.startswith("cuda")
    with torch.no_grad():
        for cudnn in (True, False):
            if cuda:
                torch.backends.cuda.enable_cudnn_sdp(cudnn)
            for n in lengths:
                n += 7 * cudnn  # lengths not seen before in this process either way
                ids = _ids(n, 20000).to(device)
                for name, fn in (("full", full), ("small", small)):
                    first, second = once_ms(fn, ids), once_ms(fn, ids)
                    rows[f"cudnn_{cudnn}_{name}_{n}"] = {"first_ms": first, "second_ms": second}
                    print(f"new length: cudnn {cudnn!s:5s} {name:5s} {n:5d} tokens: first {first:8.1f} ms, "
                          f"second {second:6.1f} ms", flush=True)
    if cuda:
        torch.backends.cuda.enable_cudnn_sdp(True)
    return rows


# ---------------------------------------------------------------------------- 4. every method at 8B
def bench(lm: LoadedModel, device: str, output_tokens: list[int], repeats: int, methods: tuple[str, ...]) -> dict:
    out = {}
    for n_out in output_tokens:
        cfg = BenchConfig(workload="copy-agents:5", methods=methods, limit=1, model=lm.name, device=device,
                          repeats=repeats, greedy_tokens=4)
        b = Bench(cfg, lm=lm)
        b.workload = copy_agents(5, 512, n_out)
        t0 = time.perf_counter()
        result = b.run(progress=False)
        result["workload"] = f"copy-agents:5 (512-token prefix, {n_out}-token outputs)"
        calls = result.pop("calls")
        last = [c for c in calls if c["agent"] == "agent5"]
        result["agent5"] = {c["method"]: {"ttft_ms": c["ttft_ms"], "full_ms": c["full_ttft_ms"],
                                          "ideal_ms": c["ideal_ttft_ms"], "prompt_tokens": c["num_prompt_tokens"],
                                          "fallback": c.get("fallback")} for c in last}
        out[str(n_out)] = result
        print(f"bench copy-agents:5 out {n_out}: {time.perf_counter() - t0:.0f} s", flush=True)
        for m, r in result["agent5"].items():
            print(f"  agent5 {m:60s} {r['ttft_ms']:8.1f} ms (full {r['full_ms']:.1f}, ideal {r['ideal_ms']:.1f}; "
                  f"{r['prompt_tokens']} tokens) {r['fallback'] or ''}", flush=True)
    return out


def prepare(prog: str, device: str, json_path: str, tokenizer: str | None) -> None:
    """Before any GPU time is spent: the device is there and the result can be written (else one error line,
    exit 2); random presets get the default model's tokenizer from ``tokenizer`` (a converted folder)."""
    try:
        check_device(device)
        Path(json_path).write_text("{}")
    except (KvRelayError, OSError) as exc:
        print(f"{prog}: error: {exc}", file=sys.stderr)
        sys.exit(2)
    if tokenizer:
        use_tokenizer(tokenizer)


def part_runner(parts: list[str], result: dict, json_path: str):
    """``step(name, fn)``: runs ``fn`` when ``name`` is one of ``parts``, records its return value (or its traceback)
    and its seconds in ``result``, and writes ``result`` to ``json_path``. One part's failure must not cost the
    others' GPU time."""

    def step(name: str, fn) -> None:
        if name not in parts:
            return
        t0 = time.perf_counter()
        try:
            result["parts"][name] = fn()
        except Exception:
            result["errors"][name] = traceback.format_exc()
            print(result["errors"][name], file=sys.stderr, flush=True)
        result.setdefault("seconds", {})[name] = time.perf_counter() - t0
        Path(json_path).write_text(json.dumps(result, indent=1, default=str))

    return step


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--json", required=True)
    ap.add_argument("--parts", default="parity,exact,prefill,small,lengths,bench,selector")
    ap.add_argument("--model", default="random:llama3-8b", help="the model of parts prefill and bench")
    ap.add_argument("--lengths", default="1024,4096,8192", help="prefill lengths (tokens)")
    ap.add_argument("--outputs", default="512,1024", help="copy-agents output lengths (tokens)")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--methods", default=",".join(BENCH_METHODS))
    ap.add_argument("--relay", default=RELAY_8B, help="the relay spec of part selector")
    ap.add_argument("--problems", type=int, default=6, help="gsm8k-chain3 problems of part selector")
    ap.add_argument("--tokenizer", default=None, help="folder with the default model's converted tokenizer")
    args = ap.parse_args()
    prepare("gpu_check", args.device, args.json, args.tokenizer)
    parts = args.parts.split(",")
    result: dict = {"env": environment(args.device), "parts": {}, "errors": {}}

    def save() -> None:
        Path(args.json).write_text(json.dumps(result, indent=1, default=str))

    step = part_runner(parts, result, args.json)

    torch.manual_seed(0)
    step("parity", lambda: parity(args.device))
    step("exact", lambda: exact(args.device))
    if {"prefill", "small", "lengths", "bench", "selector"} & set(parts):
        t0 = time.perf_counter()
        lm = loader.load_model(args.model, device=args.device)
        result["load_s"] = time.perf_counter() - t0
        result["dtype"] = str(lm.model.dtype)
        hf = _hf_twin_llama(lm, args.device) if {"prefill", "small"} & set(parts) else None
        step("prefill", lambda: prefill(lm, hf, args.device, [int(x) for x in args.lengths.split(",")], args.repeats))
        step("small", lambda: small_calls(lm, hf, args.device, 3752, [1, 20, 256], 2 * args.repeats))
        step("lengths", lambda: new_lengths(lm, args.device, [1001, 1533, 2049, 3001]))
        hf = None  # the bench needs the memory the twin's cache held (its weights are ours)
        step("bench", lambda: bench(lm, args.device, [int(x) for x in args.outputs.split(",")],
                                    args.repeats, split_method_specs(args.methods)))
        step("selector", lambda: selector_cost(lm, args.relay, "gsm8k-chain3", 0, args.problems, args.repeats))
    save()
    print("errors:", list(result["errors"]) or "none")


if __name__ == "__main__":
    main()
