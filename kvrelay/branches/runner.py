"""``gsm8k-branches`` (RKSC): one question, B reasoning branches with different hints, a verifier.

Per problem: B prompts = the shared root (system prompt + "Problem: ..." up to the hint) followed by
a different hint each; every branch decodes up to T tokens greedily; its confidence is the mean
top-1 probability while decoding. A verifier prompt per branch (root + the branch's output ids +
a yes/no question) is scored by P(Yes) / (P(Yes) + P(No)) at its last real token, and the pick is
argmax(score x sqrt(confidence)).

Methods (every one on the same prompt ids, batch size 1, greedy):
- ``full``: every branch and every verification prefills its whole prompt;
- ``prefix``: exact prefix caching: branch 0's KV goes to a store, and every later prompt copies
  the longest exact prefix it finds there into its own cache;
- ``rksc``: the root is computed once (from the RSBCM block cache where it holds the blocks) and
  shared by reference; the verifier is skipped when branch confidence is decisive, and exits at an
  intermediate layer when its next-token entropy is low and stable (branches/rksc.py).
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from kvrelay.branches.blocks import BlockCache
from kvrelay.branches.prompts import SYSTEM, BranchConfig, BranchPrompts, answer_ids
from kvrelay.branches.rksc import RKSCMethod, SharedRoot, decisive, pick, yes_score
from kvrelay.branches.shared_kv import kv_bytes
from kvrelay.cache.kv import SequenceKV
from kvrelay.cache.store import KVStore
from kvrelay.engine import Engine, GenerateOptions, GenerationOutput, sync_device
from kvrelay.errors import ConfigError
from kvrelay.model.lm import LoadedModel
from kvrelay.model.sampling import SamplingConfig
from kvrelay.model.schedule import SuffixSchedule
from kvrelay.reuse import get_method


@dataclass
class VerifyResult:
    score: float
    exit_layer: int | None
    computed_tokens: int

    @classmethod
    def of(cls, out: GenerationOutput, yes_id: int, no_id: int) -> VerifyResult:
        s = out.stats
        return cls(yes_score(out.first_logits, yes_id, no_id), s.exit_layer,
                   s.num_computed_token_layers // s.num_layers)


def verify(lm: LoadedModel, padded_ids: torch.Tensor, lengths: list[int], method, store: KVStore | None = None
           ) -> list[VerifyResult]:
    """Score a right-padded batch of verifier prompts ([B, n_max] ids, real lengths): P(Yes) is read at
    each row's last *real* token, whatever follows it (the public RKSC code reads the padding)."""
    if padded_ids.dim() != 2 or padded_ids.shape[0] != len(lengths):
        raise ConfigError(f"verify wants [B, n] ids and B lengths, got {tuple(padded_ids.shape)} and {len(lengths)}")
    yes_id, no_id = answer_ids(lm.tokenizer)
    results = []
    for row, length in zip(padded_ids.tolist(), lengths, strict=True):
        if not 0 < length <= len(row):
            raise ConfigError(f"verifier prompt length {length} outside 1..{len(row)}")
        out = Engine(lm, store).generate(row[:length], method, GenerateOptions(SamplingConfig(max_new_tokens=1)))
        results.append(VerifyResult.of(out, yes_id, no_id))
    return results


def pad(rows: list[list[int]], pad_id: int) -> tuple[torch.Tensor, list[int]]:
    width = max(len(r) for r in rows)
    return torch.tensor([r + [pad_id] * (width - len(r)) for r in rows]), [len(r) for r in rows]


@dataclass
class ProblemRun:
    """One problem under one method: timings, branches, verification and the pick."""

    method: str
    total_ms: float
    branch_ms: float
    verify_ms: float
    output_ids: list[list[int]]
    confidences: list[float]
    scores: list[float] | None  # None: the verifier was skipped
    exit_layers: list[int | None]
    pick: int
    num_prompt_tokens: int  # over every branch and verification prompt
    num_computed_tokens: int  # prompt tokens computed (token-layers / layers)
    branch_kv_bytes: int  # K/V storage the B branch caches hold together
    root_plus_own_bytes: int  # one copy of the root + the branches' own rows (the ASKS memory bound)
    block_hits: int = 0  # root blocks found in the block cache (rksc)
    # rksc only, computed after the timed run: every branch verified at full depth, no skip
    ref_scores: list[float] | None = None
    ref_pick: int | None = None

    def to_dict(self) -> dict:
        return dict(self.__dict__)


