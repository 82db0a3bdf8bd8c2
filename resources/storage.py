"""Where each kind lives in the store, and resource <-> stored document: the one place.

==================  ==========================  =============================================
kind                store kind, key             stored data
==================  ==========================  =============================================
IPPool              ``pool``, its CIDR          the IPAM pool document: ``cidr``,
                                                ``block_size``, ``disabled`` (read by the
                                                allocator) beside ``name``, ``ipip_mode``,
                                                ``vxlan_mode``, ``nat_outgoing``,
                                                ``node_selector``, ``labels``,
                                                ``annotations``, ``uid``,
                                                ``creation_timestamp``
others              kind in lower case,         ``{"metadata": {...}, "spec": {...}}`` as
                    ``name`` or                 applied (defaults are applied when read,
                    ``<namespace>/<name>``      so a later apply merges into what the
                                                operator set, not into defaults)
==================  ==========================  =============================================

``metadata.resourceVersion`` is the document's store revision, as a string. A pool that the
IPAM plugin created from its configuration has no name: it is shown as ``ippool-`` plus its
CIDR with ``.``, ``:`` and ``/`` as ``-`` (``ippool-10-244-0-0-16``).
"""

from __future__ import annotations

from typing import NamedTuple

from pydantic import ValidationError

from bundle.types import JSON
from datastore.base import Doc
from datastore.errors import StoreCorrupt
from resources.calico import (
    CALICO_MODELS,
    CalicoNetworkPolicy,
    GlobalNetworkPolicy,
    GlobalNetworkSet,
    HostEndpoint,
    NetworkSet,
    StagedGlobalNetworkPolicy,
    StagedKubernetesNetworkPolicy,
    StagedNetworkPolicy,
    Tier,
)
from resources.errors import UnknownKind
from resources.k8s import Namespace, NetworkPolicy, Pod, ServiceAccount
from resources.meta import Resource, problems
from resources.names import namespaced_key
from resources.poolform import POOL_META, POOL_OPTIONAL, pool_raw
from resources.tabby import BGPConfiguration, BGPPeer, IPPool, Node, WorkloadEndpoint


class KindInfo(NamedTuple):
    """A resource kind: its model, store kind, plural and other names tabbyctl takes."""

    model: type[Resource]
    store_kind: str
    plural: str
    short: tuple[str, ...] = ()
    #: when the kind name alone is another kind's (Calico's NetworkPolicy): how tabbyctl
    #: names it (``get``'s singular), else its kind in lower case
    singular: str = ""

    @property
    def kind(self) -> str:
        return self.model.KIND

    @property
    def api_version(self) -> str:
        return self.model.API_VERSION

    @property
    def namespaced(self) -> bool:
        return self.model.NAMESPACED

    @property
    def name(self) -> str:
        """How tabbyctl names the kind (``get`` takes this, the plural and short names)."""
        return self.singular or self.kind.lower()

    @property
    def api_versions(self) -> tuple[str, ...]:
        """The apiVersions a document of the kind may carry (the first is stored)."""
        return (self.api_version, *self.model.ACCEPTED_API_VERSIONS)


RESOURCE_KINDS: tuple[KindInfo, ...] = (
    KindInfo(IPPool, "pool", "ippools"),
    KindInfo(Node, "node", "nodes"),
    KindInfo(BGPConfiguration, "bgpconfiguration", "bgpconfigurations"),
    KindInfo(BGPPeer, "bgppeer", "bgppeers"),
    KindInfo(NetworkPolicy, "networkpolicy", "networkpolicies", ("netpol",)),
    KindInfo(Namespace, "namespace", "namespaces", ("ns",)),
    KindInfo(Pod, "pod", "pods", ("po",)),
    KindInfo(ServiceAccount, "serviceaccount", "serviceaccounts", ("sa",)),
    KindInfo(WorkloadEndpoint, "workloadendpoint", "workloadendpoints", ("wep", "weps")),
    # Calico's policy kinds (resources.calico). Calico's NetworkPolicy shares its kind name
    # with Kubernetes': tabbyctl calls it by its group-qualified names (``networkpolicy`` and
    # ``netpol`` stay Kubernetes', as for kubectl) and stores it apart.
    KindInfo(
        CalicoNetworkPolicy,
        "calico-networkpolicy",
        "networkpolicies.tabby.io",
        (
            "networkpolicy.tabby.io",
            "networkpolicy.projectcalico.org",
            "networkpolicies.projectcalico.org",
            "cnp",
            "caliconetworkpolicy",
            "caliconetworkpolicies",
        ),
        singular="networkpolicy.tabby.io",
    ),
    KindInfo(GlobalNetworkPolicy, "globalnetworkpolicy", "globalnetworkpolicies", ("gnp",)),
    KindInfo(StagedNetworkPolicy, "stagednetworkpolicy", "stagednetworkpolicies", ("snp",)),
    KindInfo(
        StagedGlobalNetworkPolicy,
        "stagedglobalnetworkpolicy",
        "stagedglobalnetworkpolicies",
        ("sgnp",),
    ),
    KindInfo(
        StagedKubernetesNetworkPolicy,
        "stagedkubernetesnetworkpolicy",
        "stagedkubernetesnetworkpolicies",
        ("sknp",),
    ),
    KindInfo(Tier, "tier", "tiers"),
    KindInfo(NetworkSet, "networkset", "networksets", ("netset",)),
    KindInfo(GlobalNetworkSet, "globalnetworkset", "globalnetworksets", ("gns",)),
    KindInfo(HostEndpoint, "hostendpoint", "hostendpoints", ("hep", "heps")),
)
#: by kind name; Kubernetes' NetworkPolicy for ``NetworkPolicy`` (Calico's is found by its
#: apiVersion: :func:`document_kind`)
BY_KIND: dict[str, KindInfo] = {}
for _info in RESOURCE_KINDS:
    BY_KIND.setdefault(_info.kind, _info)
