"""Gemma 3 on a tiny random config against transformers' Gemma3ForCausalLM (fp32, within 1e-4).

Full prefill, chunked prefill and decode are in test_parity.py (``gemma3`` is one of FAMILIES); here:
moved keys (each layer rotates with its own RoPE base), batched decode across the sliding window, and
every reuse method through a two-agent pipeline on ``random:gemma3-tiny``.
"""

import pytest
import torch

from kvrelay import cli
from kvrelay.cache.kv import SequenceKV
from kvrelay.model.config import ModelConfig
from kvrelay.model.rope import apply_rotary
from kvrelay.model.schedule import SuffixSchedule
from tests.helpers import hf_model, ours_from_hf

ATOL = 1e-4
WINDOW = 8  # the tiny config's sliding window (tests/helpers.py FAMILIES["gemma3"])


@pytest.fixture(scope="module")
def pair():
    hf = hf_model("gemma3")
    return hf, ours_from_hf(hf)


def _ids(n: int, seed: int = 1) -> torch.Tensor:
    return torch.randint(0, 300, (n,), generator=torch.Generator().manual_seed(seed))


def test_config_has_local_and_global_layers(pair):
    _, ours = pair
    cfg: ModelConfig = ours.config
    assert [cfg.window_at(i) for i in range(4)] == [WINDOW, None, WINDOW, WINDOW]
    assert ours.rope_of(0) is ours.rope.local and ours.rope_of(1) is ours.rope
    assert (ours.rope.local.theta, ours.rope.theta) == (10000.0, 1000000.0)
    assert ModelConfig.from_dict(cfg.to_dict()) == cfg  # survives the conversion cache's JSON


def test_every_layer_shifts_keys_with_its_own_base(pair):
    """shift_keys over all layers' keys [L, Hkv, n, hd] == keys rotated at the new position by that
    layer's own cos/sin tables."""
    _, ours = pair
    rope, cfg = ours.rope, ours.config
    k = torch.randn(cfg.num_layers, cfg.num_kv_heads, 5, cfg.head_dim, generator=torch.Generator().manual_seed(0))
    p, delta = torch.tensor([0, 3, 40, 41, 200]), 17
    at_p = torch.stack([apply_rotary(k[li], *ours.rope_of(li).cos_sin(p, torch.float32)) for li in range(4)])
    at_q = torch.stack([apply_rotary(k[li], *ours.rope_of(li).cos_sin(p + delta, torch.float32)) for li in range(4)])
    torch.testing.assert_close(rope.shift_keys(at_p, delta), at_q, atol=1e-5, rtol=0)
    torch.testing.assert_close(rope.shift_keys(at_p[1], delta, layer=1), at_q[1], atol=1e-5, rtol=0)
    with pytest.raises(ValueError, match="per-layer RoPE bases"):
        rope.shift_keys(at_p[1], delta)  # one layer's keys: which base is ambiguous


def test_prefix_moved_from_elsewhere_then_suffix_matches_full(pair):
    """A prefix span stored as if computed 11 positions later (each layer's keys rotated there with its own
    cos/sin tables), loaded back to position 0 (``load_span`` re-rotates), then only the suffix
    computed: logits equal transformers' full forward, past the sliding window."""
    hf, ours = pair
    ids, m, moved = _ids(30), 19, 11
    with torch.no_grad():
        ref = hf(ids[None]).logits[0]
    own = SequenceKV(ours.config, torch.float32, "cpu")
    ours.prefill(ids[:m], own)
    by = torch.full((m,), moved)  # a rotation to position ``moved`` composes with the one at p: p + moved
    k = torch.stack([apply_rotary(own.k[li, :, :m], *ours.rope_of(li).cos_sin(by, torch.float32)) for li in range(4)])
    span = own.export(0, m, ids[:m].tolist(), "fp")
    span.k, span.start_pos = k, moved
    cache = SequenceKV(ours.config, torch.float32, "cpu")
    assert cache.load_span(span, 0, ours.rope) == m  # every key moved
    got = ours.prefill(ids, cache, SuffixSchedule(m), all_logits=True)
    torch.testing.assert_close(got.logits, ref[m:], atol=ATOL, rtol=0)


def test_batched_decode_of_sequences_on_both_sides_of_the_window(pair):
    """One decode batch: a 5-token and a 14-token prompt (shorter and longer than the window), 9 steps each;
    each row's logits equal transformers' forward over that row's whole sequence."""
    hf, ours = pair
    prompts = [_ids(5, seed=2), _ids(14, seed=3)]
    caches = [SequenceKV(ours.config, torch.float32, "cpu", capacity=4) for _ in prompts]
    last = [ours.prefill(p, c).logits for p, c in zip(prompts, caches, strict=True)]
    seqs = [p.tolist() for p in prompts]
    for _ in range(9):
        tokens = [int(lg.argmax()) for lg in last]
        for seq, t in zip(seqs, tokens, strict=True):
            seq.append(t)
        logits = ours.decode(tokens, caches)
        last = list(logits)
        for b, seq in enumerate(seqs):
            with torch.no_grad():
                ref = hf(torch.tensor(seq)[None]).logits[0, -1]
            torch.testing.assert_close(logits[b], ref, atol=ATOL, rtol=0)
    assert [c.length for c in caches] == [14, 23]


PIPELINE = """\
name: two-agents
inputs: [question]
agents:
  - name: solver
    system: You solve problems.
    user: "{question}"
    max_new_tokens: 24
  - name: checker
    user: "Problem: {question}\\nSolution: {solver}\\nIs it right?"
    max_new_tokens: 6
"""
# random:gemma3-tiny has 6 layers and no shipped profile: relay's layers are given
METHODS = ["full", "prefix", "naive", "cacheblend", "epic", "relay[band=1:2:4]", "kvcomm"]


@pytest.mark.parametrize("method", METHODS)
def test_every_method_runs_a_two_agent_pipeline(method, tmp_path, capsys):
    path = tmp_path / "two.yaml"
    path.write_text(PIPELINE)
    code = cli.main(["run", str(path), "--method", method, "--model", "random:gemma3-tiny",
                     "--input", "question=Tom has 3 apples and buys 4 more. How many apples does he have now?"])
    out = capsys.readouterr().out
    assert code == 0
    assert f"=== checker [{method}:" in out
