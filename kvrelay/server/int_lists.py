"""Many ordered lists of int nodes, kept in four dicts of ints: invisible to the garbage collector.

A list per key (an array, a list or a dict per key) is a container per key, and a dict that holds
containers is tracked by Python's cyclic collector, which walks all of it at every full collection: an
index of a million blocks then costs a pause of half a second in whatever request is running. A dict
whose keys and values are all ints is never tracked, so these lists cost the collector nothing, however
many there are. Appending, removing any node, and reading a list's first and last node are O(1).

Each node (an int) is in at most one list at a time. Pure Python, no torch.
"""

from __future__ import annotations

from collections.abc import Iterator

__all__ = ["IntLists"]


class IntLists:
    """Doubly linked lists of int nodes, one per int key, in insertion order."""

    __slots__ = ("head", "tail", "next", "prev")

    def __init__(self) -> None:
        self.head: dict[int, int] = {}  # key -> its first node (keys with an empty list are absent)
        self.tail: dict[int, int] = {}  # key -> its last node
        self.next: dict[int, int] = {}  # node -> the node after it (absent: the last)
        self.prev: dict[int, int] = {}  # node -> the node before it (absent: the first)

    def __contains__(self, key: int) -> bool:
        return key in self.head

    def __len__(self) -> int:
        """The number of non-empty lists."""
        return len(self.head)

    def append(self, key: int, node: int) -> None:
        """Put ``node`` (in no list) at the end of ``key``'s list."""
        last = self.tail.get(key)
        if last is None:
            self.head[key] = node
        else:
            self.next[last] = node
            self.prev[node] = last
        self.tail[key] = node

    def remove(self, key: int, node: int) -> bool:
        """Take ``node`` out of ``key``'s list (it must be there); True if the list is now empty."""
        before = self.prev.pop(node, None)
        after = self.next.pop(node, None)
        if before is None:
            if after is None:
                del self.head[key], self.tail[key]
                return True
            self.head[key] = after
            del self.prev[after]
        elif after is None:
            self.tail[key] = before
            del self.next[before]
        else:
            self.next[before] = after
            self.prev[after] = before
        return False

    def nodes(self, key: int) -> Iterator[int]:
        """``key``'s nodes, first to last (none for a key never appended to)."""
        node = self.head.get(key)
        following = self.next
        while node is not None:
            yield node
            node = following.get(node)
