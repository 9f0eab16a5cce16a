"""Agent graph bookkeeping: topological order, cycles, consumers. Pure Python (no torch)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from kvrelay.errors import KvRelayError


class PipelineError(KvRelayError):
    """A pipeline spec that cannot run: names the agent and the problem."""


def topological_order(names: Sequence[str], deps: Mapping[str, Sequence[str]]) -> list[str]:
    """Agents in an order where each comes after everything it depends on (spec order among ready ones).

    Raises PipelineError naming a cycle, e.g. ``a -> b -> a``.
    """
    remaining = {n: set(deps.get(n, ())) for n in names}
    order: list[str] = []
    while remaining:
        ready = [n for n in names if n in remaining and not remaining[n]]
        if not ready:
            raise PipelineError(f"pipeline has a cycle: {' -> '.join(_find_cycle(remaining))}")
        for n in ready:
            del remaining[n]
            order.append(n)
        for rest in remaining.values():
            rest.difference_update(ready)
    return order


def _find_cycle(remaining: Mapping[str, set[str]]) -> list[str]:
    start = next(iter(remaining))
    path, seen = [start], {start: 0}
    while True:
        nxt = sorted(remaining[path[-1]])[0]
        if nxt in seen:
            return path[seen[nxt]:] + [nxt]
        seen[nxt] = len(path)
        path.append(nxt)


def consumers(names: Sequence[str], deps: Mapping[str, Sequence[str]]) -> dict[str, list[str]]:
    """For each agent, the agents that read its output."""
    out: dict[str, list[str]] = {n: [] for n in names}
    for n in names:
        for d in deps.get(n, ()):
            out[d].append(n)
    return out
