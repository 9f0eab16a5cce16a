"""Engine speed against transformers on the same weights, in the same run (issue: engine foundation).

- prefill: one forward over N prompt tokens (default 1,024), median of R runs; ours vs
  transformers' model forward (SDPA attention), logits of the last token only on both sides.
- decode: greedy tokens/s over T new tokens; ours (generate, full) vs transformers' generate.
- both also time ours with weights unpacked (``F.linear``, the matmuls transformers runs), interleaved.
- load: wall time of a fresh process loading the default model once it is converted and cached.

Usage: python benchmarks/bench_engine.py [--model smollm2-135m] [--json OUT]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

from kvrelay.cache.kv import SequenceKV
from kvrelay.engine import Engine, GenerateOptions
from kvrelay.eval.harness import environment
from kvrelay.eval.stats import timed_median_ms
from kvrelay.model import packed
from kvrelay.model.lm import LoadedModel
from kvrelay.model.sampling import SamplingConfig
from kvrelay.weights.loader import load_model


def hf_llama_config(lm):
    """transformers' LlamaConfig of our model's shape (its RoPE scaling included), SDPA attention."""
    from transformers import LlamaConfig

    c = lm.config
    rope = {**(c.rope_scaling or {"rope_type": "default"}), "rope_theta": c.rope_theta}
    return LlamaConfig(vocab_size=c.vocab_size, hidden_size=c.hidden_size, intermediate_size=c.intermediate_size,
                       num_hidden_layers=c.num_layers, num_attention_heads=c.num_heads,
                       num_key_value_heads=c.num_kv_heads, head_dim=c.head_dim,
                       max_position_embeddings=c.max_position_embeddings, rms_norm_eps=c.rms_norm_eps,
                       rope_parameters=rope, tie_word_embeddings=c.tie_word_embeddings, attn_implementation="sdpa")


def _hf_twin(lm):
    """A transformers Llama with exactly our weights (copied into its own tensors)."""
    from transformers import LlamaForCausalLM

    hf = LlamaForCausalLM(hf_llama_config(lm)).eval()
    hf.load_state_dict(lm.model.state_dict(), strict=False)
    if lm.config.tie_word_embeddings:
        hf.tie_weights()
    return hf


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--prompt-tokens", type=int, default=1024)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--json", default=None)
    ap.add_argument("--int4-decode", action="store_true",
                    help="also time decode on the GGUF's 4-bit weights (load_model(int4_decode=True)), interleaved")
    args = ap.parse_args()

    lm = load_model(args.model)
    lm4 = load_model(args.model, int4_decode=True) if args.int4_decode else None
    hf = _hf_twin(lm)
    ids = torch.randint(0, 20000, (args.prompt_tokens,), generator=torch.Generator().manual_seed(0))

    def ours_prefill():
        lm.model.prefill(ids, SequenceKV(lm.config, lm.dtype, "cpu", capacity=args.prompt_tokens))

    @torch.inference_mode()
    def hf_prefill():
        hf(ids[None], logits_to_keep=1, use_cache=True)

    with torch.inference_mode():
        ref = hf(ids[None]).logits[0, -1]
    ours_logits = lm.model.prefill(ids, SequenceKV(lm.config, lm.dtype, "cpu")).logits
    max_diff = float((ours_logits - ref).abs().max())

    # alternate them so machine noise hits all alike; "unpacked": ours on F.linear (kvrelay.model.packed)
    ours_ms, plain_ms, hf_ms = [], [], []
    for _ in range(args.repeats):
        ours_ms.append(timed_median_ms(ours_prefill, 1, warmup=1))
        with packed.unpacked():
            plain_ms.append(timed_median_ms(ours_prefill, 1, warmup=1))
        hf_ms.append(timed_median_ms(hf_prefill, 1, warmup=1))
    prefill = {"prompt_tokens": args.prompt_tokens, "ours_ms_median": statistics.median(ours_ms),
               "ours_unpacked_ms_median": statistics.median(plain_ms),
               "transformers_ms_median": statistics.median(hf_ms), "max_abs_logit_diff": max_diff,
               "matmuls": lm.matmuls}
    prefill["ratio_ours_over_transformers"] = prefill["ours_ms_median"] / prefill["transformers_ms_median"]
    prefill["ratio_unpacked_over_transformers"] = prefill["ours_unpacked_ms_median"] / prefill["transformers_ms_median"]

    decode_prompt = ids[:128].tolist()
    new = args.new_tokens

    def ours_decode(model: LoadedModel = lm) -> tuple[float, int]:
        out = Engine(model).generate(decode_prompt, "full", GenerateOptions(SamplingConfig(max_new_tokens=new)))
        assert len(out.output_ids) == new or out.stop_reason == "stop"
        return out.stats.decode_ms, len(out.output_ids)

    @torch.inference_mode()
    def hf_decode():
        x = torch.tensor([decode_prompt])
        t0 = time.perf_counter()
        hf.generate(x, max_new_tokens=new, min_new_tokens=new, do_sample=False, pad_token_id=0)
        return (time.perf_counter() - t0) * 1e3

    ours_decode()
    hf_decode()
    if lm4 is not None:
        ours_decode(lm4)
    ours_tps, plain_tps, hf_tps, int4_tps = [], [], [], []
    for _ in range(args.repeats):
        ms, n = ours_decode()
        ours_tps.append((n - 1) / (ms / 1e3))  # the decode loop feeds n-1 tokens after the prefill's first
        with packed.unpacked():
            ms, n = ours_decode()
        plain_tps.append((n - 1) / (ms / 1e3))
        if lm4 is not None:
            ms, n = ours_decode(lm4)
            int4_tps.append((n - 1) / (ms / 1e3))
        # transformers' generate time includes its prefill: subtract a prefill of the same prompt
        hf_total = hf_decode()
        hf_pre = timed_median_ms(lambda: hf(torch.tensor([decode_prompt]), logits_to_keep=1), 1, warmup=1)
        hf_tps.append((new - 1) / ((hf_total - hf_pre) / 1e3))
    decode = {"prompt_tokens": 128, "new_tokens": new, "ours_tokens_per_s_median": statistics.median(ours_tps),
              "ours_unpacked_tokens_per_s_median": statistics.median(plain_tps),
              "transformers_tokens_per_s_median": statistics.median(hf_tps)}
    decode["ratio_ours_over_transformers"] = (decode["ours_tokens_per_s_median"]
                                              / decode["transformers_tokens_per_s_median"])
    decode["ratio_unpacked_over_transformers"] = (decode["ours_unpacked_tokens_per_s_median"]
                                                  / decode["transformers_tokens_per_s_median"])
    if int4_tps:
        decode["int4_tokens_per_s_median"] = statistics.median(int4_tps)
        decode["ratio_int4_over_transformers"] = (decode["int4_tokens_per_s_median"]
                                                  / decode["transformers_tokens_per_s_median"])

    code = f"import time; t=time.perf_counter(); from kvrelay.weights.loader import load_model; " \
           f"load_model({args.model!r}); print(time.perf_counter()-t)"
    load_s = [float(subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                                   check=True).stdout.split()[-1]) for _ in range(3)]
    load = {"second_load_s_median": statistics.median(load_s), "runs_s": load_s,
            "note": "fresh process, conversion cache present; includes importing torch and kvrelay"}

    config = {"model": args.model, "prompt_tokens": args.prompt_tokens, "new_tokens": args.new_tokens,
              "repeats": args.repeats, "int4_decode": args.int4_decode}  # the table's caption rebuilds the command
    result = {"env": environment("cpu"), "model": lm.name, "config": config, "prefill": prefill, "decode": decode,
              "load": load}
    print(json.dumps(result, indent=1))
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
