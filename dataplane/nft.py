"""The nftables dataplane of NetworkPolicy: one table ``inet tabby``, atomic transactions.

Layout (see DESIGN.md beside this file)::

    table inet tabby
      set a4-<h> / a6-<h>     pod addresses of one peer selector (plain sets)
      set b4-<h> / b6-<h>     one ipBlock: cidr minus except (interval sets)
      set n4-<name>-<h> ...   one container-port name: address . protocol . port
      map wl-from / wl-to     host veth name -> jump from-<if> / to-<if>
      chain pi-<h> / pe-<h>   one policy's ingress / egress rules (accept on match)
      chain to-<if>           endpoint ingress: jump pi-... ; drop (or accept: not isolated)
      chain from-<if>         endpoint egress:  jump pe-... ; drop (or accept)
      chain fwd-egress        hook forward, priority filter:     traffic from a pod
      chain fwd-ingress       hook forward, priority filter + 1: traffic to a pod
      chain input             hook input, priority filter:       a pod to its node
      chain nat-postrouting   hook postrouting (srcnat): natOutgoing pools (when any)
    with visibility (the default):
      counter pkt-pi-<h> ...  packets one policy's chain accepted (one per policy chain)
      counter deny-in-<h> ... packets denied by isolation in one namespace and direction
      chain log-ingress/-egress  a denied packet's first of its flow to NFLOG group 116
      set flows-{p,x}{4,6}    the flows logged in the last 10 s (dynamic, timeout)
      limit log-denied        100 logged packets a second, node-wide

Allowing is ``accept``: an accept ends only the base chain it happens in, so pod-to-pod
traffic on one node passes the sender's egress (``fwd-egress``) and then the receiver's
ingress (``fwd-ingress``); a drop anywhere is final. Both forward chains and ``input`` start
with ``ct state established,related accept`` and ``ct state invalid drop``, then dispatch by
interface name through the verdict maps; a prefixed interface that is in no map (a pod whose
rules do not exist yet) is dropped. The node's own traffic to its pods (``output``) is not
policed, so kubelet probes pass.

:class:`PolicyDataplane` keeps the IR up to date change by change
(:mod:`policy.incremental`) and sends what each change changed (set elements, flushed and
refilled chains, map elements: :meth:`Renderer.incremental`, the same lines
:meth:`Renderer.delta` would diff out of the two states) as one transaction; the first apply
(and ``sync(full=True)``, and any failed difference) replaces the whole table in one
transaction (``add table; delete table; <everything>``), so a restart never opens a window.
Everything runs in the network namespace of the calling thread.

Visibility (``PolicyDataplane(visibility=True)``): every accept rule of a policy chain
counts into the policy's named counter, and an endpoint chain counts what it denies into
its namespace's ``default-deny`` counter before it sends the packet through
``log-ingress``/``log-egress`` (NFLOG, rate-limited and once per flow) and drops it. Only
packets that open a connection reach these chains (``ct state established,related accept``
comes first), so counting costs a long stream nothing. The kernel's counters are read and
zeroed (netlink ``GETOBJ_RESET``, what ``nft reset counters`` sends) by
:meth:`PolicyDataplane.packet_counts` and summed here, so a
full replacement of the table (which makes new counters) loses nothing but the packets of
the moment between the read and the replacement.
"""

from __future__ import annotations

import ctypes
import dataclasses
import logging
import os
import subprocess
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Literal, Protocol

from policy import engine
from policy.engine import (
    ClusterState,
    DesiredState,
    Element,
    Endpoint,
    EndpointProgram,
    Explanation,
    Family,
    IRRule,
    NatConfig,
    Pod,
    PolicyChain,
    SetDef,
    Target,
)
from policy.incremental import Delta, IncrementalPolicy, Update, differences

log = logging.getLogger("tabby.node.policy")

DEFAULT_TABLE = "tabby"
DEFAULT_PREFIX = "cali"
_FAM = {4: "ip", 6: "ip6"}
_SET_TYPE = {
    ("addr", 4): "ipv4_addr",
    ("addr", 6): "ipv6_addr",
    ("cidr", 4): "ipv4_addr",
    ("cidr", 6): "ipv6_addr",
    ("named-port", 4): "ipv4_addr . inet_proto . inet_service",
    ("named-port", 6): "ipv6_addr . inet_proto . inet_service",
}


#: The NFLOG group denied packets go to (tabby's route protocol number, for memory).
LOG_GROUP = 116
#: Denied packets sent to userspace at most this often, node-wide (a named limit), with
#: this burst: a flood of denied packets costs tabby-node at most this many messages.
LOG_RATE = 100
LOG_BURST = 200
#: A flow (source, destination, protocol, destination port) is logged once in this time.
LOG_FLOW_SECONDS = 10
LOG_FLOW_SET_SIZE = 8192
#: Bytes of each logged packet copied to userspace (IPv6 + extension headers + ports).
LOG_SNAPLEN = 128
LOG_PREFIX = "tabby-deny "
#: The ``policy`` label of packets denied because the pod is isolated and nothing allowed it.
DEFAULT_DENY = "default-deny"
_DIRECTION_SHORT = {"ingress": "in", "egress": "eg"}
_PORTED = "{ tcp, udp, sctp }"


