"""The named counters of the policy table (with visibility): their names and what each
counts, i.e. the labels of ``tabby_policy_packets_total``.

One counter per Kubernetes policy chain (``pkt-<chain>``: the packets its accept rules
accepted), one per rule of a Calico policy's chain (``pkt-<chain>-<rule>``: the packets the
rule decided, or logged; a staged policy's: what it would have decided), and two per local
endpoint (``deny-in-<if>``, ``deny-eg-<if>``: what its chains denied by
isolation); a counter's name derives from the IR alone, so a table rendered twice has the
same counters, and a difference adds or deletes exactly those of the chains and endpoints
it adds or deletes. Pure: no I/O.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable

from policy.engine import DesiredState, EndpointProgram, PolicyChain, TierRule

#: The ``policy`` label of packets denied because the pod is isolated and nothing allowed it.
DEFAULT_DENY = "default-deny"
_DIRECTION_SHORT = {"ingress": "in", "egress": "eg"}
#: The ``verdict`` label of a Calico rule's counter, by its IR verdict.
_VERDICT_WORD = {"accept": "allow", "drop": "deny", "log": "log", "pass": "pass"}


@dataclasses.dataclass(frozen=True, order=True)
class CounterKey:
    """What one named counter counts: ``tabby_policy_packets_total``'s labels."""

    namespace: str
    policy: str
    direction: str
    verdict: str
    #: a Calico policy's rule: its tier, the rule (``ingress[0]``), whether it is staged
    tier: str = ""
    rule: str = ""
    staged: bool = False


def chain_counter(c: PolicyChain) -> tuple[str, CounterKey]:
    """The named counter of one Kubernetes policy chain's accepts, and what it counts."""
    ns, _, name = c.policy.partition("/")
    return f"pkt-{c.name}", CounterKey(ns, name, c.direction, "allow")


def rule_counter(c: PolicyChain, r: TierRule) -> tuple[str, CounterKey]:
    """The named counter of one rule of a Calico policy's chain, and what it counts: the
    policy's namespace ("" for a global one), name, tier, the rule and its verdict."""
    key = c.policy.removeprefix("staged:")
    ns, _, name = key.rpartition("/")
    what = CounterKey(
        ns,
        name,
        c.direction,
        _VERDICT_WORD[r.verdict],
        c.tier,
        f"{c.direction}[{r.rule}]",
        c.staged,
    )
    return f"pkt-{c.name}-{r.rule}", what


#: The ``rule`` label of a staged policy's end-of-tier counter.
END_OF_TIER = "end-of-tier"


def staged_end_counter(chain: str) -> str:
    """The named counter of a staged policy's chain that counts the end of its tier: the
    packets none of the tier's staged rules would have decided (and no staged rule of an
    earlier tier), where no enforced policy of the tier selects the endpoint."""
    return f"pkt-{chain}-end"


def chain_counters(c: PolicyChain) -> dict[str, CounterKey]:
    """The named counters of one policy chain: its accepts (Kubernetes), or one per rule
    (Calico), and a staged policy's end of its tier (verdict: the tier's defaultAction)."""
    if not c.tier:
        return dict((chain_counter(c),))
    out = dict(rule_counter(c, r) for r in c.rules if isinstance(r, TierRule))
    if c.end_action is not None:
        ns, _, name = c.policy.removeprefix("staged:").rpartition("/")
        verdict = "deny" if c.end_action == "Deny" else "pass"
        key = CounterKey(ns, name, c.direction, verdict, c.tier, END_OF_TIER, c.staged)
        out[staged_end_counter(c.name)] = key
    return out


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
    out: dict[str, CounterKey] = {}
    for c in ir.chains.values():
        out.update(chain_counters(c))
    for p in ir.endpoints.values():
        out.update(endpoint_counters(p))
    return out


def counted_keys(
    chains: Iterable[PolicyChain], programs: Iterable[EndpointProgram]
) -> set[CounterKey]:
    """The series ``tabby_policy_packets_total`` shows (at 0 before any packet): every
    policy chain's, and the default deny of each namespace and direction in which a local
    endpoint is isolated."""
    keys = {key for c in chains for key in chain_counters(c).values()}
    for p in programs:
        ns = p.endpoint.partition("/")[0]
        for d, jumps in (("ingress", p.ingress), ("egress", p.egress)):
            if jumps is not None:
                keys.add(CounterKey(ns, DEFAULT_DENY, d, "deny"))
    return keys


__all__ = [
    "DEFAULT_DENY",
    "END_OF_TIER",
    "CounterKey",
    "chain_counter",
    "chain_counters",
    "counted_keys",
    "counters_of",
    "deny_counter",
    "endpoint_counters",
    "rule_counter",
    "staged_end_counter",
]
