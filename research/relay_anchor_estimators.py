"""How much of a relayed span token's move can any estimate built before the band runs explain?

``relay_anchors`` estimates each span token's K/V move (fresh - stored, keys with RoPE undone) from the moves of
similar tokens in earlier calls of the same role (``MovePool``: the 8 nearest of 4,096 k-means rows by the stored key
at the middle layer). Its first-token KL is still 1.5-1.9x the shipped relay's, and on calibration calls a quarter of
its residual removed from every token would close that gap (``relay_anchor_limits.py``). This study asks whether a
better estimator could: on a pool of GSM8K *train* problems it records every span token's true move and what is known
of the token before the band runs (its stored K and V at a few layers, its place in its span), fits estimators per
role, and scores them on other calls:

- ``anchors``: the shipped ``MovePool`` index, as ``relay_anchors`` searches it;
- ``ridge``: a ridge regression per role from the stored K/V at ``FEAT_LAYERS`` (unit norm per layer) and the
  token's place in its span to its moves at every layer (``fit_ridge``);
- ``blend``: half of each (the two disagree in their errors);
- ``oracle: true layers 1-U`` (U in ``--oracle-upto``): the same regression given also the token's *true* moves at
  layers 1..U, scored on layers U+1 up only, beside the anchors on those layers: how much of the upper layers' move
  the lower layers' (which only a recompute knows) carry.

Scores: the share of the squared move explained, K and V apart, over layers 1 up (layer 0 never moves), per role and
in all; and, for ``anchors`` and ``blend``, the first-token KL against ``full`` with every span token moved by the
estimate (naive plus the estimator), and with the top ``--ratio`` of span tokens by the anchors' expected residual
given their true K/V at every layer (what relay's band on them could give at best). Scored calls: ``--problems``
train problems after ``--offset``, and ``--test-problems`` GSM8K test problems (the bench's lanes' problems 0 up).

Usage: python research/relay_anchor_estimators.py --problems 20 --offset 100 --pool-offset 120 --pool-problems 128 \\
    --test-problems 20 --threads 2 --json OUT.json
"""

from __future__ import annotations

import json
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
from relay_anchor_limits import top_mask
from relay_anchor_select import open_pool_study, pool_parser
from relay_oracle_shift import moved_logits, moves, span_call

from kvrelay.data.datasets import data_root
from kvrelay.eval.calibration_calls import downstream_calls
from kvrelay.eval.fidelity import kl_first_token
from kvrelay.eval.harness import environment
from kvrelay.reuse import get_method
from kvrelay.reuse.relay_anchors import RelayAnchorsMethod, stored_keys_free

FEAT_LAYERS = (2, 4, 8, 15, 22, 29)  # the stored K/V a regression reads
# x the mean diagonal of the features' Gram matrix; it and BLEND were picked on a scratch run on the default train calls
# (problems 100-119; the test calls are the clean split)
RIDGE_LAMBDA = 0.1
BLEND = 0.5


@dataclass
class Rows:
    """One role's span tokens: features [n, F] and moves [n, 2 L Hkv hd] (K then V at every layer), fp16."""

    feat: list[torch.Tensor] = field(default_factory=list)
    moves: list[torch.Tensor] = field(default_factory=list)

    def cat(self) -> tuple[torch.Tensor, torch.Tensor]:
        return torch.cat(self.feat), torch.cat(self.moves)


def place_features(num_tokens: int) -> torch.Tensor:
    """[n, 2]: log(1 + tokens before) and log(1 + tokens after), each token's place in its span of ``num_tokens``."""
    before = torch.arange(num_tokens, dtype=torch.float32)
    return torch.stack([torch.log1p(before), torch.log1p(num_tokens - 1 - before)], 1)


