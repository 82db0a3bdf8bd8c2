"""Where each of tabby's document kinds lives on the Kubernetes API, and the document <->
object mapping: the one table of the Kubernetes datastore (docs/kubernetes.md "Kubernetes
datastore").

=====================  ================================  ====================================
store kind             on the API                        the document
=====================  ================================  ====================================
``pool``               ``ippools.tabby.io``              the IPAM pool document of the
                       (name: the pool's own)            IPPool (``resources.poolform``); key
                                                         its ``spec.cidr``
``block``              ``ipamblocks.tabby.io``           the object's ``spec``; name from the
                       (name from the CIDR)              CIDR (``block_name``), key
                                                         ``spec.cidr``; label
                                                         ``tabby.io/node`` = its node
``affinity``           ``ipamaffinities.tabby.io``       the object's ``spec`` (the node's
                       (name: the node)                  IPAM index)
``node``               ``nodes.tabby.io`` joined with    ``metadata`` + ``spec`` of tabby's
                       the v1 Node's labels              Node; its labels are the v1 Node's
``bgpconfiguration``,  ``bgpconfigurations.tabby.io``,   ``metadata`` + ``spec``
``bgppeer``            ``bgppeers.tabby.io``
``trace``              ``policytraces.tabby.io``         the object's ``spec`` (a lease: its
                                                         ``tabby.io/expires`` annotation)
Calico's kinds         one CRD each (``CRDS``):          ``metadata`` + ``spec``; the
(``CALICO_KINDS``)     ``networkpolicies.tabby.io``      namespaced ones (NetworkPolicy,
                       (``calico-networkpolicy``),       NetworkSet, the staged namespaced
                       ``tiers.tabby.io``, ...           ones) keyed ``<namespace>/<name>``
``namespace``,         v1 Namespaces, v1 Pods,           what the controllers mirror in etcd
``pod``,               networking.k8s.io/v1              mode (``project_*``), read only:
``networkpolicy``      NetworkPolicies                   Kubernetes owns them
``heartbeat``          v1 Nodes                          a node whose Ready condition is True
                                                         is alive (the kubelet's own
                                                         liveness: tabby writes none)
``workloadendpoint``   ipamblocks.tabby.io               one per attachment, from its
                                                         allocations (``endpoints_of``): no
                                                         object per pod
``handle``             (none)                            format 1 only: never on the API
=====================  ================================  ====================================

The Kubernetes objects of tabby's own kinds are CustomResourceDefinitions of group
``tabby.io``, version ``v1``, with structural schemas (``stores.kube.crds``): cluster-scoped,
but for Calico's namespaced kinds.
"""

from __future__ import annotations

import hashlib
import ipaddress
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, NamedTuple

from resources import mirror
from resources.poolform import pool_data, pool_name, pool_raw

if TYPE_CHECKING:
    from bundle.types import JSON

GROUP = "tabby.io"
VERSION = "v1"
API_VERSION = f"{GROUP}/{VERSION}"
#: the label naming a block's node (label values are at most 63 characters: a longer node
#: name is hashed)
NODE_LABEL = "tabby.io/node"
#: a lease's end (``put_leased``), as Unix seconds, and its length (``keepalive``)
EXPIRES_ANNOTATION = "tabby.io/expires"
TTL_ANNOTATION = "tabby.io/ttl"
#: marks an object as Kubernetes' own (what the controllers mark mirrored ones with in etcd
#: mode: tabbyctl refuses to change it)
SOURCE_ANNOTATION = mirror.SOURCE_ANNOTATION


class Crd(NamedTuple):
    """One of tabby's kinds as a CustomResourceDefinition."""

    kind: str  #: the Kubernetes kind
    plural: str
    namespaced: bool = False  #: its document key is ``<namespace>/<name>``

    @property
    def path(self) -> str:
        """The collection (of every namespace, for a namespaced kind)."""
        return f"/apis/{API_VERSION}/{self.plural}"

    def object_path(self, key: str, name: str | None = None) -> str:
        """The object holding document ``key`` (named ``name``, else the key's name)."""
        return f"{self.create_path(key)}/{name or key.rpartition('/')[2]}"

    def create_path(self, key: str) -> str:
        """Where the object of document ``key`` is created (its namespace's collection)."""
        if not self.namespaced:
            return self.path
        namespace = key.partition("/")[0]
        return f"/apis/{API_VERSION}/namespaces/{namespace}/{self.plural}"

    @property
    def name(self) -> str:
        """The CRD's own name (``ippools.tabby.io``)."""
        return f"{self.plural}.{GROUP}"