class NftError(RuntimeError):
    """nft refused a transaction (nothing of it was applied)."""


# --- inputs besides the IR --------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Snapshot:
    """What one table holds: the policy IR and the NAT pools."""

    ir: DesiredState
    nat: NatConfig

    def all_sets(self) -> dict[str, SetDef]:
        sets = dict(self.ir.sets)
        if self.nat.enabled:
            for kind in ("nat-src", "pools"):
                for fam in (4, 6):
                    name = f"{kind}{fam}"
                    sets[name] = SetDef(name, fam, "cidr", f"{kind} IP pools")
        return sets

    def all_elements(self) -> dict[str, frozenset[Element]]:
        elems = dict(self.ir.elements)
        if self.nat.enabled:
            elems.update(self.nat.elements())
        return elems


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


# --- rendering --------------------------------------------------------------------------------


def _quote(text: str) -> str:
    return '"' + "".join(c if c.isprintable() and c not in '"\\' else "_" for c in text) + '"'


def _element(e: Element) -> str:
    if isinstance(e, tuple):
        addr, proto, port = e
        return f"{addr} . {proto} . {port}"
    return e


def _ports(ranges: Sequence[tuple[int, int]]) -> str:
    items = [str(lo) if lo == hi else f"{lo}-{hi}" for lo, hi in ranges]
    return items[0] if len(items) == 1 else "{ " + ", ".join(items) + " }"