class BranchRunner:
    """Runs gsm8k-branches problems under ``full``, ``prefix`` or an ``RKSCMethod``."""

    def __init__(self, lm: LoadedModel, cfg: BranchConfig, rksc: RKSCMethod | None = None) -> None:
        self.lm, self.cfg = lm, cfg
        self.rksc = rksc or RKSCMethod()
        self.blocks = BlockCache(self.rksc.block_budget_bytes, fingerprint=lm.fingerprint)
        self.pad_id = 0  # any id: verify() reads each row up to its real length

    def _row_bytes(self) -> int:
        c = self.lm.config
        return 2 * c.num_layers * c.num_kv_heads * c.head_dim * self.lm.model.dtype.itemsize

    def run(self, question: str, method: str, system: str = SYSTEM) -> ProblemRun:
        prompts = BranchPrompts.build(self.lm.tokenizer, question, self.cfg, system)
        if method == "rksc":
            return self._run_rksc(prompts)
        if method not in ("full", "prefix"):
            raise ConfigError(f"gsm8k-branches runs full, prefix or rksc, not {method!r}")
        return self._run_baseline(prompts, method)

    # ------------------------------------------------------------------ full / prefix
    def _run_baseline(self, prompts: BranchPrompts, method: str) -> ProblemRun:
        lm, meth = self.lm, get_method(method)
        store = KVStore(8 << 30) if method == "prefix" else None
        sampling = SamplingConfig(max_new_tokens=self.cfg.branch_tokens)
        sync_device(lm.model.device)
        t0 = time.perf_counter()
        engine = Engine(lm, store)
        outs: list[GenerationOutput] = []
        for b, ids in enumerate(prompts.branch_ids):
            out = engine.generate(ids, meth, GenerateOptions(sampling, keep_cache=True,
                                                             feed_last=method == "prefix" and b == 0))
            if method == "prefix" and b == 0:
                engine.publish("branch0", out)
            outs.append(out)
        t1 = time.perf_counter()
        confidences = [o.confidence for o in outs]
        v_ids = [prompts.verifier_ids(o.output_ids) for o in outs]
        results = verify(lm, *pad(v_ids, self.pad_id), meth, store)
        sync_device(lm.model.device)
        t2 = time.perf_counter()
        scores = [r.score for r in results]
        return self._result(method, prompts, outs, t0, t1, t2, confidences, scores, results, v_ids)

    # ------------------------------------------------------------------ rksc
    def _root(self, root_ids: list[int]) -> tuple[SharedRoot, list[bytes], int, int]:
        """The root's cache: hit blocks copied from the block cache, the rest computed. The hit blocks
        are pinned at lookup and the added ones at insert (returned: the keys to unpin when done).
        Also returns the number of hit blocks and of root tokens computed."""
        lm, n, blocks = self.lm, len(root_ids), self.blocks
        chain = blocks.lookup(root_ids, pin=True)
        cache = SequenceKV(lm.config, lm.model.dtype, lm.model.device, capacity=n)
        hit = min(len(chain) * blocks.block_len, n - 1)
        for i, block in enumerate(chain):
            k, v = block.payload  # [L, Hkv, block_len, hd] each
            cache.patch(i * blocks.block_len, k, v, add=False)
        cache.length = hit
        lm.model.prefill(torch.tensor(root_ids), cache, SuffixSchedule(hit) if hit else None)
        added = blocks.insert_keys(blocks.keys(root_ids), lambda i: self._block_payload(cache, i), pin=True)
        pinned = [block.key for block in chain] + added
        return SharedRoot(tuple(root_ids), cache), pinned, len(chain), n - hit

    def _block_payload(self, cache: SequenceKV, index: int) -> tuple[tuple[torch.Tensor, torch.Tensor], int]:
        """A copy of block ``index``'s K/V (the block cache owns its tensors) and its bytes."""
        k, v = cache.kv_all(index * self.blocks.block_len, (index + 1) * self.blocks.block_len)
        k, v = k.clone(), v.clone()  # [L, Hkv, block_len, hd] each
        return (k, v), 2 * k.numel() * k.element_size()

    def _credit(self, ids: list[int], schedule) -> None:
        """Add the call's attention mass (last prompt token, mean over heads and layers) to its blocks."""
        mass = schedule.position_mass() if schedule is not None else None
        if mass is None:
            return
        num_blocks = len(ids) // self.blocks.block_len
        per_block = mass[: num_blocks * self.blocks.block_len].view(num_blocks, -1).sum(-1)  # [num_blocks]
        self.blocks.add_importance(self.blocks.keys(ids), per_block.tolist())

    def _generate_rksc(self, ids: list[int], sampling: SamplingConfig, keep: bool) -> GenerationOutput:
        out = Engine(self.lm).generate(ids, self.rksc, GenerateOptions(sampling, keep_cache=keep, feed_last=False))
        self._credit(ids, self.rksc.last_schedule)
        if keep:
            self._keep_blocks(out)
        return out

    def _keep_blocks(self, out: GenerationOutput) -> None:
        """Store the sequence's full blocks (prompt + output with K/V), as a serving cache would;
        after a layer exit the upper layers hold no K/V, so nothing is stored."""
        if out.stats.exit_layer is None:
            self.blocks.insert(out.prompt_ids + out.output_ids, lambda i: self._block_payload(out.cache, i),
                               out.cache.length)

    def _branches_rksc(self, prompts: BranchPrompts, sampling: SamplingConfig) -> list[GenerationOutput]:
        """Every branch decoded, in one batch over the shared root when ``batch_decode``."""
        method = self.rksc
        if not method.batch_decode:
            return [self._generate_rksc(ids, sampling, keep=True) for ids in prompts.branch_ids]
        engine, options = Engine(self.lm), GenerateOptions(sampling, keep_cache=True, feed_last=False)
        seqs = []
        for ids in prompts.branch_ids:  # prefilled one by one, then decoded in one batch
            seqs.append(engine.start(ids, method, options))
            self._credit(ids, seqs[-1].plan.state)
        while not all(seq.done for seq in seqs):
            engine.step(seqs)
        outs = [engine.finish(seq) for seq in seqs]
        for out in outs:
            self._keep_blocks(out)
        return outs

    def _run_rksc(self, prompts: BranchPrompts) -> ProblemRun:
        lm, method, cfg = self.lm, self.rksc, self.cfg
        sampling = SamplingConfig(max_new_tokens=cfg.branch_tokens)
        sync_device(lm.model.device)
        t0 = time.perf_counter()
        root, keys, hits, root_computed = self._root(prompts.root_ids)
        method.root, method.exiting = root, False
        outs = self._branches_rksc(prompts, sampling)
        t1 = time.perf_counter()
        kv_total = kv_bytes([o.cache for o in outs])
        self.blocks.unpin(keys)
        method.root = None
        for o in outs:
            o.cache = None
        confidences = [o.confidence for o in outs]
        v_ids = [prompts.verifier_ids(o.output_ids) for o in outs]
        results, scores = [], None
        if not decisive(confidences, method.skip_top, method.skip_gap):
            # the verifier runs as later requests would: it finds the root through the block cache
            root, keys, more_hits, more_computed = self._root(prompts.root_ids)
            hits, root_computed = hits + more_hits, root_computed + more_computed
            method.root, method.exiting = root, True
            yes_id, no_id = answer_ids(lm.tokenizer)
            for ids in v_ids:
                out = self._generate_rksc(ids, SamplingConfig(max_new_tokens=1), keep=True)
                results.append(VerifyResult.of(out, yes_id, no_id))
            scores = [r.score for r in results]
            self.blocks.unpin(keys)
        sync_device(lm.model.device)
        t2 = time.perf_counter()
        run = self._result("rksc", prompts, outs, t0, t1, t2, confidences, scores, results, v_ids,
                           kv_total=kv_total, hits=hits, root_computed=root_computed)
        # untimed reference: the same branches, every one verified at full depth, no skip
        method.root, method.exiting = SharedRoot(tuple(prompts.root_ids), self._plain_root(prompts.root_ids)), False
        ref = verify(lm, *pad(v_ids, self.pad_id), method)
        method.root = None
        run.ref_scores = [r.score for r in ref]
        run.ref_pick = pick(run.ref_scores, confidences)
        return run

    def _plain_root(self, root_ids: list[int]) -> SequenceKV:
        cache = SequenceKV(self.lm.config, self.lm.model.dtype, self.lm.model.device, capacity=len(root_ids))
        self.lm.model.prefill(torch.tensor(root_ids), cache)
        return cache

    # ------------------------------------------------------------------ result
    def _result(self, method: str, prompts: BranchPrompts, outs: list[GenerationOutput], t0: float, t1: float,
                t2: float, confidences: list[float], scores: list[float] | None, results: list[VerifyResult],
                v_ids: list[list[int]], kv_total: int | None = None, hits: int = 0, root_computed: int = 0
                ) -> ProblemRun:
        row = self._row_bytes()
        root_len = len(prompts.root_ids)
        own_rows = sum(len(o.prompt_ids) - root_len + len(o.output_ids) for o in outs)
        if kv_total is None:
            kv_total = kv_bytes([o.cache for o in outs if o.cache is not None])
            for o in outs:
                o.cache = None
        computed = sum(o.stats.num_computed_token_layers // o.stats.num_layers for o in outs)
        computed += sum(r.computed_tokens for r in results) + root_computed
        num_prompt = sum(len(ids) for ids in prompts.branch_ids) + (sum(len(i) for i in v_ids) if results else 0)
        return ProblemRun(
            method, (t2 - t0) * 1e3, (t1 - t0) * 1e3, (t2 - t1) * 1e3, [o.output_ids for o in outs], confidences,
            scores, [r.exit_layer for r in results], pick(scores, confidences), num_prompt, computed, kv_total,
            (root_len + own_rows) * row, block_hits=hits)