CRDS: dict[str, Crd] = {
    "pool": Crd("IPPool", "ippools"),
    "block": Crd("IPAMBlock", "ipamblocks"),
    "affinity": Crd("IPAMAffinity", "ipamaffinities"),
    "node": Crd("Node", "nodes"),
    "bgpconfiguration": Crd("BGPConfiguration", "bgpconfigurations"),
    "bgppeer": Crd("BGPPeer", "bgppeers"),
    "trace": Crd("PolicyTrace", "policytraces"),
    # Calico's policy model (resources.calico); the group keeps kubectl's ``networkpolicies``
    # meaning Kubernetes' own (``networkpolicies.tabby.io`` is Calico's)
    "calico-networkpolicy": Crd("NetworkPolicy", "networkpolicies", True),
    "globalnetworkpolicy": Crd("GlobalNetworkPolicy", "globalnetworkpolicies"),
    "stagednetworkpolicy": Crd("StagedNetworkPolicy", "stagednetworkpolicies", True),
    "stagedglobalnetworkpolicy": Crd("StagedGlobalNetworkPolicy", "stagedglobalnetworkpolicies"),
    "stagedkubernetesnetworkpolicy": Crd(
        "StagedKubernetesNetworkPolicy", "stagedkubernetesnetworkpolicies", True
    ),
    "tier": Crd("Tier", "tiers"),
    "networkset": Crd("NetworkSet", "networksets", True),
    "globalnetworkset": Crd("GlobalNetworkSet", "globalnetworksets"),
    "hostendpoint": Crd("HostEndpoint", "hostendpoints"),
}
#: Calico's kinds (documents: metadata and spec, as tabby's resources)
CALICO_KINDS = frozenset(CRDS) - {
    "pool", "block", "affinity", "node", "bgpconfiguration", "bgppeer", "trace"
}  # fmt: skip
#: the kinds whose document is the object's metadata and spec (tabby's resources)
RESOURCE_KINDS = frozenset({"node", "bgpconfiguration", "bgppeer"}) | CALICO_KINDS
#: the kinds whose document is the object's spec alone (IPAM state, traces)
SPEC_KINDS = frozenset({"block", "affinity", "trace"})


class Native(NamedTuple):
    """A kind Kubernetes owns: read where it lives, never written by tabby."""

    path: str  #: the cluster-wide collection
    namespaced: bool
    project: Callable[[JSON], JSON | None]  #: the object -> the document (None: none)


# -- documents of Kubernetes' own objects (also what the controllers mirror in etcd mode) --------

MARK = {SOURCE_ANNOTATION: mirror.KUBERNETES}


def _meta(obj: JSON, *, namespaced: bool) -> JSON:
    meta = obj.get("metadata")
    meta = meta if isinstance(meta, Mapping) else {}
    out: JSON = {"name": meta.get("name"), "annotations": dict(MARK)}
    if namespaced:
        out["namespace"] = meta.get("namespace")
    if meta.get("uid"):
        out["uid"] = meta.get("uid")
    labels = meta.get("labels")
    if isinstance(labels, Mapping) and labels:
        out["labels"] = dict(labels)
    return out


def _list(value: object) -> list[object]:
    """A list field of an API object, or nothing: the API server validates what it stores,
    but a projection never raises on what it is handed."""
    return value if isinstance(value, list) else []


def project_namespace(obj: JSON) -> JSON | None:
    """A v1 Namespace: name, uid, labels."""
    return {"apiVersion": "v1", "kind": "Namespace", "metadata": _meta(obj, namespaced=False)}


