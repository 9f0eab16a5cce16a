"""docs/tier.md's Redis keys, against a real redis-server: every key the tier writes (spans whole and chunked, their
announcements, stored responses) has a documented name and type, every documented name is written, and the
documented ACL user (``~kvrelay:*`` and its commands) runs all of it without a refusal."""

from __future__ import annotations

import logging
import re
from pathlib import Path

import torch

from kvrelay.cache.kv import StoredSpan
from kvrelay.tier.backends.redis import RedisBackend
from kvrelay.tier.records import TierRecords
from kvrelay.tier.tiered import TieredStore

DOCS = Path(__file__).resolve().parents[2] / "docs" / "tier.md"
ROW = re.compile(r"^\s*\| `(kvrelay:[^`]+)` \| (string|stream) \|")
PLACEHOLDERS = {"<ns>": "[0-9a-f]{16}", "<model>": "[0-9a-f]{16}", "<span>": "[0-9a-f]{32}", "<id>": "[0-9a-f]{32}",
                "<i>": "[0-9]+"}
PASSWORD = "test-only-password"


def documented_keys() -> dict[re.Pattern, str]:
    """Each documented key as a regular expression, with its Redis type."""
    out = {}
    for line in DOCS.read_text().splitlines():
        match = ROW.match(line)
        if match:
            pattern = re.escape(match.group(1))
            for name, regex in PLACEHOLDERS.items():
                pattern = pattern.replace(re.escape(name), regex)
            out[re.compile(pattern + "$")] = match.group(2)
    return out


def documented_acl() -> list[str]:
    (line,) = [line.strip() for line in DOCS.read_text().splitlines() if line.strip().startswith("ACL SETUSER")]
    return line.replace("PASSWORD", PASSWORD).split()


def span(n: int) -> StoredSpan:
    k = torch.randn(2, 2, n, 8, generator=torch.Generator().manual_seed(n))
    return StoredSpan(tuple(range(n)), 0, k, k + 1, "fp-keys")


def test_every_key_is_documented_and_the_documented_acl_user_runs_the_tier(redis_server, redis_url, caplog):
    admin = redis_server.client()
    admin.execute_command(*documented_acl())
    as_user = redis_url.replace("redis://", f"redis://kvrelay:{PASSWORD}@")
    with caplog.at_level(logging.WARNING, logger="kvrelay.tier"):
        writer = TieredStore(1 << 24, RedisBackend(as_user, chunk_bytes=4096), "fp-keys")
        writer.put("small", span(4))  # ~600 bytes: whole
        writer.put("big", span(64))  # ~16 KB: chunks
        records = TierRecords(writer.backend, writer.health, "resp", 1 << 20)
        assert records.put("team", "resp_1", {"text": "x" * 10_000})  # chunked too
        assert records.put("team", "resp_2", {"text": "short"})
        reader = TieredStore(1 << 24, RedisBackend(as_user), "fp-keys")
        assert "small" in reader and torch.equal(reader.get("big").v, span(64).v)
        assert [p.span_id for p in reader.poll_published()] == ["small", "big"]
        reader_records = TierRecords(reader.backend, reader.health, "resp", 1 << 20)
        assert reader_records.get("team", "resp_1") == {"text": "x" * 10_000}
        assert reader_records.exists("team", "resp_2")
        keys = {k.decode(): admin.type(k).decode() for k in admin.keys("*")}  # before the deletes
        assert reader_records.delete("team", "resp_2") and not reader_records.exists("team", "resp_2")
        assert writer.delete_from_tier("small")
    assert writer.health.num_failures == reader.health.num_failures == 0
    assert caplog.records == []  # no refusal: the ACL allows every command the tier sends
    documented = documented_keys()
    assert len(documented) == 7  # the table was found and read
    undocumented = [k for k in keys if not any(p.match(k) for p in documented)]
    assert undocumented == []
    assert [p.pattern for p in documented if not any(p.match(k) for k in keys)] == []  # each one is written
    assert {(k, t) for k, t in keys.items() for p, want in documented.items() if p.match(k) and t != want} == set()
    assert all(k.startswith("kvrelay:") for k in keys)
