"""A learning rung in the ladder of a real server (random:tiny, in process): the role starts at the safest rung, its
shadows teach kvcomm with no warm-up flag, and the role's kvcomm call then reuses where an untaught one falls back."""

from __future__ import annotations

import httpx
import pytest

from kvrelay.cache.tenancy import key_namespace
from kvrelay.quality import DEFAULT_LADDER, QualityConfig, Rung
from tests.server.conftest import MODEL
from tests.server.live import LiveServer

# the gate open (random:tiny's texts are all about equally far apart, a tie) and anchors of any length counted (the
# quoted texts differ in length): what is tested is where the anchors come from
KVCOMM = "kvcomm[gamma=1.0,short_anchors=true]"
LEARNING = (Rung("naive", "naive"), Rung("kvcomm", KVCOMM), Rung("prefix", "prefix"))
QUESTIONS = ["Tom has 3 apples and buys 4 more at the market on Monday morning. How many apples does he have now?",
             "A train leaves at noon and travels 60 miles per hour for 3 hours without stopping. How far does it go?",
             "Sara reads 12 pages a day for a whole week and then 5 more pages on Sunday. How many pages in all?",
             "A box holds 6 rows of 8 eggs each and 7 of the eggs are broken on the way home. How many are whole?"]


def _round(srv: LiveServer, k: int, method: str | None = None) -> dict:
    """A solver answers question ``k``; the critic (the role under test) reviews the quoted answer."""
    client = srv.client()
    answer = client.chat.completions.create(
        model=MODEL, messages=[{"role": "system", "content": "You solve."}, {"role": "user", "content": QUESTIONS[k]}],
        max_tokens=8, temperature=0, extra_headers={"x-kvrelay-agent": "solver"}).choices[0].message.content
    extra = {"kvrelay": {"method": method}} if method else None
    r = client.chat.completions.create(
        model=MODEL, messages=[{"role": "system", "content": "You review."},
                               {"role": "user", "content": f"Problem:\n{QUESTIONS[k]}\n\nAnswer:\n{answer}"}],
        max_tokens=4, temperature=0, extra_headers={"x-kvrelay-agent": "critic"}, extra_body=extra)
    srv.wait_until(lambda: srv.worker.shadows.num_pending == 0, "the shadow references recorded")
    return r.model_extra["kvrelay"]


@pytest.mark.parametrize("ladder", [LEARNING, DEFAULT_LADDER], ids=["kvcomm-rung", "default"])
def test_the_role_shadows_teach_its_kvcomm_rung_with_no_warm_up(ladder):
    srv = LiveServer(quality=QualityConfig(ladder=ladder, start=None))
    try:
        for k in range(3):
            assert _round(srv, k)["quality"] == {"role": "critic", "rung": "prefix"}  # it starts safe
        kvcomm = srv.worker.engine.method(KVCOMM)
        lessons = srv.worker.shadows.teacher.num_taught
        pooled = {key: len(p.anchors) for key, p in kvcomm.pools.items() if key_namespace(key) == ""}
        ext = _round(srv, 3, method=KVCOMM)
        assert ext["method"] == "kvcomm"
        if ladder is LEARNING:
            assert lessons == 3, pooled  # the critic's 3 calls, all shadowed (the solver's read no span: no lesson)
            assert pooled == {"critic/input0": 3}  # the question, found in the solver's prompt: one anchor a shadow
            assert ext["fallback"] is None and ext["num_reused_tokens"] > 0
        else:
            assert lessons == 0 and pooled == {}
            assert "0 of 2 anchors" in ext["fallback"]
        metrics = httpx.get(f"{srv.url}/metrics", timeout=10).text
        assert ("kvrelay_quality_shadow_lessons_total" in metrics) == (ladder is LEARNING)  # a learning rung's only
    finally:
        srv.stop()