def token_features(keys_free: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """A span's per-token features [n, 2 F Hkv hd + 2]: its stored keys (RoPE undone) and values at each of F layers,
    [F, Hkv, n, hd] each, every layer's unit-normed over heads and channels, then its place in the span."""
    num_tokens = keys_free.shape[2]

    def per_layer(t: torch.Tensor) -> torch.Tensor:  # [F, Hkv, n, hd] -> [n, F, Hkv * hd] -> [n, F * Hkv * hd]
        return torch.nn.functional.normalize(t.float().permute(2, 0, 1, 3).flatten(2), dim=-1).flatten(1)

    return torch.cat([per_layer(keys_free), per_layer(values), place_features(num_tokens)], 1)


def flat_moves(k_move: torch.Tensor, v_move: torch.Tensor) -> torch.Tensor:
    """[L, Hkv, n, hd] twice -> [n, 2 L Hkv hd]: K at every layer, then V (``MovePool``'s row layout)."""
    num_tokens = k_move.shape[2]
    return torch.cat([k_move, v_move]).permute(2, 0, 1, 3).reshape(num_tokens, -1)


def split_moves(flat: torch.Tensor, num_layers: int) -> tuple[torch.Tensor, torch.Tensor]:
    """[n, 2 L Hkv hd] -> K and V [n, L, Hkv hd] (float32)."""
    both = flat.float().view(flat.shape[0], 2 * num_layers, -1)  # [n, 2L, Hkv hd]
    return both[:, :num_layers], both[:, num_layers:]


def unflat_moves(flat: torch.Tensor, num_layers: int, head_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``flat_moves`` undone: [n, 2 L Hkv hd] -> K and V [L, Hkv, n, hd] (float32, new tensors)."""
    k, v = split_moves(flat, num_layers)  # [n, L, Hkv hd] each
    n = flat.shape[0]
    # [n, L, Hkv hd] -> [n, L, Hkv, hd] -> [L, Hkv, n, hd]
    return tuple(t.reshape(n, num_layers, -1, head_dim).permute(1, 2, 0, 3).contiguous() for t in (k, v))


@dataclass
class Ridge:
    """y = (x - x_mean) @ weight + y_mean."""

    x_mean: torch.Tensor  # [F]
    weight: torch.Tensor  # [F, D]
    y_mean: torch.Tensor  # [D]

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return (x.float() - self.x_mean) @ self.weight + self.y_mean


def fit_ridge(x: torch.Tensor, y: torch.Tensor, lam: float, chunk: int = 4096) -> Ridge:
    """Ridge regression of ``y`` [n, D] on ``x`` [n, F] with an intercept: the penalty is ``lam`` x the mean diagonal
    of the centered Gram matrix (a scale-free strength). ``y`` is read in row chunks (it may be fp16 and large)."""
    x = x.float()
    x_mean = x.mean(0)
    xc = x - x_mean  # [n, F]
    gram = xc.T @ xc  # [F, F]
    gram += lam * gram.diagonal().mean() * torch.eye(gram.shape[0])
    y_mean = sum(part.float().sum(0) for part in y.split(chunk)) / y.shape[0]  # [D]
    xty = sum(xc[i : i + chunk].T @ (part.float() - y_mean) for i, part in zip(range(0, y.shape[0], chunk),
                                                                               y.split(chunk), strict=True))
    return Ridge(x_mean, torch.linalg.solve(gram, xty), y_mean)


def low_rank(model: Ridge, x: torch.Tensor, rank: int) -> Ridge:
    """``model`` with its weight cut to the ``rank`` output directions that carry most of its predictions' variance
    on ``x`` [n, F] (the SVD of C^1/2 W, C the features' covariance): a readout of F x r + r x D products a token."""
    xc = x.float() - model.x_mean
    values, vectors = torch.linalg.eigh(xc.T @ xc / x.shape[0])  # [F], [F, F]
    half = vectors @ torch.diag(values.clamp_min(0).sqrt()) @ vectors.T  # C^1/2
    top = torch.linalg.svd(half @ model.weight, full_matrices=False)[2][:rank]  # [r, D]
    return Ridge(model.x_mean, (model.weight @ top.T) @ top, model.y_mean)


@dataclass
class Explained:
    """Running sums for the share of the squared move an estimate explains, K and V apart, layers ``from_layer`` up."""

    from_layer: int = 1
    sums: list[float] = field(default_factory=lambda: [0.0, 0.0, 0.0, 0.0])  # K miss, K total, V miss, V total

    def add(self, true: torch.Tensor, est: torch.Tensor, num_layers: int) -> None:
        """``true``, ``est``: [n, 2 L Hkv hd] moves of the same tokens."""
        (tk, tv), (ek, ev) = split_moves(true, num_layers), split_moves(est, num_layers)
        lo = self.from_layer
        for i, (t, e) in enumerate(((tk, ek), (tv, ev))):
            self.sums[2 * i] += float((t[:, lo:] - e[:, lo:]).square().sum())
            self.sums[2 * i + 1] += float(t[:, lo:].square().sum())

    def shares(self) -> dict[str, float]:
        k_miss, k_total, v_miss, v_total = self.sums
        return {"K": 1 - k_miss / k_total if k_total else float("nan"),
                "V": 1 - v_miss / v_total if v_total else float("nan")}


def oracle_features(feat: torch.Tensor, true: torch.Tensor, num_layers: int, upto: int) -> torch.Tensor:
    """``feat`` with the true K/V moves at layers 1..``upto`` appended (scaled down to the features' order)."""
    k, v = split_moves(true, num_layers)  # [n, L, Hkv hd]
    return torch.cat([feat.float(), k[:, 1 : upto + 1].flatten(1) / 10, v[:, 1 : upto + 1].flatten(1) / 10], 1)


def readout_ms(num_tokens: int, num_features: int, num_outputs: int, rank: int | None, repeats: int = 21) -> float:
    """Median ms of a readout of ``num_tokens`` tokens on this machine's torch threads: [n, F] @ [F, D], or through
    rank r, ([n, F] @ [F, r]) @ [r, D] (random weights: only the time is read)."""
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(num_tokens, num_features, generator=gen)
    weights = [torch.randn(num_features, num_outputs, generator=gen)] if rank is None else \
        [torch.randn(num_features, rank, generator=gen), torch.randn(rank, num_outputs, generator=gen)]
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        out = x
        for w in weights:
            out = out @ w
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def main() -> None:
    ap = pool_parser(__doc__.splitlines()[0])
    ap.add_argument("--test-problems", type=int, default=20, help="also score this many GSM8K test problems (0: none)")
    ap.add_argument("--ratios", default="0.02,0.03", help="the shares given their true K/V in the band rows, a list")
    ap.add_argument("--ranks", default="64", help="the blend's readout also cut to these ranks, a comma list")
    ap.add_argument("--oracle-upto", default="3,6", help="the oracle rows' top true layers, a comma list")
    args, lm, _, capture = open_pool_study(ap)
    num_layers, rope = lm.config.num_layers, lm.model.rope
    anchors: RelayAnchorsMethod = get_method(f"relay_anchors[anchor_calls={args.pool_problems}]")
    pool = anchors._pool(lm)
    try:
        uptos = [int(u) for u in args.oracle_upto.split(",") if u]
        ratios = [float(r) for r in args.ratios.split(",") if r]
        ranks = [int(r) for r in args.ranks.split(",") if r]
    except ValueError as exc:
        ap.error(f"--oracle-upto, --ratios and --ranks take comma lists of numbers ({exc})")
    if not all(1 <= u < num_layers - 1 for u in uptos):
        ap.error(f"--oracle-upto: each must be in 1..{num_layers - 2} (the model has {num_layers} layers)")
    if args.test_problems and not args.workload.startswith("gsm8k"):
        ap.error("--test-problems reads GSM8K's test file: give a GSM8K workload or --test-problems 0")
    if not all(0 < r <= 1 for r in ratios) or not all(r >= 1 for r in ranks):
        ap.error("--ratios must be in (0, 1] and --ranks >= 1")

    def span_rows(call, store):
        """Per approximate span of a call with any: (load, role, features [n, F], true moves [n, 2 L Hkv hd]); and
        the call's reuse plan and fresh prefill."""
        scored = span_call(lm, call, store)
        if scored is None:
            return None
        reuse, full, fresh = scored
        dk, dv = moves(lm, call, store, reuse, fresh)  # [L, Hkv, m, hd]
        out, first = [], 0
        for load, role in zip(reuse.approx, anchors.roles(call, reuse.approx), strict=True):
            span, n = store.get(load.span_id), load.num_tokens
            keys = torch.stack([stored_keys_free(rope, span, load, "cpu", layer) for layer in FEAT_LAYERS])
            values = torch.stack([span.v[layer, :, load.src_start : load.src_end] for layer in FEAT_LAYERS])
            span_dk, span_dv = dk[:, :, first : first + n], dv[:, :, first : first + n]
            out.append((load, role, token_features(keys, values), span_dk, span_dv))
            first += n
        return reuse, full, out

    rows: dict[str, Rows] = {}

    def learn(call, store) -> None:
        got = span_rows(call, store)
        for load, role, feat, span_dk, span_dv in got[2] if got else ():
            pool.add(role, stored_keys_free(rope, store.get(load.span_id), load, pool.device, pool.match_layer),
                     span_dk, span_dv)
            rows.setdefault(role, Rows()).feat.append(feat.half())
            rows[role].moves.append(flat_moves(span_dk, span_dv).half())

    downstream_calls(lm, args.workload, None, args.pool_problems, capture, learn, "pool", True, args.pool_offset)
    ridges, oracles = {}, {}
    for role, r in rows.items():
        pool.freeze(role)
        feat, mv = r.cat()
        ridges[role] = fit_ridge(feat, mv, RIDGE_LAMBDA)
        for rank in ranks:
            ridges[role, rank] = low_rank(ridges[role], feat, rank)
        for upto in uptos:
            oracles[role, upto] = fit_ridge(oracle_features(feat, mv, num_layers, upto), mv, RIDGE_LAMBDA)
    rows.clear()  # the pool's rows are no longer needed: free them before scoring

    def score(data: str | None, offset: int, problems: int, desc: str) -> dict:
        explained: dict[str, dict[str, Explained]] = {}  # estimator -> role (and "all") -> sums
        kls: dict[str, list[float]] = {}
        span_tokens: list[int] = []  # per scored call

        def tally(name: str, role: str, true: torch.Tensor, est: torch.Tensor, from_layer: int = 1) -> None:
            for key in (role, "all"):
                explained.setdefault(name, {}).setdefault(key, Explained(from_layer)).add(true, est, num_layers)

        def on_call(call, store) -> None:
            got = span_rows(call, store)
            if got is None:
                return
            reuse, full, spans = got
            est: dict[str, list[torch.Tensor]] = {"anchors": [], "blend": [], **{f"blend r{r}": [] for r in ranks}}
            truth, residual = [], []
            for load, role, feat, span_dk, span_dv in spans:
                if role not in ridges:
                    raise SystemExit(f"role {role!r} of a scored call has no pool: the pool problems never taught it")
                true = flat_moves(span_dk, span_dv)
                keys_free = stored_keys_free(rope, store.get(load.span_id), load, pool.device, pool.match_layer)
                ak, av, res = pool.estimate_with_residual(role, keys_free, num_layers)
                knn, ridge = flat_moves(ak, av), ridges[role](feat)
                blend = BLEND * knn + (1 - BLEND) * ridge
                for name, e in (("anchors", knn), ("ridge", ridge), ("blend", blend)):
                    tally(name, role, true, e)
                for upto in uptos:
                    tally(f"anchors, layers {upto + 1} up", role, true, knn, upto + 1)
                    tally(f"ridge, layers {upto + 1} up", role, true, ridge, upto + 1)
                    tally(f"oracle: true layers 1-{upto}, scored {upto + 1} up", role, true,
                          oracles[role, upto](oracle_features(feat, true, num_layers, upto)), upto + 1)
                for rank in ranks:
                    cut = BLEND * knn + (1 - BLEND) * ridges[role, rank](feat)
                    tally(f"blend r{rank}", role, true, cut)
                    est[f"blend r{rank}"].append(cut)
                est["anchors"].append(knn)
                est["blend"].append(blend)
                truth.append(true)
                residual.append(res)
            true = torch.cat(truth)
            residual = torch.cat(residual)  # [m] over the call's span tokens
            span_tokens.append(residual.numel())
            for name, parts in est.items():
                for label, mask in ((name, None), *((f"{name} + top {r:g} true", top_mask(residual, r))
                                                    for r in ratios)):
                    flat = torch.cat(parts)
                    if mask is not None:
                        flat = torch.where(mask[:, None], true, flat)
                    k_move, v_move = unflat_moves(flat, num_layers, lm.config.head_dim)  # [L, Hkv, m, hd] each
                    k_move[0], v_move[0] = 0, 0  # layer 0's K/V depend on token and position only
                    logits = moved_logits(lm, call, store, reuse, k_move, v_move)
                    kls.setdefault(label, []).append(kl_first_token(full.logits, logits))

        downstream_calls(lm, args.workload, data, problems, capture, on_call, desc, True, offset)
        return {"explained": {name: {role: e.shares() for role, e in by_role.items()}
                              for name, by_role in explained.items()},
                "kl_first_token": {name: {"mean": sum(v) / len(v), "calls": v} for name, v in kls.items()},
                "span_tokens_median": statistics.median(span_tokens)}

    results = {"train": score(None, args.offset, args.problems, "train")}
    if args.test_problems:
        results["test"] = score(str(data_root() / "gsm8k" / "test_dev.jsonl"), 0, args.test_problems, "test")
    env = environment("cpu")  # before the timings set one thread
    num_tokens = round(statistics.median(r["span_tokens_median"] for r in results.values()))
    num_features = next(iter(ridges.values())).weight.shape[0]
    num_outputs = 2 * num_layers * lm.config.num_kv_heads * lm.config.head_dim
    torch.set_num_threads(1)  # as the bench's lanes run
    timing = {"span_tokens": num_tokens, "threads": 1,
              "full": readout_ms(num_tokens, num_features, num_outputs, None),
              **{f"rank {r}": readout_ms(num_tokens, num_features, num_outputs, r) for r in ranks}}
    Path(args.json).write_text(json.dumps({
        "model": lm.name, "workload": args.workload, "offset": args.offset, "problems": args.problems,
        "test_problems": args.test_problems, "pool_offset": args.pool_offset, "pool_problems": args.pool_problems,
        "ratios": ratios, "ranks": ranks, "feat_layers": FEAT_LAYERS, "ridge_lambda": RIDGE_LAMBDA, "blend": BLEND,
        "threads": args.threads, "environment": env, "readout_ms_a_call": timing, "results": results}, indent=1) + "\n")
    for split, res in results.items():
        for name, by_role in res["explained"].items():
            print(f"{split:5s} {name:45s} K {by_role['all']['K']:.3f}  V {by_role['all']['V']:.3f}")
        for name, kl in res["kl_first_token"].items():
            print(f"{split:5s} KL {name:42s} {kl['mean']:.5f}")
    print("readout ms a call:", timing)


if __name__ == "__main__":
    main()
