"""Two server catalogs on one shared tier: spans and returned completions published by one replica are
found by the other (its token index and its output registry), within the same namespace only."""

import torch

from kvrelay.cache.kv import StoredSpan
from kvrelay.server.catalog import MatchConfig, SpanCatalog
from kvrelay.tier.tiered import open_store


def _decode(ids: list[int]) -> str:
    return "".join(f"<{i}>" for i in ids)


def _span(token_ids: tuple[int, ...]) -> StoredSpan:
    k = torch.randn(2, 1, len(token_ids), 4, generator=torch.Generator().manual_seed(len(token_ids)))
    return StoredSpan(token_ids, 0, k, k + 1, "fp")


def test_a_replica_learns_the_others_spans_and_completions(tmp_path):
    url = f"disk:{tmp_path / 'tier'}"
    match = MatchConfig(min_match_tokens=4)
    a = SpanCatalog(open_store(url, 1 << 24, fingerprint="fp"), "fp", block_len=4, match=match, decode=_decode)
    b = SpanCatalog(open_store(url, 1 << 24, fingerprint="fp"), "fp", block_len=4, match=match, decode=_decode)
    prompt, output = tuple(range(20, 26)), tuple(range(40, 50))
    span_id = a.new_span_id(len(prompt))
    assert span_id != b.new_span_id(len(prompt))  # replicas never reuse each other's ids
    a.put("team", span_id, _span(prompt + output))
    assert b.learn_published("other-team") == 0  # another namespace learns nothing
    assert b.learn_published("team") == 1
    assert span_id in b.index
    (hit,) = b.registry.find("quoted: " + _decode(list(output)) + " done", "team")
    assert (hit.output.span_id, hit.output.src_start, hit.output.output_ids) == (span_id, len(prompt), output)
    assert b.registry.find(_decode(list(output)), "other-team") == []
    assert b.owns("team", span_id)  # a lookup fetches it from the tier