class Renderer:
    """nft text for one table. Every statement is a flat command (``add ...``), so full and
    incremental transactions are made of the same pieces."""

    def __init__(
        self, table: str = DEFAULT_TABLE, prefix: str = DEFAULT_PREFIX, *, visibility: bool = True
    ) -> None:
        if not table.replace("-", "").replace("_", "").isalnum():
            raise ValueError(f"invalid table name {table!r}")
        if not prefix or not prefix.isalnum() or len(prefix) > 14:
            raise ValueError(f"invalid interface prefix {prefix!r}")
        self.table = table
        self.prefix = prefix
        self.visibility = visibility
        self.t = f"inet {table}"

    # sets
    def add_set(self, d: SetDef) -> str:
        flags = " flags interval;" if d.kind == "cidr" else ""
        return (
            f"add set {self.t} {d.name} {{ type {_SET_TYPE[(d.kind, d.family)]};{flags}"
            f" comment {_quote(d.comment[:120])}; }}"
        )

    def elements(self, verb: str, name: str, elems: Iterable[Element]) -> Iterator[str]:
        items = sorted(_element(e) for e in elems)
        for i in range(0, len(items), 2000):
            yield f"{verb} element {self.t} {name} {{ {', '.join(items[i : i + 2000])} }}"

    # policy chains
    def rule(self, chain: PolicyChain, r: IRRule) -> str:
        side = "saddr" if chain.direction == "ingress" else "daddr"
        parts = []
        if r.peer_set is not None:
            assert r.family is not None
            parts.append(f"{_FAM[r.family]} {side} @{r.peer_set}")
        elif r.family is not None and r.named_port_set is None:
            parts.append(f"meta nfproto ipv{r.family}")
        if r.protocol is not None:
            parts.append(f"meta l4proto {r.protocol}")
        if r.ports:
            parts.append(f"th dport {_ports(r.ports)}")
        if r.named_port_set is not None:
            assert r.family is not None
            parts.append(f"{_FAM[r.family]} daddr . meta l4proto . th dport @{r.named_port_set}")
        if self.visibility:
            parts.append(f'counter name "{chain_counter(chain)[0]}"')
        parts.append(f"accept comment {_quote(r.comment)}")
        return f"add rule {self.t} {chain.name} {' '.join(parts)}"

    def policy_chain_rules(self, c: PolicyChain) -> list[str]:
        return [self.rule(c, r) for r in c.rules]

    # endpoint chains
    @staticmethod
    def ep_chains(iface: str) -> tuple[str, str]:
        return f"to-{iface}", f"from-{iface}"

    def endpoint_rules(self, p: EndpointProgram) -> list[str]:
        out = []
        to, frm = self.ep_chains(p.interface)
        for chain, jumps, what in ((to, p.ingress, "ingress"), (frm, p.egress, "egress")):
            if jumps is None:
                note = _quote(f"{p.endpoint}: no {what} policy")
                out.append(f"add rule {self.t} {chain} accept comment {note}")
                continue
            out.extend(f"add rule {self.t} {chain} jump {j}" for j in jumps)
            if self.visibility:
                count = deny_counter(p.interface, what)
                out.append(f'add rule {self.t} {chain} counter name "{count}" jump log-{what}')
            note = _quote(f"{p.endpoint}: {what} not allowed")
            out.append(f"add rule {self.t} {chain} drop comment {note}")
        return out

    # visibility: counters and the denied-flow log
    def add_counter(self, name: str, key: CounterKey) -> str:
        if key.policy == DEFAULT_DENY:  # an endpoint's: the same whoever has the interface
            what = f"{key.direction} denied by isolation"
        else:
            what = f"{key.namespace}/{key.policy} {key.direction} {key.verdict}"
        return f"add counter {self.t} {name} {{ comment {_quote(what)}; }}"

    def log_objects(self) -> list[str]:
        """The flow sets, the rate limit and the two log chains (``log-ingress``,
        ``log-egress``): a packet of a flow logged in the last LOG_FLOW_SECONDS returns at
        once; else, within the node-wide limit, its flow is remembered and the packet sent
        to NFLOG group LOG_GROUP with the prefix ``tabby-deny <direction>``. The chains
        never drop: the endpoint chain that jumped here does."""
        t = self.t
        out = [f"add limit {t} log-denied {{ rate {LOG_RATE}/second burst {LOG_BURST} packets; }}"]
        flags = f"flags dynamic,timeout; timeout {LOG_FLOW_SECONDS}s; size {LOG_FLOW_SET_SIZE};"
        for fam, kw in ((4, "ipv4_addr"), (6, "ipv6_addr")):
            ported = f"{kw} . {kw} . inet_proto . inet_service"
            out.append(f"add set {t} flows-p{fam} {{ type {ported}; {flags} }}")
            out.append(f"add set {t} flows-x{fam} {{ type {kw} . {kw} . inet_proto; {flags} }}")
        for direction in ("ingress", "egress"):
            chain = f"log-{direction}"
            out.append(f"add chain {t} {chain}")
            log = f"log prefix {_quote(LOG_PREFIX + direction)} group {LOG_GROUP}"
            log += f" snaplen {LOG_SNAPLEN}"
            rules: list[str] = []
            for fam in (4, 6):
                kw = _FAM[fam]
                key_p = f"{kw} saddr . {kw} daddr . meta l4proto . th dport"
                key_x = f"{kw} saddr . {kw} daddr . meta l4proto"
                rules.append(f"meta l4proto {_PORTED} {key_p} @flows-p{fam} return")
                rules.append(f"meta l4proto != {_PORTED} {key_x} @flows-x{fam} return")
            for fam in (4, 6):
                kw = _FAM[fam]
                key_p = f"{kw} saddr . {kw} daddr . meta l4proto . th dport"
                key_x = f"{kw} saddr . {kw} daddr . meta l4proto"
                first = f"meta nfproto ipv{fam}"
                rules.append(
                    f'{first} meta l4proto {_PORTED} limit name "log-denied"'
                    f" add @flows-p{fam} {{ {key_p} }} {log}"
                )
                rules.append(
                    f'{first} meta l4proto != {_PORTED} limit name "log-denied"'
                    f" add @flows-x{fam} {{ {key_x} }} {log}"
                )
            out.extend(f"add rule {t} {chain} {r}" for r in rules)
        return out

    def map_elements(self, verb: str, ifaces: Iterable[str]) -> list[str]:
        out: list[str] = []
        ifaces = sorted(ifaces)
        if not ifaces:
            return out
        if verb == "add":
            to = ", ".join(f'"{i}" : jump {self.ep_chains(i)[0]}' for i in ifaces)
            frm = ", ".join(f'"{i}" : jump {self.ep_chains(i)[1]}' for i in ifaces)
        else:
            to = frm = ", ".join(f'"{i}"' for i in ifaces)
        out.append(f"{verb} element {self.t} wl-to {{ {to} }}")
        out.append(f"{verb} element {self.t} wl-from {{ {frm} }}")
        return out

    # base chains
    def base(self, nat: NatConfig) -> list[str]:
        t, p = self.t, f'"{self.prefix}*"'
        out = [
            f"add map {t} wl-to {{ type ifname : verdict; }}",
            f"add map {t} wl-from {{ type ifname : verdict; }}",
        ]
        hooks = (
            ("fwd-egress", "forward priority filter", "iifname", "wl-from"),
            ("fwd-ingress", "forward priority filter + 1", "oifname", "wl-to"),
            ("input", "input priority filter", "iifname", "wl-from"),
        )
        for chain, hook, key, vmap in hooks:
            out.append(f"add chain {t} {chain} {{ type filter hook {hook}; policy accept; }}")
            out.append(f"add rule {t} {chain} {key} != {p} return")
            out.append(f"add rule {t} {chain} ct state established,related accept")
            if chain == "input":
                out.append(
                    f"add rule {t} {chain} icmpv6 type {{ nd-router-solicit, nd-neighbor-solicit,"
                    f" nd-neighbor-advert }} accept"
                )
            out.append(f"add rule {t} {chain} ct state invalid drop")
            out.append(f"add rule {t} {chain} {key} vmap @{vmap}")
            out.append(
                f"add rule {t} {chain} drop comment {_quote(f'unknown {self.prefix}* interface')}"
            )
        if nat.enabled:
            hook = "type nat hook postrouting priority srcnat; policy accept;"
            out.append(f"add chain {t} nat-postrouting {{ {hook} }}")
            for fam in (4, 6):
                kw = _FAM[fam]
                out.append(
                    f"add rule {t} nat-postrouting {kw} saddr @nat-src{fam}"
                    f" {kw} daddr != @pools{fam} masquerade"
                )
        return out

    # transactions
    def full(self, snap: Snapshot) -> str:
        t = self.t
        out = [f"add table {t}", f"delete table {t}", f"add table {t}"]
        sets = snap.all_sets()
        elems = snap.all_elements()
        for name in sorted(sets):
            out.append(self.add_set(sets[name]))
            out.extend(self.elements("add", name, elems[name]))
        ir = snap.ir
        if self.visibility:
            out.extend(self.log_objects())
            for name, key in sorted(counters_of(ir).items()):
                out.append(self.add_counter(name, key))
        for name in sorted(ir.chains):
            out.append(f"add chain {t} {name}")
        for iface in sorted(ir.endpoints):
            out.extend(f"add chain {t} {c}" for c in self.ep_chains(iface))
        for name in sorted(ir.chains):
            out.extend(self.policy_chain_rules(ir.chains[name]))
        for iface in sorted(ir.endpoints):
            out.extend(self.endpoint_rules(ir.endpoints[iface]))
        base = self.base(snap.nat)
        out.extend(base[:2])  # the maps, before their elements
        out.extend(self.map_elements("add", ir.endpoints))
        out.extend(base[2:])
        return "\n".join(out) + "\n"

    def delta(self, old: Snapshot, new: Snapshot) -> list[str] | None:
        """Commands that turn ``old`` into ``new`` (one transaction); ``None`` when only a
        full replacement can do it (e.g. NAT switched on or off)."""
        if old.nat.enabled != new.nat.enabled:
            return None
        t = self.t
        out: list[str] = []
        late: list[str] = []
        osets, nsets = old.all_sets(), new.all_sets()
        oel, nel = old.all_elements(), new.all_elements()
        for name, d in sorted(nsets.items()):
            if name in osets and (osets[name].kind, osets[name].family) != (d.kind, d.family):
                return None
            if name not in osets:
                out.append(self.add_set(d))
                out.extend(self.elements("add", name, nel[name]))
                continue
            if oel[name] is nel[name]:
                continue
            gone, came = oel[name] - nel[name], nel[name] - oel[name]
            if gone:
                out.extend(self.elements("delete", name, gone))
            if came:
                out.extend(self.elements("add", name, came))
        ochains, nchains = old.ir.chains, new.ir.chains
        oeps, neps = old.ir.endpoints, new.ir.endpoints
        ocount = counters_of(old.ir) if self.visibility else {}
        ncount = counters_of(new.ir) if self.visibility else {}
        for name in sorted(ncount.keys() - ocount.keys()):
            out.append(self.add_counter(name, ncount[name]))
        for name in sorted(nchains.keys() - ochains.keys()):
            out.append(f"add chain {t} {name}")
        for iface in sorted(neps.keys() - oeps.keys()):
            out.extend(f"add chain {t} {ch}" for ch in self.ep_chains(iface))
        for name, pc in sorted(nchains.items()):
            if name not in ochains:
                out.extend(self.policy_chain_rules(pc))
            elif ochains[name] is not pc and ochains[name] != pc:
                out.append(f"flush chain {t} {name}")
                out.extend(self.policy_chain_rules(pc))
        for iface, p in sorted(neps.items()):
            if iface not in oeps:
                out.extend(self.endpoint_rules(p))
            elif oeps[iface] is not p and oeps[iface] != p:
                if (oeps[iface].ingress, oeps[iface].egress, oeps[iface].endpoint) == (
                    p.ingress,
                    p.egress,
                    p.endpoint,
                ):
                    continue  # only the addresses differ: nothing in the chains
                out.extend(f"flush chain {t} {c}" for c in self.ep_chains(iface))
                out.extend(self.endpoint_rules(p))
        out.extend(self.map_elements("add", neps.keys() - oeps.keys()))
        removed = sorted(oeps.keys() - neps.keys())
        late.extend(self.map_elements("delete", removed))
        for iface in removed:
            for c in self.ep_chains(iface):
                late.extend((f"flush chain {t} {c}", f"delete chain {t} {c}"))
        for name in sorted(ochains.keys() - nchains.keys()):
            late.extend((f"flush chain {t} {name}", f"delete chain {t} {name}"))
        for name in sorted(osets.keys() - nsets.keys()):
            late.append(f"delete set {t} {name}")
        for name in sorted(ocount.keys() - ncount.keys()):
            late.append(f"delete counter {t} {name}")
        return out + late

    def incremental(self, d: Delta) -> list[str] | None:
        """Commands for a :class:`~policy.incremental.Delta`: what :meth:`delta` sends for
        the two states the delta lies between, line for line, made from the delta alone
        (no IR is diffed). ``None`` when only a full replacement can do it (NAT switched
        on or off)."""
        t = self.t
        by_set: dict[str, list[str]] = {}
        if d.nat is not None:
            was, now = d.nat
            if was.enabled != now.enabled:
                return None
            if now.enabled:
                oel, nel = was.elements(), now.elements()
                for name in nel:
                    by_set[name] = [
                        *self.elements("delete", name, oel[name] - nel[name]),
                        *self.elements("add", name, nel[name] - oel[name]),
                    ]
        for name, sd in d.new_sets.items():
            by_set[name] = [self.add_set(sd), *self.elements("add", name, d.new_elements[name])]
        for name in d.added.keys() | d.removed.keys():
            by_set[name] = [
                *self.elements("delete", name, d.removed.get(name, ())),
                *self.elements("add", name, d.added.get(name, ())),
            ]
        out = [line for name in sorted(by_set) for line in by_set[name]]
        if self.visibility:
            came = dict(chain_counter(c) for c in d.new_chains.values())
            for p in d.new_endpoints.values():
                came.update(endpoint_counters(p))
            out.extend(self.add_counter(name, came[name]) for name in sorted(came))
        out.extend(f"add chain {t} {name}" for name in sorted(d.new_chains))
        for iface in sorted(d.new_endpoints):
            out.extend(f"add chain {t} {c}" for c in self.ep_chains(iface))
        chains = {**d.new_chains, **d.changed_chains}
        for name in sorted(chains):
            if name in d.changed_chains:
                out.append(f"flush chain {t} {name}")
            out.extend(self.policy_chain_rules(chains[name]))
        for iface in sorted(d.new_endpoints.keys() | d.changed_endpoints.keys()):
            if iface in d.new_endpoints:
                out.extend(self.endpoint_rules(d.new_endpoints[iface]))
                continue
            was_p, now_p = d.changed_endpoints[iface]
            if (was_p.ingress, was_p.egress, was_p.endpoint) == (
                now_p.ingress,
                now_p.egress,
                now_p.endpoint,
            ):
                continue  # only the addresses differ: nothing in the chains
            out.extend(f"flush chain {t} {c}" for c in self.ep_chains(iface))
            out.extend(self.endpoint_rules(now_p))
        out.extend(self.map_elements("add", d.new_endpoints))
        late = self.map_elements("delete", d.gone_endpoints)
        for iface in d.gone_endpoints:
            for c in self.ep_chains(iface):
                late.extend((f"flush chain {t} {c}", f"delete chain {t} {c}"))
        for name in d.gone_chains:
            late.extend((f"flush chain {t} {name}", f"delete chain {t} {name}"))
        late.extend(f"delete set {t} {name}" for name in d.gone_sets)
        if self.visibility:
            gone = [f"pkt-{name}" for name in d.gone_chains]
            gone += [deny_counter(i, w) for i in d.gone_endpoints for w in ("ingress", "egress")]
            late.extend(f"delete counter {t} {name}" for name in sorted(gone))
        return out + late


