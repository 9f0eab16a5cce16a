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


# prometheus_client's process and platform collectors: documented in prose, not in the table (their meaning is
# prometheus_client's); process_* exist on Linux only
STANDARD = {"process_resident_memory_bytes": "gauge", "process_cpu_seconds_total": "counter",
            "process_open_fds": "gauge", "process_max_fds": "gauge", "process_virtual_memory_bytes": "gauge",
            "process_start_time_seconds": "gauge", "python_info": "gauge"}


def test_every_metric_is_documented_with_its_type_and_every_documented_one_exists():
    docs, everything = documented(), registered()
    registry = {name: kind for name, kind in everything.items() if name not in STANDARD}
    assert {name: everything.get(name) for name in STANDARD} == STANDARD  # the process's RSS, CPU, fds; Python's
    assert all(f"`{name}`" in DOCS.read_text() for name in STANDARD), "a process series docs/serving.md omits"
    assert len(docs) >= 40  # the table was found and read
    assert sorted(set(registry) - set(docs)) == [], "registered but not in docs/serving.md's table"
    assert sorted(set(docs) - set(registry)) == [], "in docs/serving.md's table but not registered"
    assert {name: kind for name, kind in docs.items() if registry[name] != kind} == {}, "documented type is wrong"


def test_the_page_says_which_build_model_and_method_a_replica_serves_and_its_process_memory():
    from fastapi.testclient import TestClient

    from kvrelay import __version__

    engine = Engine(load_model("random:tiny"), KVStore(1 << 24))
    catalog = SpanCatalog(engine.store, engine.lm.fingerprint)
    plain = create_app(engine, catalog, ServerSettings(method="prefix"))
    with TestClient(plain) as client:
        page = client.get("/metrics").text
    assert (f'kvrelay_build_info{{method="prefix",model="random:tiny",quality_ladder="",version="{__version__}"}} 1.0'
            in page)
    rss = plain.state.metrics.registry.get_sample_value("process_resident_memory_bytes")
    assert rss is not None and rss > 50 << 20  # this process holds torch: tens of MB at least
    guarded = create_app(engine, catalog, ServerSettings(quality=QualityConfig(ladder=LEARNING_LADDER)))
    labels = {"version": __version__, "model": "random:tiny", "method": "", "quality_ladder": "naive,kvcomm,prefix"}
    assert guarded.state.metrics.registry.get_sample_value("kvrelay_build_info", labels) == 1
