"""Role turnover: whether a tenant's roles live long enough for their first calls' shadows to pay.

The guard shadows every one of a role's first ``first_calls_per_role`` calls (its warm-up), an investment that pays
once the role has enough samples to be judged and keeps being called. A role lives in its namespace, so a client
that sends each conversation under a fresh ``cache_salt`` makes roles that die after a few calls: every call would
be warm-up and the warm-up never pays. ``RoleTurnover`` learns this online from the calls themselves: over a
tenant's most recent ``WINDOW_CALLS`` calls, the share that was a role's first call in its namespace estimates how
many calls a role gets (calls / new roles). A tenant whose roles get fewer calls than the warm-up window, once it
has shown at least ``JUDGED_NEW_ROLES`` new roles (fewer are a tenant's own agents starting), is short-lived: its
shadows are then taken only on the server's shadow share (kvrelay.server.shadow_pacer); a tenant with a few
long-lived roles (one namespace, agents called again and again) keeps its warm-up.

A tenant is the API key's part of a namespace (``k<digest>``; "" without keys): a conversation's salt is below it,
so one tenant's conversations are counted together and never another tenant's. Pure and deterministic.
"""

from __future__ import annotations

from collections import OrderedDict, deque

from kvrelay.cache.tenancy import tenant_of

WINDOW_CALLS = 256  # recent calls per tenant the estimate reads: several hundred roles' worth of short-lived traffic
JUDGED_NEW_ROLES = 16  # new roles in a tenant's window before it is judged: more agents than a team starts at once
MAX_TENANTS = 1024  # tenants tracked, least recently seen out first (a tenant out of it starts over: long-lived)


class RoleTurnover:
    """``observe`` each counted call (whether it was its role's first in its namespace); ``short_lived`` per tenant."""

    def __init__(self, warm_up_calls: int) -> None:
        """``warm_up_calls``: the guard's ``first_calls_per_role``, the lifetime a role needs for its warm-up to
        pay."""
        self.warm_up_calls = warm_up_calls
        self._calls: OrderedDict[str, deque[bool]] = OrderedDict()  # tenant -> its recent calls: new role or not

    def observe(self, namespace: str, is_new_role: bool) -> None:
        tenant = tenant_of(namespace)
        calls = self._calls.pop(tenant, None) or deque(maxlen=WINDOW_CALLS)
        calls.append(is_new_role)
        self._calls[tenant] = calls
        if len(self._calls) > MAX_TENANTS:
            self._calls.popitem(last=False)

    def calls_per_role(self, namespace: str) -> float | None:
        """Recent calls per new role of the namespace's tenant (None: no new role in its window)."""
        calls = self._calls.get(tenant_of(namespace))
        num_new = sum(calls) if calls else 0
        return len(calls) / num_new if num_new else None

    def short_lived(self, namespace: str) -> bool:
        """Whether the namespace's tenant makes roles that do not live through their warm-up: at least
        ``JUDGED_NEW_ROLES`` new roles in its recent calls, and fewer than ``warm_up_calls`` calls per new role."""
        calls = self._calls.get(tenant_of(namespace))
        num_new = sum(calls) if calls else 0
        return num_new >= JUDGED_NEW_ROLES and len(calls) < self.warm_up_calls * num_new
