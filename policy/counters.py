"""The named counters of the policy table (with visibility): their names and what each
counts, i.e. the labels of ``tabby_policy_packets_total``.

One counter per policy chain (``pkt-<chain>``: the packets its accept rules accepted) and
two per local endpoint (``deny-in-<if>``, ``deny-eg-<if>``: what its chains denied by
isolation); a counter's name derives from the IR alone, so a table rendered twice has the
same counters, and a difference adds or deletes exactly those of the chains and endpoints
it adds or deletes. Pure: no I/O.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable

from policy.engine import DesiredState, EndpointProgram, PolicyChain

#: The ``policy`` label of packets denied because the pod is isolated and nothing allowed it.
DEFAULT_DENY = "default-deny"
_DIRECTION_SHORT = {"ingress": "in", "egress": "eg"}


@dataclasses.dataclass(frozen=True, order=True)
class CounterKey:
    """What one named counter counts: ``tabby_policy_packets_total``'s labels."""

    namespace: str
    policy: str
    direction: str
    verdict: str


def chain_counter(c: PolicyChain) -> tuple[str, CounterKey]:
    """The named counter of one policy chain's accepts, and what it counts."""
    ns, _, name = c.policy.partition("/")
    return f"pkt-{c.name}", CounterKey(ns, name, c.direction, "allow")


def endpoint_counters(p: EndpointProgram) -> dict[str, CounterKey]:
    """The named counters of one endpoint (by host interface): what its chains deny by
    isolation, per direction. Both exist whether the endpoint is isolated or not, so a
    change of policy flushes the chain but never adds or deletes a counter (its count
    stays in the kernel)."""
    ns = p.endpoint.partition("/")[0]
    return {
        f"deny-{_DIRECTION_SHORT[d]}-{p.interface}": CounterKey(ns, DEFAULT_DENY, d, "deny")
        for d in ("ingress", "egress")
    }


def deny_counter(iface: str, direction: str) -> str:
    return f"deny-{_DIRECTION_SHORT[direction]}-{iface}"


def counters_of(ir: DesiredState) -> dict[str, CounterKey]:
    """The named counters a table with visibility holds for ``ir``: one per policy chain
    (its accepts) and two per local endpoint (what isolation denies, per direction)."""
    out = dict(chain_counter(c) for c in ir.chains.values())
    for p in ir.endpoints.values():
        out.update(endpoint_counters(p))
    return out


def counted_keys(
    chains: Iterable[PolicyChain], programs: Iterable[EndpointProgram]
) -> set[CounterKey]:
    """The series ``tabby_policy_packets_total`` shows (at 0 before any packet): every
    policy chain's, and the default deny of each namespace and direction in which a local
    endpoint is isolated."""
    keys = {chain_counter(c)[1] for c in chains}
    for p in programs:
        ns = p.endpoint.partition("/")[0]
        for d, jumps in (("ingress", p.ingress), ("egress", p.egress)):
            if jumps is not None:
                keys.add(CounterKey(ns, DEFAULT_DENY, d, "deny"))
    return keys


__all__ = [
    "DEFAULT_DENY",
    "CounterKey",
    "chain_counter",
    "counted_keys",
    "counters_of",
    "deny_counter",
    "endpoint_counters",
]