# --- mechanisms -------------------------------------------------------------------------------


class NftBackend(Protocol):
    name: str

    def run(self, text: str) -> str:
        """Run ``text`` as one transaction in the calling thread's netns; return the output."""
        ...


class NftCli:
    """The ``nft`` program: ``nft -f -`` (one transaction per call)."""

    name = "nft-cli"

    def __init__(self, binary: str = "nft", json: bool = False) -> None:
        self.argv = [binary, *(["-j"] if json else []), "-f", "-"]

    def run(self, text: str) -> str:
        proc = subprocess.run(self.argv, input=text, capture_output=True, text=True, check=False)
        if proc.returncode != 0:
            raise NftError(proc.stderr.strip()[:4000] or f"nft exited {proc.returncode}")
        return proc.stdout


class LibNftables:
    """libnftables (the library ``nft`` itself is built on) through ctypes, one context per
    network namespace (its netlink socket belongs to the namespace it was opened in).

    libnftables waits on its socket with ``select()``, which aborts the whole process
    (glibc's fd_set check) when the socket's descriptor is >= FD_SETSIZE (1024). A context
    is therefore only made while the lowest free descriptor is well below that (the socket
    takes it and keeps it for the context's life); otherwise that namespace is served by
    the ``nft`` CLI. Contexts live as long as this object: use one per process
    (``default_backend()``)."""

    name = "libnftables"
    FD_LIMIT = 1024 - 64

    def __init__(self, library: str = "libnftables.so.1") -> None:
        lib = ctypes.CDLL(library, use_errno=True)
        lib.nft_ctx_new.restype = ctypes.c_void_p
        lib.nft_ctx_new.argtypes = [ctypes.c_uint32]
        lib.nft_ctx_free.argtypes = [ctypes.c_void_p]
        lib.nft_ctx_free.restype = None
        lib.nft_ctx_buffer_output.argtypes = [ctypes.c_void_p]
        lib.nft_ctx_buffer_error.argtypes = [ctypes.c_void_p]
        lib.nft_ctx_get_output_buffer.argtypes = [ctypes.c_void_p]
        lib.nft_ctx_get_output_buffer.restype = ctypes.c_char_p
        lib.nft_ctx_get_error_buffer.argtypes = [ctypes.c_void_p]
        lib.nft_ctx_get_error_buffer.restype = ctypes.c_char_p
        lib.nft_run_cmd_from_buffer.argtypes = [ctypes.c_void_p, ctypes.c_char_p]
        lib.nft_run_cmd_from_buffer.restype = ctypes.c_int
        self._lib = lib
        self._ctx: dict[str, int | None] = {}  # None: this namespace uses the CLI
        self._cli = NftCli()
        self._lock = threading.Lock()

    @staticmethod
    def _lowest_free_fd() -> int:
        fd = os.open(os.devnull, os.O_RDONLY | os.O_CLOEXEC)
        os.close(fd)
        return fd

    def _context(self) -> int | None:
        ns = os.readlink("/proc/thread-self/ns/net")
        if ns in self._ctx:
            return self._ctx[ns]
        ctx: int | None = None
        if self._lowest_free_fd() < self.FD_LIMIT:
            raw = self._lib.nft_ctx_new(0)
            if not raw:
                raise NftError("nft_ctx_new failed")
            ctx = int(raw)
            self._lib.nft_ctx_buffer_output(ctx)
            self._lib.nft_ctx_buffer_error(ctx)
        else:
            log.warning("too many open files for libnftables (select); using the nft CLI")
        self._ctx[ns] = ctx
        return ctx

    def run(self, text: str) -> str:
        with self._lock:
            ctx = self._context()
            if ctx is not None:
                rc = self._lib.nft_run_cmd_from_buffer(ctx, text.encode())
                out = (self._lib.nft_ctx_get_output_buffer(ctx) or b"").decode(errors="replace")
                err = (self._lib.nft_ctx_get_error_buffer(ctx) or b"").decode(errors="replace")
        if ctx is None:
            return self._cli.run(text)
        if rc != 0:
            raise NftError(err.strip()[:4000] or f"libnftables returned {rc}")
        return out

    def close(self) -> None:
        with self._lock:
            for ctx in self._ctx.values():
                if ctx is not None:
                    self._lib.nft_ctx_free(ctx)
            self._ctx.clear()

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:  # noqa: S110 - interpreter shutdown: nothing left to do
            pass


