"""The nft text of the policy table ``inet tabby``: the IR (whole, or a change) as the flat
commands one atomic transaction is made of. Pure: the dataplane applies the text
(``dataplane.nft``); nothing here talks to the kernel.

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

:meth:`Renderer.full` replaces the whole table (``add table; delete table; <everything>``:
the kernel switches atomically, so a restart never opens a window); :meth:`Renderer.delta`
diffs two states; :meth:`Renderer.incremental` gives the very same lines from a
:class:`~policy.incremental.Delta` alone. With visibility, every accept rule of a policy
chain counts into the policy's named counter (:mod:`policy.counters`), and an endpoint chain
counts what it denies into its ``deny-`` counter before it sends the packet through
``log-ingress``/``log-egress`` (NFLOG, rate-limited and once per flow) and drops it. Only
packets that open a connection reach these chains (``ct state established,related accept``
comes first), so counting costs a long stream nothing.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Iterator, Mapping, Sequence

from dataplane.names import DEFAULT_VETH_PREFIX, NFT_TABLE
from policy.calico import FailsafePort, Failsafes
from policy.counters import (
    DEFAULT_DENY,
    CounterKey,
    chain_counter,
    chain_counters,
    counters_of,
    deny_counter,
    endpoint_counters,
    rule_counter,
    staged_end_counter,
)
from policy.engine import (
    HOST_STAGES,
    DesiredState,
    Direction,
    Element,
    EndpointProgram,
    HostProgram,
    HostStage,
    IRRule,
    NatConfig,
    PolicyChain,
    SetDef,
    SideMatch,
    TierRule,
    TierSpan,
    host_chain_name,
)
from policy.incremental import Delta

#: The table is ``inet <DEFAULT_TABLE>`` (the dataplane names what tabby makes in the kernel).
DEFAULT_TABLE = NFT_TABLE
#: The base chains police the interfaces ``<DEFAULT_PREFIX>*``: the host veths.
DEFAULT_PREFIX = DEFAULT_VETH_PREFIX
#: The base chains and the direction of policy each one decides: the sending pod's egress
#: (``fwd-egress``; ``input``: a pod to its node) or the receiving pod's ingress.
BASE_CHAINS = {"fwd-egress": "egress", "input": "egress", "fwd-ingress": "ingress"}
_FAM = {4: "ip", 6: "ip6"}
_SET_TYPE = {
    ("addr", 4): "ipv4_addr",
    ("addr", 6): "ipv6_addr",
    ("cidr", 4): "ipv4_addr",
    ("cidr", 6): "ipv6_addr",
    ("named-port", 4): "ipv4_addr . inet_proto . inet_service",
    ("named-port", 6): "ipv6_addr . inet_proto . inet_service",
    ("sel", 4): "ipv4_addr",
    ("sel", 6): "ipv6_addr",
    ("selnet", 4): "ipv4_addr",
    ("selnet", 6): "ipv6_addr",
}
_INTERVAL = ("cidr", "selnet")
#: The mark bit a Calico rule's Pass sets before it returns: the endpoint chain skips the
#: rest of the tier while it is set and clears it at the tier's end (and before the first).
PASS_MARK = 0x01000000
_PASS_SET = f"meta mark and {PASS_MARK:#010x} == {PASS_MARK:#010x}"
_PASS_CLEAR = f"meta mark and {PASS_MARK:#010x} == 0x00000000 "
#: The mark bits a staged policy's rule sets before it returns: one that would Allow or
#: Deny (``STAGED_DECIDED_MARK``: no later staged chain is tried, no staged tier's end
#: counted), one that would Pass (``STAGED_PASS_MARK``: its tier's end is not counted;
#: cleared after the tier). Both cleared at the start of an endpoint chain that has staged
#: policies: a packet forwarded from one local pod to another meets two.
STAGED_DECIDED_MARK = 0x04000000
STAGED_PASS_MARK = 0x08000000
_STAGED_UNDECIDED = f"meta mark and {STAGED_DECIDED_MARK:#010x} == 0x00000000 "
_STAGED_NOTHING = f"meta mark and {STAGED_DECIDED_MARK | STAGED_PASS_MARK:#010x} == 0x00000000 "
#: The mark bit an untracked or pre-DNAT policy's Allow sets: the later host-endpoint
#: chains accept the packet at once (Calico: such an Allow skips normal policy).
HOST_ACCEPT_MARK = 0x02000000
_HOST_ACCEPTED = f"meta mark and {HOST_ACCEPT_MARK:#010x} == {HOST_ACCEPT_MARK:#010x}"
#: The host endpoints' base chains: name -> (hook, the interface key and the stage each
#: dispatches; forward dispatches through two regular chains, ``host-fwd-in`` / ``-out``).
HOST_BASE_CHAINS: dict[str, tuple[str, str, HostStage | None]] = {
    "host-raw-pre": ("prerouting priority raw", "iifname", "untracked-ingress"),
    "host-raw-out": ("output priority raw", "oifname", "untracked-egress"),
    "host-prednat": ("prerouting priority mangle", "iifname", "prednat-ingress"),
    "host-input": ("input priority filter + 2", "iifname", "ingress"),
    "host-output": ("output priority filter + 2", "oifname", "egress"),
    "host-forward": ("forward priority filter + 2", "", None),
}
_HOST_DISPATCH: dict[str, tuple[str, HostStage]] = {
    "host-fwd-in": ("iifname", "forward-ingress"),
    "host-fwd-out": ("oifname", "forward-egress"),
}
#: What a Calico Log rule's packets carry to NFLOG group LOG_GROUP (the next rule decides),
#: and a staged policy's rule that would have denied them: ``<prefix><direction> <counter>``
#: (the rule's counter names it). Both within the node-wide limit of the denied-flow log.
RULE_LOG_PREFIX = "tabby-log "
STAGED_LOG_PREFIX = "tabby-staged "


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
_PORTED = "{ tcp, udp, sctp }"


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


#: nft's longest comment, in bytes: a longer one fails the whole transaction ("comment
#: too long"), and a NetworkPolicy's name alone may be 253 characters.
MAX_COMMENT = 128
_COMMENT_TAIL = 48


def comment_text(text: str) -> str:
    """``text`` as a comment holds it: printable, no quote or backslash (each such
    character ``_``), at most MAX_COMMENT bytes: a longer one keeps its start and its end
    (which says the direction and the rule, or "no ingress policy"), "..." between.
    ``tabbyctl policy trace`` compares the kernel's comments with these."""
    clean = "".join(c if c.isprintable() and c not in '"\\' else "_" for c in text)
    raw = clean.encode()
    if len(raw) <= MAX_COMMENT:
        return clean
    tail = raw[-_COMMENT_TAIL:].decode("utf-8", "ignore")  # a cut character is dropped
    head = raw[: MAX_COMMENT - 3 - _COMMENT_TAIL].decode("utf-8", "ignore")
    return f"{head}...{tail}"


