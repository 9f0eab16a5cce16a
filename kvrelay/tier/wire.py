"""A stored span as bytes, for the shared tier (disk files, Redis values).

Layout::

    MAGIC (8 bytes) | header length (u32 LE) | header (JSON, utf-8) | payload | sha256 of all before (32)

The header names the span (id, namespace, model fingerprint), its token ids and original
positions, and every tensor (name, dtype, shape, offset, bytes) laid end to end in the payload:
``k``, ``v`` and ``hidden.<layer>``. The trailing checksum covers header and payload, so a truncated
or corrupt value is detected before any tensor is built: it decodes to a ``WireError``, never to
wrong KV. Decoding also checks that the value is the span that was asked for (id, namespace,
fingerprint), so a key collision or a value copied under another key is a miss too.
"""

from __future__ import annotations

import hashlib
import json
import struct
from dataclasses import dataclass

import torch

from kvrelay.cache.kv import StoredSpan
from kvrelay.errors import KvRelayError

MAGIC = b"KVRSPAN1"
_DIGEST_BYTES = 32
_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16, "float64": torch.float64}
_DTYPE_NAMES = {v: k for k, v in _DTYPES.items()}


class WireError(KvRelayError):
    """A span value that cannot be trusted: truncated, corrupt, of another model or another span."""


@dataclass(frozen=True)
class SpanMeta:
    """What the cost model needs to know about a span in the tier, without fetching its tensors."""

    span_id: str
    namespace: str
    fingerprint: str
    num_tokens: int
    num_layers: int
    start_pos: int
    value_bytes: int  # size of the encoded value (what a fetch moves)

    def to_bytes(self) -> bytes:
        return json.dumps(self.__dict__, separators=(",", ":")).encode()

    @classmethod
    def from_bytes(cls, raw: bytes) -> SpanMeta:
        try:
            d = json.loads(raw)
            meta = cls(str(d["span_id"]), str(d["namespace"]), str(d["fingerprint"]), int(d["num_tokens"]),
                       int(d["num_layers"]), int(d["start_pos"]), int(d["value_bytes"]))
        except (ValueError, KeyError, TypeError) as e:
            raise WireError(f"span metadata cannot be parsed ({e.__class__.__name__}: {e})") from None
        if min(meta.num_tokens, meta.num_layers, meta.start_pos, meta.value_bytes) < 0:
            raise WireError(f"span metadata has negative sizes: {meta}")
        return meta


def _tensor_bytes(t: torch.Tensor) -> memoryview:
    return memoryview(t.detach().to("cpu").contiguous().view(torch.uint8).numpy()).cast("B")


def encode_span(span: StoredSpan, span_id: str, namespace: str) -> tuple[bytes, SpanMeta]:
    """The span's value and its metadata."""
    if span.k.dtype not in _DTYPE_NAMES:
        raise WireError(f"span {span_id!r}: dtype {span.k.dtype} cannot be stored in the shared tier")
    named = [("k", span.k), ("v", span.v)] + [(f"hidden.{layer}", h) for layer, h in sorted(span.hidden.items())]
    tensors, parts, offset = [], [], 0
    for name, t in named:
        raw = _tensor_bytes(t)
        tensors.append({"name": name, "dtype": _DTYPE_NAMES[t.dtype], "shape": list(t.shape),
                        "offset": offset, "nbytes": raw.nbytes})
        parts.append(raw)
        offset += raw.nbytes
    header = json.dumps({
        "span_id": span_id, "namespace": namespace, "fingerprint": span.fingerprint,
        "token_ids": list(span.token_ids), "start_pos": span.start_pos, "hidden_from": span.hidden_from,
        "tensors": tensors, "payload_bytes": offset,
    }, separators=(",", ":")).encode()
    head = [MAGIC, struct.pack("<I", len(header)), header]
    digest = hashlib.sha256()
    for part in (*head, *parts):  # hash the parts, then join once: a span can be hundreds of MB
        digest.update(part)
    value = b"".join([*head, *parts, digest.digest()])
    meta = SpanMeta(span_id, namespace, span.fingerprint, len(span.token_ids), int(span.k.shape[0]),
                    span.start_pos, len(value))
    return value, meta


