"""Other nodes' Pods and WorkloadEndpoints as what a node reads of them, not as models.

tabby-node watches every Pod and WorkloadEndpoint of the cluster, but of another node's it
reads only what the policy engine resolves selectors with (``policy.inputs``): a pod's
namespace, name, labels and named ports; an endpoint's namespace, name, pod, node, host
interface, addresses and labels. Its CNI calls and ``wait_mirrored`` read only its own
node's documents, which stay whole models. Held as models, another node's WorkloadEndpoint
cost ~2.9 KB and its reduced Pod ~1.8 KB, plus the strings they reference: with 20k
endpoints in the cluster, most of the agent's memory (bench/scale/node_memory_bench.py). These
slotted records hold the same values in ~0.1 KB each; the strings many of them repeat
(namespaces, node names, label keys and values, port names, a pod's name in its endpoints)
are interned, and equal labels are one tuple.

A record is made from the model once the model validated (``resources.index`` parses a
document through its model first: what is refused stays refused), once per revision.
This module imports no pydantic (the policy inputs check for these types at run time).
"""

from __future__ import annotations

import ipaddress
from sys import intern
from typing import TYPE_CHECKING, TypeVar, cast

if TYPE_CHECKING:
    from bundle.types import JSON
    from resources.k8s import Pod, Protocol
    from resources.tabby import WorkloadEndpoint

#: (key, value) pairs, sorted by key
Labels = tuple[tuple[str, str], ...]
T = TypeVar("T", bound=tuple[object, ...])


#: One tuple for equal labels and named ports (the pods of one workload have the same): a
#: cache, emptied when it grows past ``_SHARED_MAX`` (values that come and go: a rollout's
#: hash). Sharing is an economy, never a meaning.
_shared: dict[tuple[object, ...], tuple[object, ...]] = {}
_SHARED_MAX = 50_000


def _share(made: T) -> T:
    shared = _shared.get(made)
    if shared is None:
        if len(_shared) >= _SHARED_MAX:
            _shared.clear()
        shared = _shared[made] = made
    return cast("T", shared)  # equal to ``made``: the same strings and numbers


def _labels(labels: dict[str, str] | None) -> Labels:
    if not labels:
        return ()
    return _share(tuple(sorted((intern(k), intern(v)) for k, v in labels.items())))


class RemotePod:
    """Another node's Pod: what policy reads of it (``policy.inputs.pod``)."""

    __slots__ = ("labels", "name", "namespace", "ports", "service_account")

    def __init__(
        self,
        namespace: str,
        name: str,
        labels: Labels = (),
        ports: tuple[tuple[str, Protocol, int], ...] = (),
        service_account: str = "",
    ) -> None:
        self.namespace = namespace
        self.name = name
        self.labels = labels
        #: ``(name, protocol, containerPort)`` of every named port (``Pod.named_ports``)
        self.ports = ports
        #: ``spec.serviceAccountName`` ("" when unset)
        self.service_account = service_account

    @classmethod
    def of(cls, pod: Pod) -> RemotePod:
        return cls(
            intern(pod.metadata.namespace or "default"),
            intern(pod.metadata.name or ""),  # one string with its endpoints' ``pod``
            _labels(pod.metadata.labels),
            _share(tuple((intern(n), proto, port) for n, proto, port in pod.named_ports())),
            intern(pod.spec.serviceAccountName or ""),
        )

    def named_ports(self) -> list[tuple[str, Protocol, int]]:
        return list(self.ports)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, RemotePod) and self._fields() == other._fields()

    def __hash__(self) -> int:
        return hash(self._fields())

    def _fields(self) -> tuple[object, ...]:
        return (self.namespace, self.name, self.labels, self.ports, self.service_account)

    def __repr__(self) -> str:
        return f"RemotePod({self.namespace}/{self.name})"


class RemoteEndpoint:
    """Another node's WorkloadEndpoint: what policy reads of it (``policy.inputs.endpoint``).
    ``addresses`` are bare addresses (``10.244.0.5`` of ``ipNetworks: [10.244.0.5/32]``:
    the engine resolves selectors to them, and would make the same of the networks);
    ``interface`` is ``spec.hostInterface`` ("" when unset)."""

    __slots__ = ("addresses", "interface", "labels", "name", "namespace", "node", "pod")

    def __init__(
        self,
        namespace: str,
        name: str,
        pod: str,
        node: str,
        interface: str,
        addresses: tuple[str, ...],
        labels: Labels = (),
    ) -> None:
        self.namespace = namespace
        self.name = name
        self.pod = pod
        self.node = node
        self.interface = interface
        self.addresses = addresses
        self.labels = labels

    @classmethod
    def of(cls, wep: WorkloadEndpoint) -> RemoteEndpoint:
        spec = wep.spec
        return cls(
            intern(wep.metadata.namespace or "default"),
            wep.metadata.name or "",
            intern(spec.pod),
            intern(spec.node),
            spec.hostInterface or "",
            tuple(str(ipaddress.ip_interface(a).ip) for a in spec.ipNetworks),
            _labels(wep.metadata.labels),
        )

    def __eq__(self, other: object) -> bool:
        return isinstance(other, RemoteEndpoint) and self._fields() == other._fields()

    def __hash__(self) -> int:
        return hash(self._fields())

    def _fields(self) -> tuple[object, ...]:
        return (
            self.namespace,
            self.name,
            self.pod,
            self.node,
            self.interface,
            self.addresses,
            self.labels,
        )

    def __repr__(self) -> str:
        return f"RemoteEndpoint({self.namespace}/{self.name} on {self.node})"


def reduce_pod(data: JSON) -> JSON | None:
    """Of another node's stored Pod, what policy reads (``RemotePod``), still a stored Pod:
    metadata's name, namespace and labels, ``spec.nodeName``, ``spec.serviceAccountName`` and
    the containers' named ports.
    Its annotations, uid, status, addresses and unnamed ports are its own node's. None when
    malformed (parsed as it is, and refused there)."""
    meta, spec = data.get("metadata"), data.get("spec")
    if not isinstance(meta, dict) or not isinstance(spec, dict) or "nodeName" not in spec:
        return None
    reduced_meta = {k: meta[k] for k in ("name", "namespace", "labels") if k in meta}
    containers = []
    for c in spec.get("containers") or ():
        ports = c.get("ports") if isinstance(c, dict) else None
        if not isinstance(ports, list):
            continue
        named = [p for p in ports if isinstance(p, dict) and p.get("name") is not None]
        if named:
            containers.append({"name": c.get("name"), "ports": named})
    reduced: JSON = {"metadata": reduced_meta, "spec": {"nodeName": spec["nodeName"]}}
    if spec.get("serviceAccountName"):
        reduced["spec"]["serviceAccountName"] = spec["serviceAccountName"]
    if containers:
        reduced["spec"]["containers"] = containers
    return reduced


def reduce_endpoint(data: JSON) -> JSON | None:
    """Of another node's stored WorkloadEndpoint, what policy reads (``RemoteEndpoint``),
    still a stored WorkloadEndpoint (its spec is all read or required; of its metadata the
    name, namespace and labels). None when malformed."""
    meta = data.get("metadata")
    if not isinstance(meta, dict) or not isinstance(data.get("spec"), dict):
        return None
    reduced: JSON = {k: data[k] for k in ("apiVersion", "kind", "spec") if k in data}
    reduced["metadata"] = {k: meta[k] for k in ("name", "namespace", "labels") if k in meta}
    return reduced