def project_pod(obj: JSON) -> JSON | None:
    """A v1 Pod: name, namespace, uid, labels, named container ports, ``spec.nodeName``,
    ``status.podIPs``; None for a hostNetwork pod (it has no endpoint)."""
    spec = obj.get("spec")
    spec = spec if isinstance(spec, Mapping) else {}
    if spec.get("hostNetwork"):
        return None
    containers = []
    for c in _list(spec.get("containers")):
        if not isinstance(c, Mapping):
            continue
        entry: JSON = {"name": c.get("name")}
        ports = [
            {k: p[k] for k in ("name", "containerPort", "protocol") if p.get(k) is not None}
            for p in _list(c.get("ports"))
            if isinstance(p, Mapping)
        ]
        if ports:
            entry["ports"] = ports
        containers.append(entry)
    pod_spec: JSON = {"containers": containers}
    for field in ("nodeName", "serviceAccountName"):
        if spec.get(field):
            pod_spec[field] = spec.get(field)
    doc: JSON = {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": _meta(obj, namespaced=True),
        "spec": pod_spec,
    }
    status = obj.get("status")
    ips = status.get("podIPs") if isinstance(status, Mapping) else None
    addresses = [{"ip": p["ip"]} for p in _list(ips) if isinstance(p, Mapping) and p.get("ip")]
    if addresses:
        doc["status"] = {"podIPs": addresses}
    return doc


def project_policy(obj: JSON) -> JSON | None:
    """A networking.k8s.io/v1 NetworkPolicy, as the API server stores it."""
    spec = obj.get("spec")
    return {
        "apiVersion": "networking.k8s.io/v1",
        "kind": "NetworkPolicy",
        "metadata": _meta(obj, namespaced=True),
        "spec": dict(spec) if isinstance(spec, Mapping) else {},
    }


def stored(projected: JSON) -> JSON:
    """A projection as the store holds a resource: without ``apiVersion`` and ``kind``."""
    return {k: v for k, v in projected.items() if k not in ("apiVersion", "kind")}


NATIVE: dict[str, Native] = {
    "namespace": Native("/api/v1/namespaces", False, project_namespace),
    "pod": Native("/api/v1/pods", True, project_pod),
    "networkpolicy": Native("/apis/networking.k8s.io/v1/networkpolicies", True, project_policy),
}
#: v1 Nodes: their labels (the ``node`` kind's) and their readiness (``heartbeat``)
V1_NODES = "/api/v1/nodes"


def native_path(native: Native, key: str) -> str:
    """The object of ``key`` (``<namespace>/<name>`` for a namespaced kind)."""
    if not native.namespaced:
        return f"{native.path}/{key}"
    namespace, _, name = key.partition("/")
    base = native.path.rsplit("/", 1)
    return f"{base[0]}/namespaces/{namespace}/{base[1]}/{name}"


def ready(node: JSON) -> bool:
    """A v1 Node's Ready condition is True."""
    status = node.get("status")
    conditions = status.get("conditions") if isinstance(status, Mapping) else None
    return any(
        isinstance(c, Mapping) and c.get("type") == "Ready" and c.get("status") == "True"
        for c in _list(conditions)
    )


def alive(node: str) -> JSON:
    """The ``heartbeat`` document of a Ready node (no time, no pid: the kubelet's)."""
    return {"node": node, "time": 0.0, "pid": 0}


def expired(obj: JSON) -> bool:
    """A lease (``put_leased``) whose end has passed."""
    import time

    meta = obj.get("metadata")
    annotations = meta.get("annotations") if isinstance(meta, Mapping) else None
    value = annotations.get(EXPIRES_ANNOTATION) if isinstance(annotations, Mapping) else None
    try:
        return value is not None and float(value) < time.time()
    except (TypeError, ValueError):
        return False


def node_labels(node: JSON) -> dict[str, str]:
    meta = node.get("metadata")
    labels = meta.get("labels") if isinstance(meta, Mapping) else None
    return dict(labels) if isinstance(labels, Mapping) else {}


# -- names -------------------------------------------------------------------------------------


def block_name(cidr: str) -> str:
    """A block's object name, from its CIDR (``10.244.0.64/26`` -> ``10-244-0-64-26``;
    an IPv6 one's ``:`` become ``-`` too). Names are never read back: the key is the
    object's ``spec.cidr``."""
    name = cidr.replace(".", "-").replace(":", "-").replace("/", "-")
    return "0" + name if name.startswith("-") else name