def decode_span(value: bytes | bytearray | memoryview, span_id: str, namespace: str, fingerprint: str) -> StoredSpan:
    """The span in ``value``; WireError unless it is intact and is ``span_id`` of this namespace and model.

    A ``bytearray`` is taken over (the tensors are views of it, no copy); other buffers are copied. Whatever the
    bytes, the only error is a WireError: a value that passes the checksum but whose header is not one of ours (a
    writer of another version, or a forged one) is a bad record too, never a failed request.
    """
    try:
        return _decode_span(value, span_id, namespace, fingerprint)
    except WireError:
        raise
    except (ValueError, KeyError, TypeError, AttributeError, IndexError, RuntimeError, struct.error) as e:
        raise WireError(f"span {span_id!r}: value cannot be decoded ({type(e).__name__}: {e})") from None


def _decode_span(value: bytes | bytearray | memoryview, span_id: str, namespace: str, fingerprint: str) -> StoredSpan:
    view = memoryview(value).cast("B")
    prefix = len(MAGIC) + 4
    if view.nbytes < prefix + _DIGEST_BYTES or bytes(view[: len(MAGIC)]) != MAGIC:
        raise WireError(f"span {span_id!r}: value of {view.nbytes} bytes is not a kvrelay span "
                        "(bad magic or truncated)")
    body = view[: view.nbytes - _DIGEST_BYTES]
    if hashlib.sha256(body).digest() != bytes(view[view.nbytes - _DIGEST_BYTES :]):
        raise WireError(f"span {span_id!r}: checksum mismatch ({view.nbytes} bytes; truncated or corrupt)")
    (header_len,) = struct.unpack("<I", body[len(MAGIC) : prefix])
    try:
        h = json.loads(bytes(body[prefix : prefix + header_len]))
    except ValueError as e:
        raise WireError(f"span {span_id!r}: header cannot be parsed ({e})") from None
    if not isinstance(h, dict):
        raise WireError(f"span {span_id!r}: header is not an object")
    found = (h.get("span_id"), h.get("namespace"), h.get("fingerprint"))
    if found != (span_id, namespace, fingerprint):
        raise WireError(f"span {span_id!r}: value holds span {found[0]!r} of namespace {found[1]!r} and model "
                        f"{found[2]!r}, not namespace {namespace!r} and model {fingerprint!r}")
    payload_start = prefix + header_len
    if body.nbytes - payload_start != h["payload_bytes"]:
        raise WireError(f"span {span_id!r}: payload has {body.nbytes - payload_start} bytes, header says "
                        f"{h['payload_bytes']}")
    if isinstance(value, bytearray):  # writable already (a backend read into it): tensors share it
        payload, base = value, payload_start
    else:  # one copy, so the tensors own writable memory
        payload, base = bytearray(body[payload_start:]), 0
    tensors = {}
    for t in h["tensors"]:
        dtype = _DTYPES.get(t["dtype"])
        if dtype is None or t["offset"] + t["nbytes"] > h["payload_bytes"]:
            raise WireError(f"span {span_id!r}: tensor {t['name']!r} has dtype {t['dtype']!r} or lies past the payload")
        if not t["nbytes"]:
            tensors[t["name"]] = torch.empty(t["shape"], dtype=dtype)
            continue
        flat = torch.frombuffer(payload, dtype=torch.uint8, count=t["nbytes"], offset=base + t["offset"])
        tensors[t["name"]] = flat.view(dtype).reshape(t["shape"])
    hidden = {int(name.split(".", 1)[1]): x for name, x in tensors.items() if name.startswith("hidden.")}
    try:
        return StoredSpan(tuple(int(x) for x in h["token_ids"]), int(h["start_pos"]), tensors["k"], tensors["v"],
                          fingerprint, hidden, int(h["hidden_from"]))
    except (KeyError, ValueError, RuntimeError) as e:
        raise WireError(f"span {span_id!r}: tensors do not form a span ({e})") from None