def _quote(text: str) -> str:
    return f'"{comment_text(text)}"'


def _clear(passed: str, staged: Sequence[str]) -> str:
    """The statement that clears, after a tier, the Pass bit (when a policy of it could
    Pass: ``passed`` is its guard) and the staged Pass bit (when it has staged policies)."""
    bits = (PASS_MARK if passed else 0) | (STAGED_PASS_MARK if staged else 0)
    return f"meta mark set meta mark and {0xFFFFFFFF ^ bits:#010x}"


def _rule_log(prefix: str, direction: str, counter: str) -> str:
    """The statements that send a packet to the policy log, named by a rule's counter,
    within the node-wide limit."""
    what = _quote(f"{prefix}{direction} {counter}")
    return f'limit name "log-denied" log prefix {what} group {LOG_GROUP} snaplen {LOG_SNAPLEN}'


def _element(e: Element) -> str:
    if isinstance(e, tuple):
        addr, proto, port = e
        return f"{addr} . {proto} . {port}"
    return e


def _set_text(items: Sequence[str]) -> str:
    return items[0] if len(items) == 1 else "{ " + ", ".join(items) + " }"


def _ports(ranges: Sequence[tuple[int, int]]) -> str:
    items = [str(lo) if lo == hi else f"{lo}-{hi}" for lo, hi in ranges]
    return items[0] if len(items) == 1 else "{ " + ", ".join(items) + " }"


