"""The ladder controller driven by synthetic quality streams (default config unless a test says otherwise)."""

from __future__ import annotations

import dataclasses
import math

from kvrelay.quality import QualityConfig, QualityGuard
from tests.quality.streams import Stream, constant, drive, noisy

GOOD = (0.001, True)
BAD = (0.4, False)


def guard(**changes) -> QualityGuard:
    return QualityGuard(dataclasses.replace(QualityConfig(), **changes))


def moves(g: QualityGuard, namespace: str = "ns", role: str = "agent") -> list[dict]:
    return g.snapshot(namespace)["roles"][role]["moves"]


def test_a_bad_cheap_rung_moves_up_and_stays():
    g = guard(start="naive")
    calls = drive(g, constant({"naive": BAD, "relay": GOOD, "prefix": (0.0, True)}), 400)
    cfg = g.config
    first_up = next(i for i, (rung, _) in enumerate(calls) if rung != "naive")
    assert first_up == cfg.early_break_samples  # clearly bad: judged early, not after min_samples
    # retries of naive back off (hold x 2^breaks: at most 4 in 400 calls), each costing early_break_samples calls
    naive_later = sum(rung == "naive" for rung, _ in calls[first_up:])
    assert naive_later <= 4 * cfg.early_break_samples
    assert sum(rung == "naive" for rung, _ in calls[200:]) <= cfg.early_break_samples
    assert calls[-1][0] == "relay"
    assert all(rung != "prefix" for rung, _ in calls)  # relay holds: never further up


def test_a_good_role_starts_safe_and_moves_down():
    g = guard(start=None)
    calls = drive(g, constant({"naive": GOOD, "relay": GOOD, "prefix": (0.0, True)}), 120)
    assert calls[0][0] == "prefix"
    cfg = g.config
    reached = next(i for i, (rung, _) in enumerate(calls) if rung == "naive")
    assert reached <= 2 * cfg.hold_calls  # one rung per hold
    assert all(rung == "naive" for rung, _ in calls[reached:])
    assert [m["reason"] for m in moves(g)] == ["inside", "inside"]


def test_a_new_role_starts_at_relay_by_default():
    g = guard()
    calls = drive(g, constant({"naive": BAD, "relay": GOOD, "prefix": (0.0, True)}), 60)
    assert calls[0][0] == "relay" and calls[-1][0] == "relay"


def test_a_bound_not_a_mean_decides():
    """A role certified at relay tries naive, whose KL is 0.04 on every call: its mean is inside the 0.05 target
    but, from a window of samples, its upper bound is not; the guard does not keep a role on a rung it moved it to
    and cannot certify."""
    g = guard()
    calls = drive(g, constant({"naive": (0.04, True), "relay": GOOD, "prefix": (0.0, True)}), 80)
    cfg = g.config
    first_naive = next(i for i, (rung, _) in enumerate(calls) if rung == "naive")
    assert [rung for rung, _ in calls[first_naive:first_naive + cfg.min_samples + 1]] == (
        ["naive"] * cfg.min_samples + ["relay"])
    est = g.snapshot("ns")["roles"]["agent"]["estimates"]["naive"]["first_token_kl"]
    assert est["mean"] < 0.05 < est["upper"]


def test_a_cheaper_rung_the_window_can_certify_gets_its_window():
    """naive at 0.025 nats on every call, agreeing: no valid bound certifies that under the 0.05 target from 16
    samples (the floor at 16 is 0.055 nats) but one can from 32 (floor 0.041). Judged at min_samples it would be
    refused whatever its samples show; the guard instead shadows every call at it until its upper bound certifies
    it (holding it meanwhile to the mean KL of those very calls), and keeps it."""
    g = guard()
    cfg = g.config
    calls = drive(g, constant({"naive": (0.025, True), "relay": GOOD, "prefix": (0.0, True)}), 200)
    first_naive = next(i for i, (rung, _) in enumerate(calls) if rung == "naive")
    assert first_naive <= cfg.hold_calls + 1
    assert all(rung == "naive" for rung, _ in calls[first_naive:])
    # every call at naive is shadowed, past first_calls_per_role, until the bound certifies it; then the sample rate
    streak = next(n for n, (_, shadowed) in enumerate(calls[first_naive:]) if not shadowed)
    assert cfg.first_calls_per_role < streak < cfg.window
    later = calls[first_naive + streak:]
    assert sum(shadowed for _, shadowed in later) <= len(later) // cfg.sample_every + 1
    naive = g.snapshot("ns")["roles"]["agent"]["estimates"]["naive"]["first_token_kl"]
    assert naive["mean"] < naive["upper"] <= 0.05  # certified, not kept on its mean


