"""Stored documents as the cluster holds them (for the fan-out's tests and bench)."""

from __future__ import annotations

import ipaddress

from bundle.types import JSON


def pod(name: str, node: str, labels: dict[str, str] | None = None, ip: str = "10.244.0.5") -> JSON:
    """A Pod as stored; ``ip``: its status (a change of it alone changes no other node's view)."""
    return {
        "metadata": {
            "name": name,
            "namespace": "default",
            "uid": f"uid-{name}",
            "labels": labels or {"app": "web"},
            "annotations": {"kubectl.kubernetes.io/last-applied-configuration": "x" * 200},
        },
        "spec": {
            "nodeName": node,
            "containers": [{"name": "c", "ports": [{"name": "http", "containerPort": 80}]}],
        },
        "status": {"podIPs": [{"ip": ip}]},
    }


def block(cidr: str, node: str | None, held: dict[int, str] | None = None) -> JSON:
    """A block affine to ``node``; ``held``: ordinal -> the node holding it."""
    size = ipaddress.ip_network(cidr).num_addresses
    allocations: list[JSON | None] = [None] * size
    for ordinal, holder in (held or {}).items():
        allocations[ordinal] = {
            "handle": f"k8s-pod-network.{ordinal}",
            "seq": ordinal,
            "attrs": {"node": holder, "pod": f"p{ordinal}", "namespace": "default"},
        }
    return {
        "cidr": cidr,
        "pool": "10.244.0.0/16",
        "affinity": f"host:{node}" if node else None,
        "seq": len(held or {}),
        "allocations": allocations,
        "unallocated": [o for o in range(size) if o not in (held or {})],
        "full": False,
    }


def endpoint(name: str, node: str, address: str, namespace: str = "default") -> JSON:
    """The WorkloadEndpoint of pod ``namespace/name`` on ``node``."""
    return {
        "metadata": {"name": f"{name}-eth0", "namespace": namespace, "labels": {}},
        "spec": {
            "pod": name,
            "node": node,
            "containerID": f"c-{name}",
            "interface": "eth0",
            "hostInterface": f"cali{name}",
            "ipNetworks": [f"{address}/32"],
        },
    }


#: A NetworkPolicy of namespace default selecting every pod there and allowing ingress from
#: every pod there: a node running one of them needs every other (the interest filter).
ALLOW_NAMESPACE: JSON = {
    "metadata": {"name": "same-namespace", "namespace": "default"},
    "spec": {"podSelector": {}, "ingress": [{"from": [{"podSelector": {}}]}]},
}