class Renderer:
    """nft text for one table. Every statement is a flat command (``add ...``), so full and
    incremental transactions are made of the same pieces."""

    def __init__(
        self,
        table: str = DEFAULT_TABLE,
        prefix: str = DEFAULT_PREFIX,
        *,
        visibility: bool = True,
        failsafes: Failsafes | None = None,
    ) -> None:
        if not table.replace("-", "").replace("_", "").isalnum():
            raise ValueError(f"invalid table name {table!r}")
        if not prefix or not prefix.isalnum() or len(prefix) > 14:
            raise ValueError(f"invalid interface prefix {prefix!r}")
        self.table = table
        self.prefix = prefix
        self.visibility = visibility
        #: what the host endpoints' chains let through before any policy
        self.failsafes = failsafes if failsafes is not None else Failsafes()
        self.t = f"inet {table}"

    # sets
    def add_set(self, d: SetDef) -> str:
        flags = " flags interval;" if d.kind in _INTERVAL else ""
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
        out: list[str] = []
        for r in c.rules:
            if isinstance(r, TierRule):
                out.extend(self.tier_rule(c, r))
            else:
                out.append(self.rule(c, r))
        return out

    @staticmethod
    def _side(m: SideMatch, kw: str, end: str) -> list[str]:
        addr, port = f"{kw} {end}addr", f"th {end}port"
        parts = []
        if m.nets:
            parts.append(f"{addr} {_set_text(m.nets)}")
        if m.not_nets:
            parts.append(f"{addr} != {_set_text(m.not_nets)}")
        if m.in_set is not None:
            parts.append(f"{addr} @{m.in_set}")
        parts.extend(f"{addr} != @{name}" for name in m.not_in_sets)
        if m.ports:
            parts.append(f"{port} {_ports(m.ports)}")
        if m.not_ports:
            parts.append(f"{port} != {_ports(m.not_ports)}")
        if m.named_port_set is not None:
            parts.append(f"{addr} . meta l4proto . {port} @{m.named_port_set}")
        parts.extend(f"{addr} . meta l4proto . {port} != @{n}" for n in m.not_named_port_sets)
        return parts

    def tier_rule(self, c: PolicyChain, r: TierRule) -> list[str]:
        """One rule of a Calico policy's chain: its matches, its counter, its verdict (a
        staged policy's rule counts and returns: it never decides). A ``notICMP`` with a
        code is two rules (another type; the type with another code)."""
        kw = _FAM[r.family]
        icmp = "icmp" if r.family == 4 else "icmpv6"
        parts = [f"meta nfproto ipv{r.family}"]
        if r.protocol is not None:
            parts.append(f"meta l4proto {r.protocol}")
        if r.not_protocol is not None:
            parts.append(f"meta l4proto != {r.not_protocol}")
        if r.icmp is not None:
            parts.append(f"{icmp} type {r.icmp[0]}")
            if r.icmp[1] is not None:
                parts.append(f"{icmp} code {r.icmp[1]}")
        parts += self._side(r.src, kw, "s") + self._side(r.dst, kw, "d")
        alternatives = [parts]
        if r.not_icmp is not None:
            t, code = r.not_icmp
            alternatives = [[*parts, f"{icmp} type != {t}"]]
            if code is not None:
                alternatives.append([*parts, f"{icmp} type {t}", f"{icmp} code != {code}"])
        counter = rule_counter(c, r)[0]
        count = f'counter name "{counter}"' if self.visibility else ""

        def log(prefix: str) -> str:
            return _rule_log(prefix, c.direction, counter)

        first: str | None = None  # a rule before the deciding one: a staged denial's log
        if c.staged:
            bit = STAGED_PASS_MARK if r.verdict == "pass" else STAGED_DECIDED_MARK
            decide = f"meta mark set meta mark or {bit:#010x} return"
            stmts = [count] if r.verdict == "log" else [count, decide]
            if r.verdict == "drop" and self.visibility:
                first = log(STAGED_LOG_PREFIX)
        elif r.verdict == "log":
            stmts = [count, log(RULE_LOG_PREFIX) if self.visibility else ""]
        elif r.verdict == "pass":
            stmts = [count, f"meta mark set meta mark or {PASS_MARK:#010x} return"]
        elif r.verdict == "accept" and c.stage != "normal":
            mark = f"meta mark set meta mark or {HOST_ACCEPT_MARK:#010x}"
            stmts = [count, mark, "notrack accept" if c.stage == "untracked" else "accept"]
        else:
            stmts = [count, r.verdict]
        comment = f"comment {_quote(r.comment)}"
        out = []
        for a in alternatives:
            if first is not None:
                out.append(" ".join((*a, first, comment)))
            out.append(" ".join((*a, *(x for x in stmts if x), comment)))
        return [f"add rule {self.t} {c.name} {line}" for line in out]

    # endpoint chains
    @staticmethod
    def ep_chains(iface: str) -> tuple[str, str]:
        return f"to-{iface}", f"from-{iface}"

    def _tiered(self, p: EndpointProgram, chain: str, what: Direction) -> list[str]:
        """A tiered direction: each tier (its staged policies' chains, which count and
        return, then its policies' chains in order, after one that can Pass only while the
        Pass bit is clear, then its end: Deny counted, logged, dropped, unless Passed);
        past every tier the profile accepts."""
        note = _quote(f"{p.endpoint}: past every tier, the profile allows {what}")
        end = f"accept comment {note}"
        counter = deny_counter(p.interface, what)
        return self._tier_walk(chain, p.tiers(what), p.endpoint, what, counter, end)

    def _tier_walk(
        self,
        chain: str,
        spans: Sequence[TierSpan],
        who: str,
        what: Direction,
        counter: str | None,
        end: str | None,
    ) -> list[str]:
        """The tiers of one chain: each tier's staged policies' chains (while no staged
        rule of an earlier tier would have decided), then its policies' chains in order
        (after one that can Pass, only while the Pass bit is clear), then its end (Deny:
        counted into ``counter``, logged, dropped, unless Passed); past every tier ``end``.
        A tier of staged policies alone ends in its last staged chain's ``-end`` counter
        (and, when it would deny, the staged log) when none of their rules decided."""
        t = self.t
        out = []
        bits = PASS_MARK if any(any(span.passing) for span in spans) else 0
        if any(span.staged for span in spans):
            bits |= STAGED_DECIDED_MARK | STAGED_PASS_MARK
        if bits:
            mask = 0xFFFFFFFF ^ bits
            out.append(f"add rule {t} {chain} meta mark set meta mark and {mask:#010x}")
        for span in spans:
            out.extend(f"add rule {t} {chain} {_STAGED_UNDECIDED}jump {s}" for s in span.staged)
            if not span.enforced:
                out.extend(self._staged_tier_end(chain, span, who, what))
                continue
            guard = ""
            for name, passing in zip(span.chains, span.passing, strict=True):
                out.append(f"add rule {t} {chain} {guard}jump {name}")
                if passing:
                    guard = _PASS_CLEAR
            if span.default_action == "Deny":
                if self.visibility:
                    count = f'counter name "{counter}" ' if counter is not None else ""
                    out.append(f"add rule {t} {chain} {guard}{count}jump log-{what}")
                note = _quote(f"{who}: end of tier {span.tier}")
                out.append(f"add rule {t} {chain} {guard}drop comment {note}")
            if guard or span.staged:
                out.append(f"add rule {t} {chain} {_clear(guard, span.staged)}")
        if end is not None:
            out.append(f"add rule {t} {chain} {end}")
        return out

    def _staged_tier_end(self, chain: str, span: TierSpan, who: str, what: Direction) -> list[str]:
        """The end of a tier only staged policies select the endpoint in: nothing decides
        here; when none of the staged rules would have (this tier or an earlier one), the
        tier's end is counted into its last staged chain's ``-end`` counter and, when it
        would deny, logged as the staged policy's; then the staged Pass bit is cleared."""
        t = self.t
        out = []
        if self.visibility:
            counter = staged_end_counter(span.staged[-1])
            denies = span.default_action == "Deny"
            log = _rule_log(STAGED_LOG_PREFIX, what, counter) if denies else ""
            note = _quote(f"{who}: staged end of tier {span.tier}")
            body = " ".join(x for x in (f'counter name "{counter}"', log) if x)
            out.append(f"add rule {t} {chain} {_STAGED_NOTHING}{body} comment {note}")
        out.append(f"add rule {t} {chain} {_clear('', span.staged)}")
        return out

    def endpoint_rules(self, p: EndpointProgram) -> list[str]:
        out = []
        to, frm = self.ep_chains(p.interface)
        ways: tuple[tuple[str, tuple[str, ...] | None, Direction], ...] = (
            (to, p.ingress, "ingress"),
            (frm, p.egress, "egress"),
        )
        for chain, jumps, what in ways:
            if p.tiered(what):
                out.extend(self._tiered(p, chain, what))
                continue
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

    # host endpoints
    def _failsafe_rules(self, way: str, raw: bool) -> list[str]:
        """What the failsafe ports let through, as rule bodies (accepting): ``way``
        ``in`` (to the host: inbound ports by destination port, from their nets) or ``out``
        (from it: outbound ports to theirs). Before connection tracking (``raw``) the
        replies of the other way's connections too (by source port)."""
        fs = self.failsafes
        ports, replies = (fs.inbound, fs.outbound) if way == "in" else (fs.outbound, fs.inbound)
        remote = "s" if way == "in" else "d"
        out = self._failsafe_matches(ports, "dport", remote)
        if raw:
            out += self._failsafe_matches(replies, "sport", remote)
        return out

    @staticmethod
    def _failsafe_matches(ports: Sequence[FailsafePort], port: str, remote: str) -> list[str]:
        out = []
        for proto in ("tcp", "udp"):
            plain = sorted({f.port for f in ports if f.protocol == proto and f.net is None})
            if plain:
                numbers = _ports([(p, p) for p in plain])
                out.append(f'meta l4proto {proto} th {port} {numbers} accept comment "failsafe"')
        for f in ports:
            if f.net is not None:
                kw = "ip6" if ":" in f.net else "ip"
                out.append(
                    f"{kw} {remote}addr {f.net} meta l4proto {f.protocol} th {port} {f.port}"
                    f' accept comment "failsafe"'
                )
        return out

    def _dispatch(
        self, chain: str, key: str, stage: HostStage, hosts: Sequence[HostProgram]
    ) -> list[str]:
        """A workload's interface and ``lo`` out; each named interface to its host
        endpoint's chain for ``stage``, then every other interface to the ``"*"``
        endpoint's (a chain that ends undecided: the base chain's accept, or back to the
        chain that jumped here)."""
        t = self.t
        out = [f'add rule {t} {chain} {key} "{self.prefix}*" return']
        out.append(f'add rule {t} {chain} {key} "lo" return')
        for h in hosts:
            if h.interface != "*":
                goto = f"goto {host_chain_name(h.name, stage)}"
                out.append(f'add rule {t} {chain} {key} "{h.interface}" {goto}')
        for h in hosts:
            if h.interface == "*":
                out.append(f"add rule {t} {chain} goto {host_chain_name(h.name, stage)}")
        return out

    def _host_base_rules(self, hosts: Sequence[HostProgram]) -> list[str]:
        """The rules of the host endpoints' base and dispatch chains: before connection
        tracking the failsafe ports (and their replies), then the endpoint; later, what an
        untracked or pre-DNAT Allow marked and established connections accepted, the
        failsafe ports, then the endpoint."""
        t = self.t
        out: list[str] = []
        for chain, (_, key, stage) in HOST_BASE_CHAINS.items():
            if stage is None:  # forward: both interfaces' endpoints, in turn
                out.append(f"add rule {t} {chain} {_HOST_ACCEPTED} accept")
                out.append(f"add rule {t} {chain} ct state established,related accept")
                out.extend(f"add rule {t} {chain} jump {d}" for d in _HOST_DISPATCH)
                continue
            dispatch = self._dispatch(chain, key, stage, hosts)
            out.extend(dispatch[:2])
            untracked = HOST_STAGES[stage][0] == "untracked"
            if not untracked:
                out.append(f"add rule {t} {chain} {_HOST_ACCEPTED} accept")
                out.append(f"add rule {t} {chain} ct state established,related accept")
            way = "in" if key == "iifname" else "out"
            out.extend(f"add rule {t} {chain} {r}" for r in self._failsafe_rules(way, untracked))
            out.extend(dispatch[2:])
        for chain, (key, stage) in _HOST_DISPATCH.items():
            out.extend(self._dispatch(chain, key, stage, hosts))
        return out

    def host_rules(self, h: HostProgram) -> list[str]:
        """The chains of one host endpoint, one per stage: its tiers; an untracked or
        pre-DNAT stage ends undecided (on to the next stage), the others in a drop (past
        every tier: a host endpoint has no profile) but forwarded traffic with no
        applyOnForward policy, which goes on."""
        out: list[str] = []
        for stage, (kind, what, forwarded) in HOST_STAGES.items():
            chain = host_chain_name(h.name, stage)
            spans = h.spans(stage)
            who = f"host endpoint {h.name}"
            if kind != "normal" or (forwarded and not spans):
                out.extend(self._tier_walk(chain, spans, who, what, None, None))
                continue
            why = "past every tier" if spans else f"no {what} policy"
            if self.visibility:
                out.extend(self._tier_walk(chain, spans, who, what, None, f"jump log-{what}"))
            else:
                out.extend(self._tier_walk(chain, spans, who, what, None, None))
            out.append(f"add rule {self.t} {chain} drop comment {_quote(f'{who}: {why}')}")
        return out

    def host_chains(self, h: HostProgram) -> list[str]:
        return [host_chain_name(h.name, stage) for stage in HOST_STAGES]

    def host_objects(self, hosts: Mapping[str, HostProgram]) -> list[str]:
        """Everything of the host endpoints in a full table (none without one)."""
        if not hosts:
            return []
        t = self.t
        progs = [hosts[n] for n in sorted(hosts)]
        out = [f"add chain {t} {c}" for h in progs for c in self.host_chains(h)]
        out.extend(f"add chain {t} {c}" for c in _HOST_DISPATCH)
        for h in progs:
            out.extend(self.host_rules(h))
        for chain, (hook, _, _) in HOST_BASE_CHAINS.items():
            out.append(f"add chain {t} {chain} {{ type filter hook {hook}; policy accept; }}")
        return out + self._host_base_rules(progs)

    def host_delta(
        self, was: Mapping[str, HostProgram], now: Mapping[str, HostProgram]
    ) -> tuple[list[str], list[str]]:
        """The host endpoints' programs changed (both non-empty): (what goes before the
        removals, what goes with them). Every host chain is written again: they are few."""
        t = self.t
        progs = [now[n] for n in sorted(now)]
        out = [
            f"add chain {t} {c}"
            for n in sorted(now.keys() - was.keys())
            for c in self.host_chains(now[n])
        ]
        kept = [now[n] for n in sorted(now.keys() & was.keys())]
        out.extend(f"flush chain {t} {c}" for h in kept for c in self.host_chains(h))
        out.extend(f"flush chain {t} {c}" for c in (*_HOST_DISPATCH, *HOST_BASE_CHAINS))
        for h in progs:
            out.extend(self.host_rules(h))
        out.extend(self._host_base_rules(progs))
        late: list[str] = []
        for n in sorted(was.keys() - now.keys()):
            for c in self.host_chains(was[n]):
                late.extend((f"flush chain {t} {c}", f"delete chain {t} {c}"))
        return out, late

    # visibility: counters and the denied-flow log
    def add_counter(self, name: str, key: CounterKey) -> str:
        if key.policy == DEFAULT_DENY:  # an endpoint's: the same whoever has the interface
            what = f"{key.direction} denied by isolation"
        elif key.tier:
            ns = f"{key.namespace}/" if key.namespace else ""
            staged = "staged " if key.staged else ""
            what = f"{staged}{key.tier}/{ns}{key.policy} {key.rule} {key.verdict}"
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
        out.extend(self.host_objects(ir.hosts))
        return "\n".join(out) + "\n"

    def delta(self, old: Snapshot, new: Snapshot) -> list[str] | None:
        """Commands that turn ``old`` into ``new`` (one transaction); ``None`` when only a
        full replacement can do it (e.g. NAT switched on or off)."""
        if old.nat.enabled != new.nat.enabled or bool(old.ir.hosts) != bool(new.ir.hosts):
            return None
        t = self.t
        out = self._set_delta(old, new)
        if out is None:
            return None
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
            was = oeps.get(iface)
            if was is None:
                out.extend(self.endpoint_rules(p))
            elif was is not p and was != p:
                out.extend(self._changed_endpoint(iface, was, p))
        out.extend(self.map_elements("add", neps.keys() - oeps.keys()))
        late = self._removals(
            sorted(oeps.keys() - neps.keys()),
            sorted(ochains.keys() - nchains.keys()),
            sorted(old.all_sets().keys() - new.all_sets().keys()),
        )
        late.extend(f"delete counter {t} {name}" for name in sorted(ocount.keys() - ncount.keys()))
        if old.ir.hosts != new.ir.hosts:
            early, gone = self.host_delta(old.ir.hosts, new.ir.hosts)
            return out + early + gone + late
        return out + late

    def _set_delta(self, old: Snapshot, new: Snapshot) -> list[str] | None:
        """The sets made and the elements changed, set by set; ``None`` when a set changed
        its kind or family (only a full replacement can do that)."""
        out: list[str] = []
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
        return out

    def _changed_endpoint(
        self, iface: str, was: EndpointProgram, now: EndpointProgram
    ) -> list[str]:
        """An endpoint's chains written again, unless only its addresses differ (nothing
        in the chains then)."""
        if dataclasses.replace(was, addresses=now.addresses) == now:
            return []
        return [
            *(f"flush chain {self.t} {c}" for c in self.ep_chains(iface)),
            *self.endpoint_rules(now),
        ]

    def _removals(
        self, endpoints: Iterable[str], chains: Iterable[str], sets: Iterable[str]
    ) -> list[str]:
        """What goes last in a transaction: the gone endpoints out of the maps, then their
        chains, the gone policy chains and the gone sets deleted (in this order)."""
        t = self.t
        endpoints = list(endpoints)
        late = self.map_elements("delete", endpoints)
        for iface in endpoints:
            for c in self.ep_chains(iface):
                late.extend((f"flush chain {t} {c}", f"delete chain {t} {c}"))
        for name in chains:
            late.extend((f"flush chain {t} {name}", f"delete chain {t} {name}"))
        late.extend(f"delete set {t} {name}" for name in sets)
        return late

    def incremental(self, d: Delta) -> list[str] | None:
        """Commands for a :class:`~policy.incremental.Delta`: what :meth:`delta` sends for
        the two states the delta lies between, line for line, made from the delta alone
        (no IR is diffed). ``None`` when only a full replacement can do it (NAT switched
        on or off)."""
        t = self.t
        if d.replace:
            return None
        by_set = self._set_commands(d)
        if by_set is None:
            return None
        out = [line for name in sorted(by_set) for line in by_set[name]]
        if self.visibility:
            came: dict[str, CounterKey] = {}
            for c in d.new_chains.values():
                came.update(chain_counters(c))
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
            else:
                out.extend(self._changed_endpoint(iface, *d.changed_endpoints[iface]))
        out.extend(self.map_elements("add", d.new_endpoints))
        late = self._removals(d.gone_endpoints, d.gone_chains, d.gone_sets)
        if self.visibility:
            rules = d.gone_rule_counters
            gone = [f"pkt-{name}" for name in d.gone_chains if name not in rules]
            gone += [name for chain in d.gone_chains for name in rules.get(chain, ())]
            gone += [deny_counter(i, w) for i in d.gone_endpoints for w in ("ingress", "egress")]
            late.extend(f"delete counter {t} {name}" for name in sorted(gone))
        if d.hosts is not None:
            early, gone_hosts = self.host_delta(*d.hosts)
            return out + early + gone_hosts + late
        return out + late

    def _set_commands(self, d: Delta) -> dict[str, list[str]] | None:
        """The commands of each set a delta makes or changes (the NAT sets too); ``None``
        when NAT was switched on or off."""
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
        return by_set


__all__ = [
    "BASE_CHAINS",
    "DEFAULT_PREFIX",
    "DEFAULT_TABLE",
    "LOG_BURST",
    "LOG_FLOW_SECONDS",
    "LOG_GROUP",
    "LOG_PREFIX",
    "LOG_RATE",
    "Renderer",
    "Snapshot",
]
