"""WorkloadEndpoints as the CNI plugin writes them: one per attachment (standard library only,
so the plugin can use it without importing pydantic).

An endpoint's key is ``<pod namespace>/<name>``, its name Calico-style
``<node>-k8s-<pod>-<interface>`` with every ``-`` of the parts doubled (unambiguous), or
``wep-<hash>`` when that would not be a valid name. Its labels are those of the ``v1 Pod`` of
the same namespace/name whenever that Pod exists (``effective_labels``, the one rule, applied
by every reader: the policy engine, ``resources.client``); ADD stores the Pod's labels of the
moment too, which count only while no Pod of that name exists.

Stored data (``resources.storage``)::

    {"metadata": {"name", "namespace", "labels", "creationTimestamp"},
     "spec": {"node", "pod", "containerID", "interface", "hostInterface", "ipNetworks"}}
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Mapping, Sequence

from bundle.types import JSON
from datastore.base import Doc, Store
from datastore.cas import DELETE, Delete, update
from resources.names import dns1123_subdomain, namespaced_key

KIND = "workloadendpoint"
POD_KIND = "pod"


def endpoint_name(node: str, pod: str, interface: str) -> str:
    """The endpoint's name (unique per node, pod and interface inside the pod)."""
    name = (
        "-k8s-".join(p.replace("-", "--") for p in (node, pod)) + "-" + interface.replace("-", "--")
    )
    if dns1123_subdomain(name) is None:
        return name
    import hashlib  # only for names that need it

    digest = hashlib.sha256(f"{node}\0{pod}\0{interface}".encode()).hexdigest()
    return f"{HASHED_PREFIX}{digest[:32]}"


def endpoint_key(namespace: str, node: str, pod: str, interface: str) -> str:
    """The store key (kind ``workloadendpoint``) of one attachment."""
    return namespaced_key(namespace, endpoint_name(node, pod, interface))


#: The name prefix of every endpoint whose name is a hash (``endpoint_name``).
HASHED_PREFIX = "wep-"


def endpoint_prefixes(namespace: str, pod: str, nodes: Iterable[str]) -> list[str]:
    """Store key prefixes that hold every endpoint of the pod ``namespace/pod`` on
    ``nodes``: its named ones (``<node>-k8s-<pod>-``) and the namespace's hashed ones
    (``wep-``). Other endpoints may match as well (a pod whose name extends this one's): the
    caller keeps those whose ``spec.pod`` is the pod. What these read does not grow with the
    number of pods in the namespace (a pod's endpoints are found without listing them all)."""
    out = [
        namespaced_key(namespace, "-k8s-".join(p.replace("-", "--") for p in (node, pod)) + "-")
        for node in sorted(set(nodes))
    ]
    return [*out, namespaced_key(namespace, HASHED_PREFIX)]


def pod_node(pod: JSON | None) -> str | None:
    """The node of a stored Pod (``spec.nodeName``), None when it names none."""
    spec = (pod or {}).get("spec")
    node = spec.get("nodeName") if isinstance(spec, dict) else None
    return node if isinstance(node, str) and node else None


def effective_labels(endpoint: JSON | None, pod: JSON | None) -> dict[str, str]:
    """An endpoint's labels: its Pod's when the Pod exists, else those stored on it.

    Both arguments are stored document data (``None``: no such document).
    """
    source = pod if pod is not None else endpoint
    labels = ((source or {}).get("metadata") or {}).get("labels")
    return dict(labels) if isinstance(labels, dict) else {}


def endpoint_data(
    *,
    namespace: str,
    node: str,
    pod: str,
    container_id: str,
    interface: str,
    host_interface: str | None,
    ip_networks: Sequence[str],
    labels: Mapping[str, str],
    created: str | None = None,
) -> JSON:
    """The stored document of one attachment (``ip_networks``: CIDRs such as
    ``10.244.0.5/32``)."""
    meta: JSON = {
        "name": endpoint_name(node, pod, interface),
        "namespace": namespace,
        "labels": dict(labels),
    }
    if created is not None:
        meta["creationTimestamp"] = created
    spec: JSON = {
        "node": node,
        "pod": pod,
        "containerID": container_id,
        "interface": interface,
        "ipNetworks": list(ip_networks),
    }
    if host_interface is not None:
        spec["hostInterface"] = host_interface
    return {"metadata": meta, "spec": spec}


def timestamp(now: float) -> str:
    """RFC 3339 UTC, seconds (as Kubernetes writes ``creationTimestamp``)."""
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(now))


def write_endpoint(
    store: Store,
    *,
    namespace: str,
    node: str,
    pod: str,
    container_id: str,
    interface: str,
    host_interface: str | None,
    ip_networks: Sequence[str],
    clock: Callable[[], float] = time.time,
) -> str:
    """Create or replace the attachment's endpoint (one compare-and-swap), with its Pod's
    labels of the moment; returns its key."""
    key = endpoint_key(namespace, node, pod, interface)
    pod_doc = store.get(POD_KIND, namespaced_key(namespace, pod))
    labels = effective_labels(None, pod_doc.data if pod_doc is not None else None)

    def change(current: Doc | None) -> JSON | None:
        created = None
        if current is not None and _spec(current.data).get("containerID") == container_id:
            created = (current.data.get("metadata") or {}).get("creationTimestamp")
        data = endpoint_data(
            namespace=namespace,
            node=node,
            pod=pod,
            container_id=container_id,
            interface=interface,
            host_interface=host_interface,
            ip_networks=ip_networks,
            labels=labels,
            created=created or timestamp(clock()),
        )
        return None if current is not None and current.data == data else data

    update(store, KIND, key, change)
    return key


def remove_endpoint(store: Store, key: str, container_id: str) -> bool:
    """Delete the endpoint if it is this container's (a newer sandbox of the same pod may
    own it by now); False when there was nothing to delete."""
    removed = [False]

    def change(current: Doc | None) -> Delete | None:
        removed[0] = current is not None and _spec(current.data).get("containerID") == container_id
        return DELETE if removed[0] else None

    update(store, KIND, key, change)
    return removed[0]


def _spec(data: JSON) -> JSON:
    spec = data.get("spec")
    return spec if isinstance(spec, dict) else {}
