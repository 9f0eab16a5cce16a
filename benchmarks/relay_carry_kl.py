"""Why relay with every span token selected from L_start > 0 is not ``full``: a decomposition.

On the downstream calls of gsm8k-chain3 (GSM8K test problems), first-token KL(full || method) of:

- ``relay[l_start=s, l_det=s, l_end=top]`` with every span token kept (``l_suf`` >= any span): the span
  enters layer s from the hidden state the upstream carried, and layers below s read the upstream's K/V;
- the same with an *oracle* span: K/V and layer-s hidden state taken from ``full``'s own prefill of the
  downstream prompt (at the same positions, or moved by +37 positions and re-rotated back on load);
- the same with the upstream's span recomputed by a *prefill* of the upstream sequence instead of taken
  from its decode (decode-vs-prefill numerics, same upstream context).

Usage: python benchmarks/relay_carry_kl.py [--problems 2] [--layers 0,1,2,4,8]
"""

from __future__ import annotations

import argparse

import torch

from kvrelay.cache.kv import StoredSpan
from kvrelay.cache.store import KVStore
from kvrelay.engine import Engine, GenerateOptions
from kvrelay.eval.fidelity import kl_first_token
from kvrelay.model.sampling import SamplingConfig
from kvrelay.pipeline.runner import PipelineRunner
from kvrelay.pipeline.workloads import get_workload
from kvrelay.reuse.base import CallInput, SpanRef
from kvrelay.reuse.relay import RelayMethod
from kvrelay.reuse.spans import collect_reuse
from kvrelay.weights.loader import load_model

ONE = SamplingConfig(max_new_tokens=1)


def generate(lm, call, method, store, sampling, capture_layers=(), keep_cache=False):
    """One call on a fresh engine carrying ``capture_layers`` (besides what the method asks for)."""
    options = GenerateOptions(sampling, keep_cache=keep_cache)
    return Engine(lm, store, capture_layers=capture_layers).generate(call, method, options)
SHIFT = 37  # positions the shifted oracle span is stored at, away from where it is loaded


def relay_all(start: int, top: int) -> RelayMethod:
    return RelayMethod(l_start=start, l_det=start, l_end=top, tau_dev=0, tau_inf=0, l_suf=1 << 20)


def oracle_call(lm, call: CallInput, store: KVStore, layer: int, shift: int, tag: str) -> CallInput:
    """The call with every approximate span replaced by a span holding full's own K/V and layer input."""
    ref_full = generate(lm, call, "full", store, ONE, capture_layers=(layer,) if layer else (), keep_cache=True)
    refs = []
    for i, load in enumerate(collect_reuse(call, store, lm.fingerprint).approx):
        a, b = load.dst_start, load.dst_start + load.num_tokens
        k = ref_full.cache.k[:, :, a:b].clone()
        if shift:
            k = lm.model.rope.shift_keys(k, shift)
        hidden = {layer: ref_full.prompt_hidden[layer][a:b].clone()} if layer else {}
        span_id = f"oracle-{tag}-{i}"
        store.put(span_id, StoredSpan(tuple(call.prompt_ids[a:b]), a + shift, k, ref_full.cache.v[:, :, a:b].clone(),
                                      lm.fingerprint, hidden))
        refs.append(SpanRef(a, b, span_id, 0, "output"))
    return CallInput(call.prompt_ids, refs, call.name)


def prefill_call(lm, call: CallInput, store: KVStore, layer: int, tag: str) -> CallInput:
    """The call with every approximate span replaced by the upstream sequence recomputed by one prefill."""
    refs = []
    for i, load in enumerate(collect_reuse(call, store, lm.fingerprint).approx):
        span = store.get(load.span_id)
        seq = list(span.token_ids)
        full_seq = generate(lm, seq, "full", None, ONE, capture_layers=(layer,) if layer else (), keep_cache=True)
        n = len(seq)
        hidden = {layer: full_seq.prompt_hidden[layer].clone()} if layer else {}
        span_id = f"prefill-{tag}-{i}"
        store.put(span_id, StoredSpan(tuple(seq), 0, full_seq.cache.k[:, :, :n].clone(),
                                      full_seq.cache.v[:, :, :n].clone(), lm.fingerprint, hidden))
        a = load.dst_start
        refs.append(SpanRef(a, a + load.num_tokens, span_id, load.src_start, "output"))
    return CallInput(call.prompt_ids, refs, call.name)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--problems", type=int, default=2)
    parser.add_argument("--layers", default="0,1,2,4,8")
    args = parser.parse_args()
    layers = [int(x) for x in args.layers.split(",")]
    lm = load_model("smollm2-135m")
    top = lm.config.num_layers - 1
    wl = get_workload("gsm8k-chain3")
    rows: dict[str, list[float]] = {}
    diffs: list[float] = []

    def add(key: str, value: float) -> None:
        rows.setdefault(key, []).append(value)

    for problem in wl.problems(None, args.problems):  # the default data: GSM8K test_dev
        store = KVStore(8 << 30)
        runner = PipelineRunner(Engine(lm, store, capture_layers=tuple(x for x in layers if x > 0)), wl.spec,
                                run_id=problem.problem_id)

        def probe(agent, call, position, store=store, pid=problem.problem_id):
            if not any(r.kind == "output" for r in call.refs):
                return
            tag = f"{pid}-{agent.name}"
            full = generate(lm, call, "full", store, ONE).first_logits
            for s in layers:
                add(f"relay all-selected, carried from upstream decode, L_start={s}",
                    kl_first_token(full, generate(lm, call, relay_all(s, top), store, ONE).first_logits))
            for s in [x for x in layers if x > 0]:
                for shift in (0, SHIFT):
                    oc = oracle_call(lm, call, store, s, shift, f"{tag}-{s}-{shift}")
                    add(f"relay all-selected, oracle span (full's own K/V + hidden), shift {shift}, L_start={s}",
                        kl_first_token(full, generate(lm, oc, relay_all(s, top), store, ONE).first_logits))
                pc = prefill_call(lm, call, store, s, f"{tag}-{s}")
                dec = generate(lm, call, relay_all(s, top), store, ONE).first_logits
                pre = generate(lm, pc, relay_all(s, top), store, ONE).first_logits
                add(f"relay all-selected, upstream span by prefill instead of decode, L_start={s}",
                    kl_first_token(full, pre))
                add(f"KL(relay carried-by-decode || carried-by-prefill), L_start={s}", kl_first_token(dec, pre))
            add("naive", kl_first_token(full, generate(lm, call, "naive", store, ONE).first_logits))

        runner.run(problem.inputs, "full", before_call=probe)
        # decode-vs-prefill on the upstream spans themselves: same tokens, same context
        for name in wl.spec.order:
            span = store.get(runner.span_id(name))
            seq = list(span.token_ids)
            again = generate(lm, seq, "full", None, ONE, capture_layers=tuple(x for x in layers if x > 0),
                             keep_cache=True)
            n = len(seq)
            diffs.append(float((again.cache.v[:, :, :n] - span.v).abs().max()))
            for s, h in span.hidden.items():
                rows_h = again.prompt_hidden[s][span.hidden_from:]
                add(f"max |h decode - h prefill| at layer {s} input (upstream spans)", float((rows_h - h).abs().max()))

    for key, values in rows.items():
        print(f"{key:100s} mean {sum(values) / len(values):.3e}  max {max(values):.3e}  (n={len(values)})")
    print(f"{'max |V decode - V prefill| over layers (upstream spans)':100s} {max(diffs):.3e}")


if __name__ == "__main__":
    torch.set_num_threads(1)
    main()