def test_a_window_that_cannot_certify_the_agreement_is_not_waited_for():
    """naive at 0.025 nats but disagreeing with full once in its first 16 calls: its KL alone could still be
    certified within the window, its agreement (15 of 16: a lower bound of 0.86 at 32 samples at that rate) could
    not, so the guard does not extend the trial: naive breaks at min_samples as a rung that cannot be certified."""
    def stream(i: int, rung: str) -> tuple[float, bool]:
        if rung == "naive":
            return 0.025, i != 20
        return {"relay": GOOD, "prefix": (0.0, True)}[rung]

    g = guard()
    cfg = g.config
    calls = drive(g, stream, 60)
    first_naive = next(i for i, (rung, _) in enumerate(calls) if rung == "naive")
    assert first_naive < 20 < first_naive + cfg.min_samples
    assert [rung for rung, _ in calls[first_naive:first_naive + cfg.min_samples + 1]] == (
        ["naive"] * cfg.min_samples + ["relay"])


def spiky(rung_name: str, base_kl: float, spike_kl: float) -> Stream:
    """``rung_name`` at ``base_kl`` nats with a spike to ``spike_kl`` every 16th call, agreeing with full on every
    call (the spike keeps top-1); relay at 0.002 nats otherwise."""
    def stream(i: int, rung: str) -> tuple[float, bool]:
        if rung == rung_name:
            return (spike_kl if i % 16 == 15 else base_kl), True
        return {"naive": BAD, "relay": (0.002, True), "prefix": (0.0, True)}[rung]
    return stream


def live_kl_after(calls: list[tuple[str, bool]], stream: Stream, first: int = 20) -> float:
    """The mean first-token KL of the calls after the ``first``-th, at the rungs they ran (what the target asks)."""
    kls = [stream(i, rung)[0] for i, (rung, _) in enumerate(calls)][first:]
    return sum(kls) / len(kls)


def test_a_rung_on_trial_is_held_to_its_unclipped_mean():
    """naive at 0.015 nats with a spike to 0.8-1.0 nats every 16th call: its first 16 calls average 0.064-0.077
    nats, over the target, but clipped at the bound's cap (0.25 nats) only 0.030. The target counts each call whole,
    so the open certificate does too: naive breaks at its 16th sample and the role meets the target after call 20
    (held to the clipped mean, naive ran calls 17-48 and the role sat at 0.067-0.080 nats)."""
    for spike_kl in (0.8, 1.0):
        g = guard()
        cfg = g.config
        stream = spiky("naive", 0.015, spike_kl)
        calls = drive(g, stream, 50)
        at_naive = [i for i, (rung, _) in enumerate(calls) if rung == "naive"]
        assert at_naive[0] == cfg.hold_calls and len(at_naive) == cfg.min_samples
        assert moves(g)[1]["reason"] == "break"
        assert live_kl_after(calls, stream) <= 0.05


def test_the_start_rung_is_held_to_its_unclipped_mean():
    """The trusted start rung is held to its window's mean KL, and that mean counts each call whole: relay at
    0.015 nats with a spike to 0.8 nats every 16th call is at 0.064 nats over its first 16 calls and moves to
    prefix (clipped, 0.030 nats, it stayed for good at 0.064 nats)."""
    g = guard()
    cfg = g.config
    stream = spiky("relay", 0.015, 0.8)
    calls = drive(g, stream, 60)
    assert [rung for rung, _ in calls[:cfg.min_samples + 1]] == ["relay"] * cfg.min_samples + ["prefix"]
    assert live_kl_after(calls, stream) <= 0.05


def test_an_open_certificate_closes_with_a_full_window():
    """naive alternating 0 and 0.064 nats (mean 0.032): a steady full window at that mean could be certified
    (0.0489), so its certificate stays open past 16 samples, every call shadowed; but with its spread the bound at
    32 samples is 0.051, over the target, and the full window closes the certificate: naive breaks at its 32nd
    sample, and each later trial costs at most a window of shadowed calls."""
    def stream(i: int, rung: str) -> tuple[float, bool]:
        if rung == "naive":
            return (0.064 if i % 2 else 0.0), True
        return {"relay": (0.002, True), "prefix": (0.0, True)}[rung]

    g = guard()
    cfg = g.config
    num_calls = 1000
    calls = drive(g, stream, num_calls)
    assert [m["reason"] for m in moves(g)[:2]] == ["inside", "break"]
    assert moves(g)[1]["at_call"] - moves(g)[0]["at_call"] == cfg.window
    num_trials = sum(m["to"] == "naive" for m in moves(g))
    assert num_trials <= math.log2(num_calls / cfg.hold_calls)  # backed off: hold x 2^breaks
    assert sum(shadowed for _, shadowed in calls) <= num_trials * cfg.window + num_calls // cfg.sample_every + 16
    assert sum(rung == "naive" for rung, _ in calls) <= num_trials * cfg.window


