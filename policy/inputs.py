"""Resource models (``resources``) -> the policy engine's inputs.

The models already carry the API server's defaulting and validation (``policyTypes``, a
port's protocol, ``except`` inside ``cidr``, ...); this module only changes representation.
WorkloadEndpoints may come as models or as their stored documents (``resources.wep``).

The models are taken duck-typed (``Any``, attribute access as in ``resources.k8s`` and
``resources.tabby``) so this module imports nothing from the datastore library; the
unit tests run it on the real models.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Mapping
from typing import Any

from datastore.base import Doc
from datastore.errors import DatastoreError
from policy import engine

log = logging.getLogger("tabby.policy")


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


def nat(pools: Iterable[Any]) -> engine.NatConfig:
    """NAT input from the IP pools (disabled pools still count as pool space)."""
    return engine.NatConfig(tuple((p.spec.cidr, p.spec.natOutgoing) for p in pools))


# -- the datastore -> the engine's inputs, converted once per document revision ----------------


def key_pod(data: Mapping[str, Any]) -> str:
    meta = data.get("metadata") or {}
    spec = data.get("spec") or {}
    return f"{meta.get('namespace', '')}/{spec.get('pod', '')}"


def pod_model(key: str, doc: Doc) -> Any:
    from resources.storage import BY_KIND, to_resource

    try:
        return to_resource(BY_KIND["Pod"], key, doc, f"pod {key}")
    except DatastoreError:
        return None


class PolicyInputs:
    """The policy engine's inputs from the cache, converted document by document and kept
    per (kind, key, revision): a pass converts only what changed since the last one (a
    revision is never reused for a key). Parsing every policy on every watch event cost
    ~35 ms per pass at 200 policies, on every node, for every pod added anywhere. A fresh
    object converts everything (``tabbyctl policy explain`` does that); a document that
    does not validate is skipped and logged."""

    def __init__(self) -> None:
        self.memo: dict[tuple[str, str], tuple[int, Any]] = {}

    def convert(self, docs: Mapping[str, Mapping[str, Doc]]) -> tuple[Any, Any]:
        seen: set[tuple[str, str]] = set()

        def each(kind: str, store_kind: str, fn: Callable[[Any], Any]) -> list[Any]:
            from resources.storage import BY_KIND, to_resource

            out = []
            for key, doc in sorted((docs.get(store_kind) or {}).items()):
                seen.add((store_kind, key))
                hit = self.memo.get((store_kind, key))
                if hit is None or hit[0] != doc.revision:
                    try:
                        value = fn(to_resource(BY_KIND[kind], key, doc, f"{store_kind} {key}"))
                    except DatastoreError as e:
                        log.warning("skipping %s %s: %s", kind, key, e)
                        value = None
                    hit = self.memo[(store_kind, key)] = (doc.revision, value)
                if hit[1] is not None:
                    out.append(hit[1])
            return out

        endpoints = []
        for key, doc in sorted((docs.get("workloadendpoint") or {}).items()):
            seen.add(("workloadendpoint", key))
            hit = self.memo.get(("workloadendpoint", key))
            if hit is None or hit[0] != doc.revision:
                hit = self.memo[("workloadendpoint", key)] = (
                    doc.revision,
                    endpoint(doc.data),
                )
            endpoints.append(hit[1])
        state = engine.ClusterState(
            tuple(each("NetworkPolicy", "networkpolicy", policy)),
            tuple(each("Namespace", "namespace", namespace)),
            tuple(each("Pod", "pod", pod)),
            tuple(endpoints),
        )
        nat_config = nat(each("IPPool", "pool", lambda model: model))
        for gone in set(self.memo) - seen:
            del self.memo[gone]
        return state, nat_config