BY_STORE_KIND = {i.store_kind: i for i in RESOURCE_KINDS}
BY_MODEL = {i.model: i for i in RESOURCE_KINDS}
_BY_API_KIND = {(v, i.kind): i for i in RESOURCE_KINDS for v in i.api_versions}
_ALIASES = {alias: i for i in RESOURCE_KINDS for alias in (i.name, i.plural, *i.short)}
#: the store kinds of Calico's policy model
CALICO_STORE_KINDS = tuple(i.store_kind for i in RESOURCE_KINDS if i.model in CALICO_MODELS)
#: the store kinds of the policies that sit in a tier (``spec.tier``)
TIERED_STORE_KINDS = tuple(
    BY_MODEL[m].store_kind
    for m in (
        CalicoNetworkPolicy,
        GlobalNetworkPolicy,
        StagedNetworkPolicy,
        StagedGlobalNetworkPolicy,
    )
)


def document_kind(api_version: object, kind: str) -> KindInfo | None:
    """The kind of a document: by its apiVersion and kind (``NetworkPolicy`` of
    ``tabby.io/v1`` or ``projectcalico.org/v3`` is Calico's), else by kind alone (its model
    then names a wrong apiVersion)."""
    if isinstance(api_version, str):
        found = _BY_API_KIND.get((api_version, kind))
        if found is not None:
            return found
    return BY_KIND.get(kind)


def resolve_kind(name: str) -> KindInfo:
    """A kind by singular, plural or short name, any case (``netpol``, ``IPPools``)."""
    info = _ALIASES.get(name.lower())
    if info is None:
        known = ", ".join(i.plural for i in RESOURCE_KINDS)
        raise UnknownKind(f"unknown resource kind {name!r} (known: {known})")
    return info


def key_of(info: KindInfo, name: str, namespace: str | None) -> str:
    """The store key of a (non-IPPool) resource."""
    return namespaced_key(namespace or "", name) if info.namespaced else name


# -- IPPool <-> pool document -------------------------------------------------------------


def _pool_data(pool: IPPool, existing: JSON | None) -> JSON:
    data = dict(existing or {})  # keep keys the allocator (or a newer tabby) added
    spec = pool.spec
    data.update(cidr=spec.cidr, block_size=spec.blockSize, disabled=spec.disabled, name=pool.name)
    fields = {f: getattr(spec, f) for f in POOL_OPTIONAL}
    fields.update({f: getattr(pool.metadata, f) for f in POOL_META})
    stored_names = {**POOL_OPTIONAL, **POOL_META}
    for field, value in fields.items():
        if value is None:
            data.pop(stored_names[field], None)
        else:
            data[stored_names[field]] = value
    return data


# -- the mapping -----------------------------------------------------------------------------


def stored_raw(info: KindInfo, key: str, data: JSON) -> JSON:
    """A stored document as an applied document (``metadata`` and ``spec``, no defaults
    added, no ``apiVersion``/``kind``/``resourceVersion``): what ``apply`` merges into."""
    if info.model is IPPool:
        return pool_raw(data, key)
    return {k: v for k, v in data.items() if k in ("metadata", "spec", "status")}


def stored_data(info: KindInfo, raw: JSON, resource: Resource, existing: JSON | None) -> JSON:
    """What to store for ``resource``, validated from the applied document ``raw``."""
    if isinstance(resource, IPPool):
        return _pool_data(resource, existing)
    meta = {k: v for k, v in dict(raw.get("metadata") or {}).items() if k != "resourceVersion"}
    meta["name"] = resource.name
    if info.namespaced:
        meta["namespace"] = resource.namespace
    for field in ("uid", "creationTimestamp"):
        value = getattr(resource.metadata, field)
        if value is not None:
            meta[field] = value
    out: JSON = {"metadata": meta}
    for part in ("spec", "status"):  # status: a mirrored Pod's addresses
        if part in raw:
            out[part] = raw[part]
    return out


def document(info: KindInfo, raw: JSON, revision: int | None) -> JSON:
    """An applied-document form with ``apiVersion``, ``kind`` and ``resourceVersion``."""
    meta = dict(raw.get("metadata") or {})
    if revision is not None:
        meta["resourceVersion"] = str(revision)
    return {"apiVersion": info.api_version, "kind": info.kind, **raw, "metadata": meta}


def validate(info: KindInfo, doc: JSON) -> Resource:
    """The model of a full document (raises pydantic's ValidationError)."""
    return info.model.model_validate(dict(doc))


def to_resource(info: KindInfo, key: str, doc: Doc, where: str) -> Resource:
    """A stored document as its resource (defaults applied); StoreCorrupt if it does not
    validate (``where`` names its location)."""
    try:
        return validate(info, document(info, stored_raw(info, key, doc.data), doc.revision))
    except ValidationError as e:
        first = problems(e)[0]
        raise StoreCorrupt(where, f"not a valid {info.kind}: {first[0]}: {first[1]}") from None