def node_label_value(node: str) -> str:
    """``tabby.io/node``'s value: the node, or (over 63 characters) a hash of it."""
    if len(node) <= 63:
        return node
    return "h-" + hashlib.sha256(node.encode()).hexdigest()[:40]


def object_name(kind: str, key: str, data: JSON | None) -> str:
    """The name of the object holding document ``key`` of ``kind``."""
    if kind == "pool":
        return pool_name(data or {}, key)
    if kind == "block":
        return block_name(key)
    return key.rpartition("/")[2] if CRDS[kind].namespaced else key


# -- document <-> object -----------------------------------------------------------------------


def to_object(kind: str, key: str, data: JSON, revision: int | None) -> JSON:
    """The object that stores document ``key`` of ``kind`` (``revision``: the one a replace
    is based on, None for a create)."""
    crd = CRDS[kind]
    meta: JSON
    if kind == "pool":
        raw = pool_raw(data, key)
        meta, spec = dict(raw["metadata"]), raw["spec"]
        meta.pop("uid", None)  # the API server's
        meta.pop("creationTimestamp", None)
    elif kind in RESOURCE_KINDS:
        # a Node's labels are the v1 Node's (``joined_node``): never written here
        kept = ("annotations",) if kind == "node" else ("labels", "annotations")
        meta = {k: v for k, v in dict(data.get("metadata") or {}).items() if k in kept}
        spec = dict(data.get("spec") or {})
        if crd.namespaced:
            meta["namespace"] = key.partition("/")[0]
    else:
        meta, spec = {}, dict(data)
    meta["name"] = object_name(kind, key, data)
    if kind == "block":
        node = _block_node(data)
        if node:
            meta["labels"] = {NODE_LABEL: node_label_value(node)}
    if revision is not None:
        meta["resourceVersion"] = str(revision)
    return {"apiVersion": API_VERSION, "kind": crd.kind, "metadata": meta, "spec": spec}


def key_of(kind: str, obj: JSON) -> str | None:
    """The document key an object of ``kind`` stores (None: not one of ours)."""
    meta = obj.get("metadata")
    spec = obj.get("spec")
    if not isinstance(meta, Mapping) or not isinstance(spec, Mapping):
        return None
    if kind in ("pool", "block"):
        return canonical_cidr(spec.get("cidr"))
    name = meta.get("name")
    if not isinstance(name, str) or not name:
        return None
    if CRDS[kind].namespaced:
        namespace = meta.get("namespace")
        return f"{namespace}/{name}" if isinstance(namespace, str) and namespace else None
    return name


def canonical_cidr(cidr: object) -> str | None:
    """``cidr`` as tabby keys it (``fd00::/48`` for ``FD00:0::/48``); None for what is no
    network address (host bits set: the schema cannot refuse them for IPv6), which is then
    not one of tabby's documents: a pool kubectl applied so is ignored, never read as a
    corrupt store that stops every call."""
    if not isinstance(cidr, str) or not cidr:
        return None
    try:
        return str(ipaddress.ip_network(cidr))
    except ValueError:
        return None


def to_data(kind: str, obj: JSON) -> JSON:
    """The document an object of one of tabby's kinds stores."""
    spec = obj.get("spec")
    spec = dict(spec) if isinstance(spec, Mapping) else {}
    meta = obj.get("metadata")
    meta = meta if isinstance(meta, Mapping) else {}
    if kind == "pool":
        data = pool_data({"metadata": meta, "spec": spec})
        cidr = canonical_cidr(data.get("cidr"))
        if cidr is not None:
            data["cidr"] = cidr
        return data
    if kind in RESOURCE_KINDS:
        keep = ("name", "namespace", "labels", "annotations", "uid", "creationTimestamp")
        return {"metadata": {k: meta[k] for k in keep if k in meta}, "spec": spec}
    return spec


def revision_of(obj: JSON) -> int:
    """An object's ``resourceVersion`` as the store's revision (Kubernetes' versions are
    etcd's revisions: numbers that grow with every write)."""
    meta = obj.get("metadata")
    rv = meta.get("resourceVersion") if isinstance(meta, Mapping) else None
    try:
        return int(str(rv))
    except ValueError:
        return 0