def test_a_rung_no_full_window_can_certify_breaks_when_judged():
    """naive at a constant 0.034 nats: a full window of it has the bound 0.0507, over the target (no valid bound
    could do better than 0.049), so its certificate is closed from the start and each trial costs min_samples
    calls, not a window."""
    g = guard()
    cfg = g.config
    calls = drive(g, constant({"naive": (0.034, True), "relay": (0.002, True), "prefix": (0.0, True)}), 300)
    trials = [m for m in moves(g) if m["from"] == "naive"]
    assert trials and all(m["reason"] == "break" for m in trials)
    starts = [m["at_call"] for m in moves(g) if m["to"] == "naive"]
    lengths = [end["at_call"] - start for start, end in zip(starts[:len(trials)], trials, strict=True)]
    assert lengths == [cfg.min_samples] * len(trials)
    assert sum(rung == "naive" for rung, _ in calls) <= cfg.min_samples * len(starts)


def test_the_trusted_start_rung_is_sampled_at_the_sample_rate():
    """relay, the trusted start rung, alternating 0 and 0.064 nats: its upper bound stays over the target and a
    steady full window could certify it, but it is held to its mean, not to a certificate, so after its first
    calls it is shadowed at the sample rate only."""
    def stream(i: int, rung: str) -> tuple[float, bool]:
        return {"naive": BAD, "relay": ((0.064 if i % 2 else 0.0), True), "prefix": (0.0, True)}[rung]

    g = guard()
    cfg = g.config
    num_calls = 200
    calls = drive(g, stream, num_calls)
    assert {rung for rung, _ in calls} == {"relay"}
    later = num_calls - cfg.first_calls_per_role
    assert sum(shadowed for _, shadowed in calls) <= cfg.first_calls_per_role + later // cfg.sample_every + 1


def test_the_start_rung_breaks_only_when_refuted():
    """relay at 0.04 on every call: inside the target, but no valid bound certifies that from 16-32 samples. As
    the start rung it stays (nothing refutes it); without ``trust_start`` it would move to prefix at min_samples."""
    stream = constant({"naive": BAD, "relay": (0.04, True), "prefix": (0.0, True)})
    trusted = guard()
    assert {rung for rung, _ in drive(trusted, stream, 200)} == {"relay"}
    strict = guard(trust_start=False)
    calls = drive(strict, stream, 40)
    assert [rung for rung, _ in calls[:strict.config.min_samples + 1]] == (
        ["relay"] * strict.config.min_samples + ["prefix"])


def test_a_refuted_start_rung_breaks():
    """The start rung's own traffic refutes it: KL clearly over the target (on its KL lower bound, from a few
    samples), or top-1 agreement confidently under the target (at min_samples)."""
    cfg = QualityConfig()
    over = guard()
    calls = drive(over, noisy({"naive": (0.5, 0.5), "relay": (0.15, 1.0), "prefix": (0.0, 1.0)}, seed=2), 60)
    up = next(i for i, (rung, _) in enumerate(calls) if rung == "prefix")
    assert cfg.early_break_samples <= up < cfg.min_samples
    disagrees = guard()
    calls = drive(disagrees, constant({"naive": BAD, "relay": (0.001, False), "prefix": (0.0, True)}), 40)
    assert [rung for rung, _ in calls[:cfg.min_samples + 1]] == ["relay"] * cfg.min_samples + ["prefix"]


def test_a_start_rung_that_broke_is_held_to_its_upper_bound_when_returned_to():
    """relay breaks at the start (0.15 nats), the role moves to prefix, and relay then sits at 0.04 on every call:
    its mean is inside the target but its bound is not. The guard moved the role back to relay, so relay is no longer
    trusted on the shipped tables' word: it breaks again at min_samples (trusted, it would stay for good)."""
    def stream(i: int, rung: str) -> tuple[float, bool]:
        if rung == "relay":
            return (0.15, True) if i < 8 else (0.04, True)
        return {"naive": BAD, "prefix": (0.0, True)}[rung]

    g = guard()
    calls = drive(g, stream, 200)
    cfg = g.config
    assert moves(g)[0]["reason"] == "break" and moves(g)[0]["at_call"] < cfg.min_samples
    back = moves(g)[1]
    assert (back["from"], back["to"], back["reason"]) == ("prefix", "relay", "inside")
    at = back["at_call"]
    assert [rung for rung, _ in calls[at:at + cfg.min_samples + 1]] == ["relay"] * cfg.min_samples + ["prefix"]
    assert moves(g)[2]["reason"] == "break"
    assert sum(rung == "relay" for rung, _ in calls[at + cfg.min_samples:]) <= cfg.min_samples  # backed off


