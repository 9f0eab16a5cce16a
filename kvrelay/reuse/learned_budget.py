"""A byte bound on the KV a learning method keeps per agent (kvcomm's templates and anchor pools), fair to tenants.

kvcomm keeps, per (namespace, agent), the KV of the agent's template and an anchor pool per placeholder. Each pool
is bounded (``max_anchors``) and a namespace's state goes when the namespace expires (``cache.tenancy.expired_keys``),
but a namespace that lives on (the default one of a server without keys or salts, an API key's own) makes a new
agent with every new agent name or system prompt (a date or a user's name in it), and kept every one's KV for as
long as it lived. So the agents together are bounded in bytes: room is made from the tenant (the API key's part of
a namespace) holding the most, least recently used agent first, so one tenant's stream of new agents does not make
another's agents start over. An agent put out starts over: its next dense prefills rebuild its template and anchors.
Pure bookkeeping, no torch; not locked (its method's caller serializes calls).
"""

from __future__ import annotations

from collections import OrderedDict

from kvrelay.cache.tenancy import key_namespace, tenant_of
from kvrelay.errors import ConfigError

#: all agents' templates and anchors together: several times what a busy agent keeps (20 anchors per placeholder)
MAX_LEARNED_BYTES = 1 << 30


class LearnedBudget:
    """Bytes per agent key (a ``cache.tenancy.scoped_key``), at most ``max_bytes`` in all (``set``'s victims)."""

    def __init__(self, max_bytes: int = MAX_LEARNED_BYTES) -> None:
        if not isinstance(max_bytes, int) or isinstance(max_bytes, bool) or max_bytes < 1:
            raise ConfigError(f"learned-state budget must be a positive number of bytes, got {max_bytes!r}")
        self.max_bytes = max_bytes
        self.num_bytes = 0
        self._agents: dict[str, OrderedDict[str, int]] = {}  # tenant -> agent key -> bytes, least recent first
        self._tenant_bytes: dict[str, int] = {}

    def __len__(self) -> int:
        return sum(len(agents) for agents in self._agents.values())

    def __contains__(self, agent_key: str) -> bool:
        return agent_key in self._agents.get(_tenant(agent_key), {})

    def touch(self, agent_key: str) -> None:
        """The agent was used: it is put out last within its tenant."""
        agents = self._agents.get(_tenant(agent_key))
        if agents is not None and agent_key in agents:
            agents.move_to_end(agent_key)

    def set(self, agent_key: str, num_bytes: int) -> list[str]:
        """The agent now keeps ``num_bytes`` (and was just used); the agents put out to stay within the bound, the
        heaviest tenant's least recent first. An agent alone over the bound is put out too."""
        self.forget(agent_key)
        tenant = _tenant(agent_key)
        self._agents.setdefault(tenant, OrderedDict())[agent_key] = num_bytes
        self._tenant_bytes[tenant] = self._tenant_bytes.get(tenant, 0) + num_bytes
        self.num_bytes += num_bytes
        victims = []
        while self.num_bytes > self.max_bytes:
            heaviest = max(self._tenant_bytes, key=self._tenant_bytes.__getitem__)
            victim = next(iter(self._agents[heaviest]))
            self.forget(victim)
            victims.append(victim)
        return victims

    def forget(self, agent_key: str) -> None:
        tenant = _tenant(agent_key)
        agents = self._agents.get(tenant)
        num_bytes = agents.pop(agent_key, None) if agents is not None else None
        if num_bytes is None:
            return
        self.num_bytes -= num_bytes
        self._tenant_bytes[tenant] -= num_bytes
        if not agents:
            del self._agents[tenant], self._tenant_bytes[tenant]


def _tenant(agent_key: str) -> str:
    return tenant_of(key_namespace(agent_key))
