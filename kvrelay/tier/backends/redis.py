"""A Redis server as the shared tier (redis-py).

A span is two keys, ``<key>:v`` (the encoded span) and ``<key>:m`` (its metadata), written in one
MULTI/EXEC so a reader sees both or neither. Announcements go to a Redis stream per namespace and
model (XADD, capped by MAXLEN), which readers poll with XREAD from their last entry id: unlike
pub/sub, nothing is lost while a reader is busy or reconnecting. The server bounds the tier itself
(``maxmemory`` with an LRU policy); an evicted part of a span (value, metadata, a chunk) is a miss.
Values over ``chunk_bytes`` are split into chunk keys: Redis caps one value (512 MB by default)
and serves one client at a time, so one huge value would stall every other client meanwhile.

A stream entry without a message is a bad record: skipped and counted in ``num_bad_records``; the cursor moves past
it, so it never stops the entries after it. A chunk count that cannot be one (past ``MAX_CHUNKS``) is no request for
that many keys: the head is returned as the value, a corrupt one (the tiered store's miss, counted there).
"""

from __future__ import annotations

import redis

from kvrelay.errors import ConfigError
from kvrelay.tier.backends.base import TierRefusedError, redact

PREFIX = "kvrelay:"
CHUNKED = b"KVRCHUNK"  # a value stored in chunks: this marker and the chunk count (a span starts "KVRSPAN1")
MAX_CHUNKS = 1 << 16  # more chunks than this is a corrupt count, not a span (1 TiB at the default chunk size)


class RedisBackend:
    kind = "redis"  # what /health and the metrics call this tier

    def __init__(self, url: str, timeout_s: float = 1.0, ttl_s: int | None = None,
                 max_announcements: int = 100_000, chunk_bytes: int = 16 << 20, client=None) -> None:
        self.url = redact(url)
        self.ttl_s, self.max_announcements, self.chunk_bytes = ttl_s, max_announcements, chunk_bytes
        if client is None:
            try:
                client = redis.Redis.from_url(url, socket_timeout=timeout_s, socket_connect_timeout=timeout_s)
            except ValueError as e:
                raise ConfigError(f"bad Redis URL {self.url!r}: {redact(str(e))}") from None
        self.client = client
        self.num_bad_records = 0  # stream entries and chunk counts skipped as unreadable

    def put(self, key: str, value: bytes, meta: bytes) -> None:
        vkey = PREFIX + key + ":v"
        pipe = self.client.pipeline(transaction=True)
        if len(value) <= self.chunk_bytes:
            pipe.set(vkey, value, ex=self.ttl_s)
        else:
            view = memoryview(value)
            num_chunks = -(-len(value) // self.chunk_bytes)
            for i in range(num_chunks):
                pipe.set(f"{vkey}:{i}", view[i * self.chunk_bytes : (i + 1) * self.chunk_bytes], ex=self.ttl_s)
            pipe.set(vkey, CHUNKED + str(num_chunks).encode(), ex=self.ttl_s)
        pipe.set(PREFIX + key + ":m", meta, ex=self.ttl_s)
        try:
            pipe.execute()
        except redis.ResponseError as e:  # the server is up but refuses (out of memory, value too large)
            raise TierRefusedError(f"Redis refused to store a {len(value)}-byte span: {e}") from None

    def get_meta(self, key: str) -> bytes | None:
        return self.client.get(PREFIX + key + ":m")

    @staticmethod
    def _num_chunks(head: bytes | None) -> int | None:
        """The chunk count a chunked value's head holds (None: not chunked; -1: a count that cannot be one)."""
        if head is None or not head.startswith(CHUNKED):
            return None
        digits = head[len(CHUNKED):]
        return int(digits) if digits.isdigit() and 0 < len(digits) <= 6 and int(digits) <= MAX_CHUNKS else -1

    def get_value(self, key: str) -> bytes | bytearray | None:
        vkey = PREFIX + key + ":v"
        head = self.client.get(vkey)
        num_chunks = self._num_chunks(head)
        if num_chunks is None:
            return head
        if num_chunks < 0:  # not a count: the head itself is the value, which then decodes as a corrupt one
            return head
        parts = self.client.mget([f"{vkey}:{i}" for i in range(num_chunks)])
        if any(p is None for p in parts):
            return None  # a chunk was evicted
        return bytearray().join(parts)  # a bytearray: decoding takes it over without another copy

    def touch(self, key: str) -> bool:
        # TOUCH and GETRANGE both count as a use for the LRU (EXISTS does not): a record read often stays
        vkey = PREFIX + key + ":v"
        pipe = self.client.pipeline(transaction=False)
        pipe.touch(PREFIX + key + ":m", vkey)
        pipe.getrange(vkey, 0, len(CHUNKED) + 6 - 1)  # a chunked value's head: marker and up to 6 digits
        num_there, head = pipe.execute()
        if num_there != 2:
            return False
        num_chunks = self._num_chunks(head)
        if num_chunks is None or num_chunks < 0:  # whole, or a corrupt count (the read then finds it corrupt)
            return True
        return self.client.touch(*(f"{vkey}:{i}" for i in range(num_chunks))) == num_chunks

    def delete(self, key: str) -> None:
        vkey = PREFIX + key + ":v"
        num_chunks = max(self._num_chunks(self.client.get(vkey)) or 0, 0)
        self.client.delete(PREFIX + key + ":m", vkey, *(f"{vkey}:{i}" for i in range(num_chunks)))

    def announce(self, channel: str, message: bytes) -> None:
        self.client.xadd(PREFIX + channel, {b"m": message}, maxlen=self.max_announcements, approximate=True)

    def poll(self, channel: str, cursor: str | None) -> tuple[list[bytes], str | None]:
        reply = self.client.xread({PREFIX + channel: cursor or "0-0"}, count=10_000)
        messages = []
        for _stream, entries in reply or ():
            for entry_id, fields in entries:
                cursor = entry_id.decode() if isinstance(entry_id, bytes) else entry_id
                message = fields.get(b"m") if isinstance(fields, dict) else None
                if isinstance(message, bytes):
                    messages.append(message)
                else:  # not one of ours: past it, counted
                    self.num_bad_records += 1
        return messages, cursor

    def ping(self) -> None:
        self.client.ping()  # a wrong password or a paused server raises here too

    def close(self) -> None:
        self.client.close()