_default: NftBackend | None = None
_default_lock = threading.Lock()


def default_backend() -> NftBackend:
    """The process-wide backend: libnftables when the library loads (it is what ``nft``
    links against), else the CLI."""
    global _default
    with _default_lock:
        if _default is None:
            try:
                _default = LibNftables()
            except OSError:
                _default = NftCli()
        return _default


# --- the API tabby-node calls ----------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class ApplyResult:
    changed: bool
    full: bool
    commands: int
    seconds: float
    #: ``sync`` only: what the full computation found different from the incrementally
    #: maintained state (and fixed); 0 when every change came through ``update``
    fixes: int = 0


@dataclasses.dataclass(frozen=True)
class PolicyCounters:
    """What the metrics export (``tabby_policy_rules``, ``tabby_policy_apply_duration_seconds``)."""

    endpoints: int = 0
    policies: int = 0
    rules: int = 0
    sets: int = 0
    set_elements: int = 0
    applies: int = 0
    full_applies: int = 0
    apply_errors: int = 0
    last_apply_seconds: float = 0.0
    last_apply_full: bool = False
    backend: str = ""
    #: ``sync`` calls after the first (the periodic full checks) and what they fixed in all
    checks: int = 0
    check_fixes: int = 0


class PolicyDataplane:
    """NetworkPolicy on this node: keeps the policy IR up to date change by change
    (:class:`~policy.incremental.IncrementalPolicy`) and programs table ``inet tabby`` in
    the calling thread's network namespace with what each change changed. Thread-safe
    (one lock).

    * ``sync(state, nat)``: the whole cluster state. The first call loads it and replaces
      the table atomically (a restart never opens a window). Later calls are the periodic
      check: the full computation (``engine.compute``) against the incrementally kept IR;
      what differs is fixed and counted (``ApplyResult.fixes``, expected 0), and the table
      gets the difference (or, with ``full=True``, is replaced whole).
    * ``update(updates)``: input changes (:class:`~policy.incremental.Update`: a policy,
      namespace, pod, endpoint or the NAT pools, as they are now or gone); the table gets
      exactly the set elements, chains and map entries they change. Needs a first ``sync``.
    * ``add_endpoint(ep, pod)`` / ``remove_endpoint(ns, name)``: one endpoint, before a CNI
      ADD answers (its chains and its addresses in every set exist when it returns) or after
      a DEL; the same path as ``update``.
    * ``explain(src, dst, protocol, port)`` on the current inputs; ``counters``.
    * ``packet_counts()``: with ``visibility``, the packets each policy allowed and each
      namespace denied by isolation, per direction, since this object was made; they
      survive both paths (a difference never deletes a counter that still counts; a full
      replacement reads them first).

    When an incremental transaction is refused, the table is replaced whole.
    """

    def __init__(
        self,
        node: str,
        *,
        iface_prefix: str = DEFAULT_PREFIX,
        families: Iterable[Family] = (4, 6),
        table: str = DEFAULT_TABLE,
        backend: NftBackend | None = None,
        visibility: bool = True,
        counter_reader: Callable[[str], Iterable[tuple[str, int, int]]] | None = None,
    ) -> None:
        self.node = node
        #: table name -> (name, packets, bytes) of its counters, read and zeroed
        self.counter_reader = counter_reader if counter_reader is not None else _reset_counters
        self.families: tuple[Family, ...] = tuple(families)
        self.renderer = Renderer(table, iface_prefix, visibility=visibility)
        self.backend = backend if backend is not None else default_backend()
        self._lock = threading.RLock()
        self._engine = IncrementalPolicy(node, self.families)
        self._synced = False
        #: the table holds what the engine held after the last apply (else: replace it)
        self._table_current = False
        self._counters = PolicyCounters(backend=self.backend.name)
        #: packets (and bytes) counted so far, by what they count; kept while the policy
        #: (or, for default-deny, a policy of the namespace) exists
        self._totals: dict[CounterKey, tuple[int, int]] = {}
        #: the named counters the table holds (name -> what it counts)
        self._counter_names: dict[str, CounterKey] = {}

    @property
    def visibility(self) -> bool:
        return self.renderer.visibility

    # state
    @property
    def synced(self) -> bool:
        """A first ``sync`` happened: the inputs are known."""
        return self._synced

    @property
    def state(self) -> ClusterState | None:
        """The current inputs (None before the first ``sync``)."""
        with self._lock:
            return self._engine.state() if self._synced else None

    def desired(self) -> DesiredState:
        """The IR the table is programmed from (tests, debugging)."""
        with self._lock:
            return self._engine.desired()

    @property
    def counters(self) -> PolicyCounters:
        return self._counters

    def sync(
        self, state: ClusterState, nat: NatConfig | None = None, *, full: bool = False
    ) -> ApplyResult:
        with self._lock:
            start = time.monotonic()
            eng = self._engine
            nat = nat if nat is not None else eng.nat
            if not self._synced:
                eng.load(state, nat)
                self._synced = True
                return self._program(start, full)
            before, nat_before = eng.desired(), eng.nat
            changed = eng.load(state, nat)  # the inputs' differences, as changes
            # the definition, on the very inputs the engine holds now (``state`` with any
            # duplicate key resolved as the engine resolves it: the last one)
            computed = engine.compute(eng.state(), self.node, self.families)
            fixes = differences(before, computed, nat_before, nat)
            if (eng.desired() if changed else before) != computed:
                # Only a fault of the incremental engine gets here: start it afresh.
                log.error(
                    "incremental policy state differs from a full computation with equal"
                    " inputs; rebuilding it"
                )
                self._engine = IncrementalPolicy(self.node, self.families)
                self._engine.load(state, nat)
                self._table_current = False
            if fixes:
                log.warning("policy check: %d differences from the full computation fixed", fixes)
            c = self._counters
            self._counters = dataclasses.replace(
                c, checks=c.checks + 1, check_fixes=c.check_fixes + fixes
            )
            return self._program(start, full, fixes)

    def update(self, updates: Iterable[Update]) -> ApplyResult:
        """Apply input changes; program what they change."""
        with self._lock:
            if not self._synced:
                raise RuntimeError("update before the first sync: the inputs are unknown")
            start = time.monotonic()
            self._engine.apply(updates)
            return self._program(start, False)

    def add_endpoint(self, ep: Endpoint, pod: Pod | None = None) -> ApplyResult:
        with self._lock:
            if not self._synced:
                raise RuntimeError("add_endpoint before the first sync: policies unknown")
            start = time.monotonic()
            if pod is not None:
                self._engine.put_pod(pod)
            self._engine.put_endpoint(ep)
            return self._program(start, False)

    def remove_endpoint(self, namespace: str, name: str) -> ApplyResult:
        """``name`` is the endpoint's (WorkloadEndpoint) name."""
        with self._lock:
            if not self._synced:
                raise RuntimeError("remove_endpoint before the first sync")
            start = time.monotonic()
            self._engine.remove_endpoint(namespace, name)
            return self._program(start, False)

    def explain(
        self,
        src: Target,
        dst: Target,
        protocol: str = "TCP",
        port: int | None = None,
        host_addresses: Iterable[str] = (),
    ) -> Explanation:
        """``engine.explain`` on the current inputs, as seen from this node (its
        ``host_addresses`` reach its pods unpoliced)."""
        with self._lock:
            if not self._synced:
                raise RuntimeError("no state synced yet")
            return engine.explain(
                self._engine.state(),
                src,
                dst,
                protocol,
                port,
                node=self.node,
                host_addresses=host_addresses,
            )

    def packet_counts(self) -> dict[CounterKey, tuple[int, int]]:
        """(packets, bytes) per counter key: what the kernel counted since the last read
        (read and zeroed in one step) added to what was read before; every policy of a
        local pod and every isolated namespace and direction is there, at 0 if nothing was
        counted. Empty without visibility."""
        with self._lock:
            if not self.visibility or not self._synced:
                return {}
            self._harvest()
            self._prune_totals()
            eng = self._engine
            out = dict.fromkeys(counted_keys(eng.chains.values(), eng.programs.values()), (0, 0))
            out.update(self._totals)
            return out

    def isolating(self, iface: str, direction: str) -> tuple[str, ...]:
        """The policies (``namespace/name``) the endpoint chain of host interface ``iface``
        tries for ``direction``, as programmed; () when it is not isolated or unknown."""
        with self._lock:
            if not self._synced:
                return ()
            chains = self._engine.chains
            prog = self._engine.programs.get(iface)
            if prog is None:
                return ()
            jumps = prog.ingress if direction == "ingress" else prog.egress
            return tuple(chains[c].policy for c in jumps or () if c in chains)

    def _harvest(self) -> None:
        """Add the kernel's counters to the totals and zero them (``reset counters``).
        Called when read, and before anything that removes counters: a full replacement,
        a difference that deletes some. A counter the table holds that tabby did not make
        is ignored."""
        names = self._counter_names
        if not self.visibility or not names:
            return
        try:
            read = list(self.counter_reader(self.renderer.table))
        except (OSError, NftError) as e:
            log.warning("cannot read the policy counters: %s", e)
            return
        for name, packets, nbytes in read:
            key = names.get(name)
            if key is None or not packets:
                continue
            p, b = self._totals.get(key, (0, 0))
            self._totals[key] = (p + packets, b + nbytes)

    def _prune_totals(self) -> None:
        """Forget the totals of policies that no longer exist (and the default-deny of
        namespaces without any policy), so that deleted policies' series end (when read:
        nothing of it on the path of a change)."""
        if not self._totals:
            return
        policies = self._engine.policies
        namespaces = {ns for ns, _ in policies}
        self._totals = {
            k: v
            for k, v in self._totals.items()
            if (k.namespace, k.policy) in policies
            or (k.policy == DEFAULT_DENY and k.namespace in namespaces)
        }

    def _recount(self, d: Delta | None) -> None:
        """Keep ``_counter_names`` what the table holds after a difference ``d`` (None:
        after a full replacement)."""
        if not self.visibility:
            return
        if d is None:
            self._counter_names = counters_of(self._engine.desired())
            return
        names = self._counter_names
        for c in d.new_chains.values():
            name, key = chain_counter(c)
            names[name] = key
        for p in d.new_endpoints.values():
            names.update(endpoint_counters(p))
        for _, now in d.changed_endpoints.values():  # another pod on the same interface
            names.update(endpoint_counters(now))
        for name in d.gone_chains:
            names.pop(f"pkt-{name}", None)
        for iface in d.gone_endpoints:
            for w in ("ingress", "egress"):
                names.pop(deny_counter(iface, w), None)

    def ruleset(self) -> str:
        """``nft list table inet tabby`` as nft prints it (tests, debugging)."""
        return self.backend.run(f"list table {self.renderer.t}")

    def delete_table(self) -> None:
        """Remove the table (uninstall; tests). tabby-node never calls this on shutdown:
        the ruleset stays in force until the next start replaces it."""
        with self._lock:
            t = self.renderer.t
            self.backend.run(f"add table {t}\ndelete table {t}\n")
            self._table_current = False

    # internals
    def _program(self, start: float, full: bool, fixes: int = 0) -> ApplyResult:
        """Send what changed in the engine since the last call: its delta, or the whole
        table (``full``, a table not known to be current, a delta nft refused)."""
        delta = self._engine.take_delta()
        lines: list[str] | None = None
        if not full and self._table_current:
            lines = self.renderer.incremental(delta)
        if lines is not None and not lines:
            return ApplyResult(False, False, 0, time.monotonic() - start, fixes)
        done_full = lines is None
        try:
            if lines is not None:
                if any(line.startswith("delete counter ") for line in lines):
                    self._harvest()
                try:
                    self.backend.run("\n".join(lines) + "\n")
                except NftError as exc:
                    # The kernel differs from what we think we programmed: replace it all.
                    log.warning("incremental nftables update failed (%s); replacing the table", exc)
                    self._count_error()
                    done_full = True
            if done_full:
                self._harvest()
                text = self.renderer.full(Snapshot(self._engine.desired(), self._engine.nat))
                lines = text.splitlines()
                self.backend.run(text)
        except NftError:
            self._table_current = False
            self._count_error()
            raise
        self._table_current = True
        self._recount(None if done_full else delta)
        seconds = time.monotonic() - start
        endpoints, policies, rules, sets, elements = self._engine.stats()
        nat = self._engine.nat
        if nat.enabled:
            nat_sets = nat.elements()
            sets += len(nat_sets)
            elements += sum(len(e) for e in nat_sets.values())
        c = self._counters
        self._counters = dataclasses.replace(
            c,
            endpoints=endpoints,
            policies=policies,
            rules=rules,
            sets=sets,
            set_elements=elements,
            applies=c.applies + 1,
            full_applies=c.full_applies + (1 if done_full else 0),
            last_apply_seconds=seconds,
            last_apply_full=done_full,
        )
        assert lines is not None
        return ApplyResult(True, done_full, len(lines), seconds, fixes)

    def _count_error(self) -> None:
        self._counters = dataclasses.replace(
            self._counters, apply_errors=self._counters.apply_errors + 1
        )


def _reset_counters(table: str) -> list[tuple[str, int, int]]:
    from dataplane.nfnetlink import reset_counters

    return reset_counters(table)


Mechanism = Literal["libnftables", "nft-cli", "nft-cli-json"]


def backend_named(name: Mechanism) -> NftBackend:
    if name == "libnftables":
        return LibNftables()
    return NftCli(json=name == "nft-cli-json")


__all__ = [
    "DEFAULT_DENY",
    "LOG_BURST",
    "LOG_FLOW_SECONDS",
    "LOG_GROUP",
    "LOG_PREFIX",
    "LOG_RATE",
    "ApplyResult",
    "CounterKey",
    "LibNftables",
    "NatConfig",
    "NftBackend",
    "NftCli",
    "NftError",
    "PolicyCounters",
    "PolicyDataplane",
    "Renderer",
    "Snapshot",
    "backend_named",
    "chain_counter",
    "counted_keys",
    "counters_of",
    "default_backend",
    "endpoint_counters",
]
