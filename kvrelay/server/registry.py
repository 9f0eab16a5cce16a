"""The output registry: every completion the server returned, by its exact text.

Agent frameworks pass an upstream answer on as text. When a later message contains a returned
text, the server splices the ids that were generated for it into the prompt (instead of
re-tokenizing), so that the upstream's decode KV matches token for token. No torch here.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from dataclasses import dataclass


@dataclass(frozen=True)
class RegisteredOutput:
    text: str
    output_ids: tuple[int, ...]
    span_id: str  # the stored span holding prompt + output KV
    src_start: int  # where the output's tokens start in that span (the length of its prompt)
    namespace: str = ""


@dataclass(frozen=True)
class TextHit:
    """``content[start:end]`` is the registered ``output``'s text."""

    start: int
    end: int
    output: RegisteredOutput


class OutputRegistry:
    """Returned texts per namespace, found inside message contents by their first ``key_chars`` chars."""

    def __init__(self, key_chars: int = 16, min_chars: int = 16, min_tokens: int = 4) -> None:
        self.key_chars = key_chars
        self.min_chars = max(min_chars, key_chars)  # shorter texts ("4", "Yes.") would match anywhere
        self.min_tokens = min_tokens
        self._by_key: dict[tuple[str, str], OrderedDict[str, RegisteredOutput]] = {}
        self._by_span: dict[str, list[RegisteredOutput]] = {}
        self._count: dict[str, int] = {}  # namespace -> entries
        # requests are matched on threads of their own while the engine thread registers and evicts: changes and
        # the snapshot of one key's holders are taken under this lock (a lookup per offset holds it only then)
        self._lock = threading.RLock()

    def __len__(self) -> int:
        return sum(len(v) for v in self._by_span.values())

    @property
    def num_namespaces(self) -> int:
        """Namespaces holding a registered output."""
        return len(self._count)

    def add(self, output: RegisteredOutput) -> bool:
        """Register ``output``; False (nothing registered) for texts too short to be told apart."""
        if len(output.text) < self.min_chars or len(output.output_ids) < self.min_tokens:
            return False
        with self._lock:
            self._add(output)
        return True

    def _add(self, output: RegisteredOutput) -> None:
        key = (output.namespace, output.text[: self.key_chars])
        holders = self._by_key.setdefault(key, OrderedDict())
        old = holders.pop(output.text, None)
        if old is not None:
            self._forget(old)
        holders[output.text] = output  # the newest registration of a text wins
        self._by_span.setdefault(output.span_id, []).append(output)
        self._count[output.namespace] = self._count.get(output.namespace, 0) + 1

    def remove_span(self, span_id: str) -> None:
        """Forget every output whose KV lives in ``span_id`` (the span was evicted)."""
        with self._lock:
            self._remove_span(span_id)

    def _remove_span(self, span_id: str) -> None:
        for output in list(self._by_span.get(span_id, [])):
            key = (output.namespace, output.text[: self.key_chars])
            holders = self._by_key.get(key)
            if holders is not None and holders.get(output.text) is output:
                del holders[output.text]
                if not holders:
                    del self._by_key[key]
            self._forget(output)

    def _forget(self, output: RegisteredOutput) -> None:
        outs = self._by_span.get(output.span_id, [])
        if output in outs:
            outs.remove(output)
            self._count[output.namespace] -= 1
            if not self._count[output.namespace]:  # a namespace per client salt: an emptied one is not kept
                del self._count[output.namespace]
            if not outs:
                del self._by_span[output.span_id]

    def find(self, content: str, namespace: str = "") -> list[TextHit]:
        """Registered texts of ``namespace`` inside ``content``: longest first, non-overlapping, in order."""
        if not self._count.get(namespace):
            return []
        k = self.key_chars
        hits: list[TextHit] = []
        for i in range(len(content) - self.min_chars + 1):
            holders = self._by_key.get((namespace, content[i : i + k]))
            if not holders:
                continue
            with self._lock:
                holders = list(holders.items())
            for text, output in holders:
                if content.startswith(text, i):
                    hits.append(TextHit(i, i + len(text), output))
        chosen: list[TextHit] = []
        for hit in sorted(hits, key=lambda h: (h.start - h.end, h.start)):
            if all(hit.end <= c.start or hit.start >= c.end for c in chosen):
                chosen.append(hit)
        return sorted(chosen, key=lambda h: h.start)