def test_moves_down_only_when_well_inside_the_target():
    """relay at a KL whose bound is under the target but not under margin x target: the role stays there."""
    g = guard(start="relay", window=16)
    drive(g, constant({"naive": GOOD, "relay": (0.015, True), "prefix": (0.0, True)}), 200)
    est = g.snapshot("ns")["roles"]["agent"]["estimates"]["relay"]["first_token_kl"]
    assert 0.8 * 0.05 < est["upper"] <= 0.05
    assert moves(g) == []


def test_noise_near_the_target_does_not_flap():
    """naive a little over the target and relay a little under it, with heavy-tailed noise: the number of moves
    stays small (the back-off doubles the hold at each break), far below one per hold."""
    g = guard(start="relay")
    stream = noisy({"naive": (0.06, 0.9), "relay": (0.01, 0.97), "prefix": (0.0, 1.0)}, seed=3)
    num_calls = 1000
    drive(g, stream, num_calls)
    assert len(moves(g)) <= 12
    assert len(moves(g)) < num_calls / g.config.hold_calls / 4


def test_the_same_stream_gives_the_same_decisions():
    stream = noisy({"naive": (0.05, 0.9), "relay": (0.02, 0.95), "prefix": (0.0, 1.0)}, seed=7)
    runs = []
    for _ in range(2):
        g = guard()
        runs.append((drive(g, stream, 300), moves(g), g.snapshot("ns")))
    assert runs[0] == runs[1]
    assert runs[0][1]  # something moved, so the comparison says something


def test_one_namespace_never_moves_another():
    g = guard(start="naive")
    bad = constant({"naive": BAD, "relay": GOOD, "prefix": (0.0, True)})
    good = constant({"naive": GOOD, "relay": GOOD, "prefix": (0.0, True)})
    for i in range(60):  # interleaved: the same role name in two tenants
        for namespace, stream in (("tenant-a", bad), ("tenant-b", good)):
            rung = g.rung_for(namespace, "agent")
            if g.should_shadow(namespace, "agent"):
                kl, agree = stream(i, rung.name)
                g.record(namespace, "agent", rung.name, kl, agree, None, 1.0)
    assert g.snapshot("tenant-a")["roles"]["agent"]["rung"] == "relay"
    b = g.snapshot("tenant-b")["roles"]["agent"]
    assert b["rung"] == "naive" and b["moves"] == []
    alone = guard(start="naive")  # tenant-b's traffic without tenant-a's: the very same state
    drive(alone, good, 60, namespace="tenant-b")
    assert alone.snapshot("tenant-b") == g.snapshot("tenant-b")
    assert "tenant-a" not in str(g.snapshot("tenant-b")) and g.snapshot("nobody")["roles"] == {}
    agg = g.aggregates()
    assert "tenant" not in str(agg) and "agent" not in str(agg)
    assert agg["roles_per_rung"] == {"naive": 1, "relay": 1, "prefix": 0}


def test_target_off_is_inert():
    g = guard(target=None, start="naive")
    calls = drive(g, constant({"naive": BAD, "relay": BAD, "prefix": BAD}), 50)
    assert calls == [("naive", False)] * 50
    assert g.snapshot("ns")["roles"] == {} and g.aggregates()["num_samples"] == 0


def test_safest_rung_breaking_stays_there():
    g = guard(start=None)
    calls = drive(g, constant({"naive": BAD, "relay": BAD, "prefix": BAD}), 40)
    assert {rung for rung, _ in calls} == {"prefix"} and moves(g) == []


def test_a_named_method_is_estimated_but_moves_nothing():
    g = guard(start="naive")
    for _ in range(20):
        g.rung_for("ns", "agent")
        g.record("ns", "agent", "epic[k=8]", 0.5, False, 0.3, 2.0)
    role = g.snapshot("ns")["roles"]["agent"]
    assert role["rung"] == "naive" and role["moves"] == []
    assert role["estimates"]["epic[k=8]"]["num_samples"] == 20
    assert role["estimates"]["epic[k=8]"]["continuation_kl"]["mean"] == 0.3
