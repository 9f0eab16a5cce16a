"""A Redis server as the shared tier (redis-py).

A span is two keys, ``<key>:v`` (the encoded span) and ``<key>:m`` (its metadata), written in one
MULTI/EXEC so a reader sees both or neither. Announcements go to a Redis stream per namespace and
model (XADD, capped by MAXLEN), which readers poll with XREAD from their last entry id: unlike
pub/sub, nothing is lost while a reader is busy or reconnecting. The server bounds the tier itself
(``maxmemory`` with an LRU policy); an evicted half of a span (value without metadata or the other
way round) is a miss.
"""

from __future__ import annotations

from kvrelay.cache.backends.base import redact
from kvrelay.errors import ConfigError

PREFIX = "kvrelay:"


class RedisBackend:
    def __init__(self, url: str, timeout_s: float = 1.0, ttl_s: int | None = None,
                 max_announcements: int = 100_000, client=None) -> None:
        self.url = redact(url)
        self.ttl_s, self.max_announcements = ttl_s, max_announcements
        if client is None:
            import redis

            try:
                client = redis.Redis.from_url(url, socket_timeout=timeout_s, socket_connect_timeout=timeout_s)
            except ValueError as e:
                raise ConfigError(f"bad Redis URL {self.url!r}: {redact(str(e))}") from None
        self.client = client

    def put(self, key: str, value: bytes, meta: bytes) -> None:
        pipe = self.client.pipeline(transaction=True)
        pipe.set(PREFIX + key + ":v", value, ex=self.ttl_s)
        pipe.set(PREFIX + key + ":m", meta, ex=self.ttl_s)
        pipe.execute()

    def get_meta(self, key: str) -> bytes | None:
        return self.client.get(PREFIX + key + ":m")

    def get_value(self, key: str) -> bytes | None:
        return self.client.get(PREFIX + key + ":v")

    def delete(self, key: str) -> None:
        self.client.delete(PREFIX + key + ":m", PREFIX + key + ":v")

    def announce(self, channel: str, message: bytes) -> None:
        self.client.xadd(PREFIX + channel, {b"m": message}, maxlen=self.max_announcements, approximate=True)

    def poll(self, channel: str, cursor: str | None) -> tuple[list[bytes], str | None]:
        reply = self.client.xread({PREFIX + channel: cursor or "0-0"}, count=10_000)
        messages = []
        for _stream, entries in reply or ():
            for entry_id, fields in entries:
                messages.append(fields[b"m"])
                cursor = entry_id.decode() if isinstance(entry_id, bytes) else entry_id
        return messages, cursor

    def close(self) -> None:
        self.client.close()
