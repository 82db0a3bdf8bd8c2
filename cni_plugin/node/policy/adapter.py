"""Resource models (``ipam.resources``) -> the policy engine's inputs.

The models already carry the API server's defaulting and validation (``policyTypes``, a
port's protocol, ``except`` inside ``cidr``, ...); this module only changes representation.
WorkloadEndpoints may come as models or as their stored documents (``ipam.resources.wep``).

The models are taken duck-typed (``Any``, attribute access as in ``ipam.resources.k8s`` and
``ipam.resources.tabby``) so this module imports nothing from the datastore library; the
unit tests run it on the real models.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from cni_plugin.node.policy import engine
from cni_plugin.node.policy.nft import NatConfig


def selector(sel: Any) -> engine.LabelSelector:
    exprs = tuple(
        engine.Requirement(e.key, e.operator, tuple(e.values or ()))
        for e in sel.matchExpressions or ()
    )
    return engine.LabelSelector(tuple((sel.matchLabels or {}).items()), exprs)


def _peer(p: Any) -> engine.Peer:
    if p.ipBlock is not None:
        block = engine.IPBlock(p.ipBlock.cidr, tuple(p.ipBlock.except_ or ()))
        return engine.Peer(ip_block=block)
    return engine.Peer(
        selector(p.podSelector) if p.podSelector is not None else None,
        selector(p.namespaceSelector) if p.namespaceSelector is not None else None,
    )


def _port(p: Any) -> engine.PortSpec:
    return engine.PortSpec(p.protocol, p.port, p.endPort)


def policy(np: Any) -> engine.Policy:
    spec = np.spec
    ingress = tuple(
        engine.Rule(tuple(_peer(x) for x in r.from_ or ()), tuple(_port(x) for x in r.ports or ()))
        for r in spec.ingress or ()
    )
    egress = tuple(
        engine.Rule(tuple(_peer(x) for x in r.to or ()), tuple(_port(x) for x in r.ports or ()))
        for r in spec.egress or ()
    )
    return engine.Policy(
        np.metadata.namespace or "default",
        np.metadata.name or "",
        selector(spec.podSelector),
        ingress,
        egress,
        tuple(spec.policyTypes or ()),
    )


def namespace(ns: Any) -> engine.Namespace:
    return engine.Namespace(ns.metadata.name or "", tuple((ns.metadata.labels or {}).items()))


def pod(p: Any) -> engine.Pod:
    ports = tuple(
        engine.ContainerPort(name, number, proto) for name, proto, number in p.named_ports()
    )
    return engine.Pod(
        p.metadata.namespace or "default",
        p.metadata.name or "",
        tuple((p.metadata.labels or {}).items()),
        ports,
    )


def endpoint(wep: Any) -> engine.Endpoint:
    """A WorkloadEndpoint model or its stored document. One without ``hostInterface`` gets
    an empty interface: its addresses count for selectors, but no chain is made for it."""
    if isinstance(wep, Mapping):
        meta = wep.get("metadata") or {}
        spec = wep.get("spec") or {}
        return engine.Endpoint(
            str(meta.get("namespace") or "default"),
            str(spec.get("pod") or ""),
            str(spec.get("node") or ""),
            str(spec.get("hostInterface") or ""),
            tuple(str(a) for a in spec.get("ipNetworks") or ()),
            str(meta.get("name") or ""),
            tuple((meta.get("labels") or {}).items()),
        )
    return engine.Endpoint(
        wep.metadata.namespace or "default",
        wep.spec.pod,
        wep.spec.node,
        wep.spec.hostInterface or "",
        tuple(wep.spec.ipNetworks),
        wep.metadata.name or "",
        tuple((wep.metadata.labels or {}).items()),
    )


def cluster_state(
    policies: Iterable[Any],
    namespaces: Iterable[Any],
    pods: Iterable[Any],
    endpoints: Iterable[Any],
) -> engine.ClusterState:
    return engine.ClusterState(
        tuple(policy(p) for p in policies),
        tuple(namespace(n) for n in namespaces),
        tuple(pod(p) for p in pods),
        tuple(endpoint(e) for e in endpoints),
    )


def nat(pools: Iterable[Any]) -> NatConfig:
    """NAT input from the IP pools (disabled pools still count as pool space)."""
    return NatConfig(tuple((p.spec.cidr, p.spec.natOutgoing) for p in pools))
