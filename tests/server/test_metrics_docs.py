"""docs/serving.md's metrics table against the registry of a server with every metric on (the quality guard with a
learning rung): each registered family is documented, with its type, and each documented one exists."""

from __future__ import annotations

import re
from pathlib import Path

from kvrelay.cache.store import KVStore
from kvrelay.engine import Engine
from kvrelay.quality import QualityConfig, Rung
from kvrelay.server.app import ServerSettings, create_app
from kvrelay.server.catalog import SpanCatalog
from kvrelay.weights.loader import load_model

DOCS = Path(__file__).resolve().parents[2] / "docs" / "serving.md"
ROW = re.compile(r"^\| `(kvrelay_\w+)` \| (counter|gauge|histogram) \|([^|]*)\| [^|]+ \|$")
LEARNING_LADDER = (Rung("naive", "naive"), Rung("kvcomm", "kvcomm"), Rung("prefix", "prefix"))


def documented() -> dict[str, str]:
    rows = {}
    for line in DOCS.read_text().splitlines():
        if line.startswith("| `kvrelay_"):
            match = ROW.match(line)
            assert match, f"a metrics row the table's format does not fit: {line}"
            assert match.group(1) not in rows, f"documented twice: {match.group(1)}"
            rows[match.group(1)] = match.group(2)
    return rows


def registered() -> dict[str, str]:
    """Names as they appear on the page: a counter's with ``_total``."""
    engine = Engine(load_model("random:tiny"), KVStore(1 << 24))
    app = create_app(engine, SpanCatalog(engine.store, engine.lm.fingerprint),
                     ServerSettings(quality=QualityConfig(ladder=LEARNING_LADDER)))
    return {f.name + ("_total" if f.type == "counter" else ""): f.type
            for f in app.state.metrics.registry.collect()}


def test_every_metric_is_documented_with_its_type_and_every_documented_one_exists():
    docs, registry = documented(), registered()
    assert len(docs) >= 40  # the table was found and read
    assert sorted(set(registry) - set(docs)) == [], "registered but not in docs/serving.md's table"
    assert sorted(set(docs) - set(registry)) == [], "in docs/serving.md's table but not registered"
    assert {name: kind for name, kind in docs.items() if registry[name] != kind} == {}, "documented type is wrong"
