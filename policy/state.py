"""NetworkPolicy on this node: the policy state tabby-node keeps, and what it sends the
kernel.

:class:`PolicyDataplane` keeps the IR up to date change by change
(:mod:`policy.incremental`) and has what each change changed rendered (set elements, flushed
and refilled chains, map elements: :meth:`~policy.render.Renderer.incremental`, the same
lines :meth:`~policy.render.Renderer.delta` would diff out of the two states) and applied as
one transaction; the first apply (and ``sync(full=True)``, and any refused difference)
replaces the whole table in one transaction, so a restart never opens a window. It is given
the applier (``backend``: :class:`dataplane.nft.NftBackend`, by default the process's
libnftables or the ``nft`` CLI) and the counter reader (by default
:func:`dataplane.nfnetlink.reset_counters`); the dataplane applies the text and knows no
policy. Everything runs in the network namespace of the calling thread.

Visibility (``PolicyDataplane(visibility=True)``, :mod:`policy.counters`): the kernel's
counters are read and zeroed (netlink ``GETOBJ_RESET``, what ``nft reset counters`` sends)
by :meth:`PolicyDataplane.packet_counts` and summed here, so a full replacement of the
table (which makes new counters) loses nothing but the packets of the moment between the
read and the replacement.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from collections.abc import Callable, Collection, Iterable

from dataplane.errors import NftError
from dataplane.nft import NftBackend, default_backend
from policy import engine
from policy.calico import Failsafes
from policy.counters import (
    DEFAULT_DENY,
    END_OF_TIER,
    CounterKey,
    chain_counters,
    counted_keys,
    counters_of,
    deny_counter,
    endpoint_counters,
)
from policy.engine import (
    ClusterState,
    DesiredState,
    Endpoint,
    Explanation,
    Family,
    NatConfig,
    Pod,
    Target,
    TierRule,
)
from policy.incremental import Delta, IncrementalPolicy, Update, differences
from policy.render import DEFAULT_PREFIX, DEFAULT_TABLE, Renderer, Snapshot

log = logging.getLogger("tabby.node.policy")
#: Reads and zeroes counters of a table: (table, names or None for all) -> (name, packets,
#: bytes) of each.
CounterReader = Callable[[str, Collection[str] | None], Iterable[tuple[str, int, int]]]


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
    the calling thread's network namespace with what each change changed, through the
    applier it is given (``backend``; default :func:`dataplane.nft.default_backend`).
    Thread-safe (one lock).

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
        counter_reader: CounterReader | None = None,
        failsafes: Failsafes | None = None,
    ) -> None:
        self.node = node
        #: (table name, the counters' names or None: all) -> (name, packets, bytes) of
        #: those counters, read and zeroed
        self.counter_reader = counter_reader if counter_reader is not None else _reset_counters
        self.families: tuple[Family, ...] = tuple(families)
        self.renderer = Renderer(table, iface_prefix, visibility=visibility, failsafes=failsafes)
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
        *,
        in_interface: str | None = None,
        out_interface: str | None = None,
    ) -> Explanation:
        """``engine.explain`` on the current inputs, as seen from this node (its
        ``host_addresses`` reach its pods unpoliced; its host endpoints' stages, with the
        failsafe ports it programs, for traffic to, from or through it on
        ``in_interface`` / ``out_interface``)."""
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
                in_interface=in_interface,
                out_interface=out_interface,
                failsafes=self.renderer.failsafes,
                workload_prefix=self.renderer.prefix,
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

    def rule_of_counter(self, counter: str) -> str | None:
        """The Calico rule (``<tier>/<policy> <direction>[<i>]``) whose named counter is
        ``counter`` (``pkt-<chain>-<i>``), as programmed; None when there is none."""
        chain, _, index = counter.removeprefix("pkt-").rpartition("-")
        with self._lock:
            c = self._engine.chains.get(chain)
            if c is not None and c.end_action is not None and index == "end":
                return f"{c.tier}/{c.policy} {c.direction} {END_OF_TIER}"
            if c is None or not index.isdigit():
                return None
            for r in c.rules:
                if isinstance(r, TierRule) and r.rule == int(index):
                    return r.comment
        return None

    def _harvest(self, only: Collection[str] | None = None) -> None:
        """Add the kernel's counters to the totals and zero them (``reset counters``):
        all of them, or ``only`` those (the ones a difference deletes: the others keep
        counting in the kernel, read later). Called when read, and before anything that
        removes counters: a full replacement, a difference that deletes some. A counter
        the table holds that tabby did not make is ignored."""
        names = self._counter_names
        if not self.visibility or not names:
            return
        try:
            read = list(self.counter_reader(self.renderer.table, only))
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
        calico = {
            (c.namespace or "", c.name, c.staged) for c in self._engine.calico_policies.values()
        }
        namespaces = {ns for ns, _ in policies}
        namespaces |= {ns for ns, _, _ in calico}
        self._totals = {
            k: v
            for k, v in self._totals.items()
            if (not k.tier and (k.namespace, k.policy) in policies)
            or (k.tier and (k.namespace, k.policy, k.staged) in calico)
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
            names.update(chain_counters(c))
        for p in d.new_endpoints.values():
            names.update(endpoint_counters(p))
        for _, now in d.changed_endpoints.values():  # another pod on the same interface
            names.update(endpoint_counters(now))
        for name in d.gone_chains:
            names.pop(f"pkt-{name}", None)
            for counter in d.gone_rule_counters.get(name, ()):
                names.pop(counter, None)
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
                deleted = [
                    line.rsplit(" ", 1)[1] for line in lines if line.startswith("delete counter ")
                ]
                if deleted:  # what they counted is kept; the table's other counters run on
                    self._harvest(deleted)
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


def _reset_counters(table: str, names: Collection[str] | None) -> list[tuple[str, int, int]]:
    from dataplane.nfnetlink import reset_counters

    return reset_counters(table, names)


__all__ = ["ApplyResult", "PolicyCounters", "PolicyDataplane"]
