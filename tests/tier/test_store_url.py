"""``--store`` URLs that name a Redis database as redis-py reads it are accepted as they were; a database path that
is no number is refused (tests/server/test_cli.py has the refusals)."""

from __future__ import annotations

import pytest

from kvrelay.tier.store_url import parse_store_url


@pytest.mark.parametrize("url", ["redis://127.0.0.1:6379/3", "redis://127.0.0.1:6379", "redis://127.0.0.1:6379/",
                                 "rediss://user:pw@host:6380/0", "unix:///tmp/redis.sock?db=2"])
def test_a_redis_url_with_a_numbered_database_or_none_is_accepted(url):
    assert parse_store_url(url).kind == "redis" and parse_store_url(url).location == url