def _block_node(data: JSON) -> str | None:
    affinity = data.get("affinity")
    if isinstance(affinity, str) and affinity.startswith("host:"):
        return affinity[len("host:") :]
    return None


# -- the node kind: tabby's Node joined with the v1 Node's labels --------------------------------

#: A ``node`` document's revision holds the tabby Node's resourceVersion (what a write of it
#: compares) above these bits and the v1 Node's at its last label change below: a change of
#: either makes it grow, and a write finds the version to compare in it.
JOIN_BITS = 48


def joined_revision(tabby: int, labels: int) -> int:
    return (tabby << JOIN_BITS) | (labels & ((1 << JOIN_BITS) - 1))


def tabby_revision(joined: int) -> int:
    return joined >> JOIN_BITS


def joined_node(data: JSON, labels: Mapping[str, str] | None) -> JSON:
    """A tabby Node's document with the v1 Node's labels (none while there is no v1 Node)."""
    meta = dict(data.get("metadata") or {})
    if labels:
        meta["labels"] = dict(labels)
    else:
        meta.pop("labels", None)
    return {**data, "metadata": meta}


# -- endpoints, from the blocks ------------------------------------------------------------------


def endpoints_of(blocks: Mapping[str, JSON]) -> dict[str, JSON]:
    """Every attachment's WorkloadEndpoint document (by store key), from the allocations of
    ``blocks`` (block CIDR -> document): an allocation records its pod, node, container,
    interface and host interface; an attachment's addresses may lie in two blocks
    (dual-stack). Of two attachments of one pod interface (a new sandbox before the old
    one's DEL), the later one's."""
    from dataplane.names import host_veth_name
    from resources.wep import endpoint_data, endpoint_key, timestamp

    handles: dict[str, tuple[JSON, list[str], float]] = {}
    for cidr, data in blocks.items():
        base = _network_base(cidr)
        if base is None:
            continue
        version, first = base
        for ordinal, alloc in enumerate(_list(data.get("allocations"))):
            if not isinstance(alloc, Mapping):
                continue
            attrs = alloc.get("attrs")
            if not isinstance(attrs, dict) or not attrs.get("pod_name"):
                continue
            handle = str(alloc.get("handle", ""))
            addr = _address(version, first + ordinal)
            bits = 32 if version == 4 else 128
            held = handles.get(handle)
            when = attrs.get("time")
            seen = float(when) if isinstance(when, int | float) else 0.0
            if held is None:
                handles[handle] = (attrs, [f"{addr}/{bits}"], seen)
            else:
                held[1].append(f"{addr}/{bits}")
    out: dict[str, tuple[JSON, float]] = {}
    for handle, (attrs, nets, when) in handles.items():
        namespace = str(attrs.get("pod_namespace") or "default")
        node, pod = str(attrs.get("node") or ""), str(attrs["pod_name"])
        ifname = str(attrs.get("ifname") or "")
        cid = str(attrs.get("container_id") or "")
        host = attrs.get("host_interface")
        if not isinstance(host, str) or not host:
            network = str(attrs.get("network") or handle.split(":", 1)[0])
            host = host_veth_name("cali", network, cid, ifname) if cid and ifname else None
        if not node or not ifname or not cid:
            continue
        key = endpoint_key(namespace, node, pod, ifname)
        data = endpoint_data(
            namespace=namespace,
            node=node,
            pod=pod,
            container_id=cid,
            interface=ifname,
            host_interface=host,
            ip_networks=sorted(nets, key=_family_order),
            labels={},
            created=timestamp(when) if when else None,
        )
        old = out.get(key)
        if old is None or old[1] <= when:
            out[key] = (data, when)
    return {key: data for key, (data, _) in out.items()}


def _network_base(cidr: str) -> tuple[int, int] | None:
    import ipaddress

    try:
        net = ipaddress.ip_network(cidr)
    except ValueError:
        return None
    return net.version, int(net.network_address)


def _address(version: int, value: int) -> str:
    import ipaddress

    return str(ipaddress.IPv4Address(value) if version == 4 else ipaddress.IPv6Address(value))


def _family_order(net: str) -> tuple[int, str]:
    return (6 if ":" in net else 4, net)
