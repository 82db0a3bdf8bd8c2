"""An IPPool as the IPAM pool document stores it, and back, in plain dicts (no pydantic: the
Kubernetes datastore reads and writes pools on a CNI call's path, which must not import it;
``resources.storage`` validates through the model on top of this).

The pool document (``ipam.core.model.Pool``) holds ``cidr``, ``block_size`` and ``disabled``
(what the allocator reads) beside the resource's other fields under their stored names.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from bundle.types import JSON

#: spec field -> pool document key (left out when unset)
POOL_OPTIONAL = {
    "ipipMode": "ipip_mode",
    "vxlanMode": "vxlan_mode",
    "natOutgoing": "nat_outgoing",
    "nodeSelector": "node_selector",
}
#: metadata field -> pool document key
POOL_META = {
    "labels": "labels",
    "annotations": "annotations",
    "uid": "uid",
    "creationTimestamp": "creation_timestamp",
}


def pool_name(data: JSON, cidr: str) -> str:
    """A pool's name: its own, else one derived from its CIDR."""
    name = data.get("name")
    if isinstance(name, str) and name:
        return name
    return "ippool-" + cidr.replace(".", "-").replace(":", "-").replace("/", "-")


def pool_raw(data: JSON, key: str) -> JSON:
    """The pool document ``data`` (stored under ``key``, its CIDR) as the IPPool's
    ``metadata`` and ``spec``."""
    cidr = data.get("cidr", key)
    meta: JSON = {"name": pool_name(data, str(cidr))}
    for field, stored in POOL_META.items():
        if stored in data:
            meta[field] = data[stored]
    spec: JSON = {
        "cidr": cidr,
        "blockSize": data.get("block_size"),
        "disabled": data.get("disabled", False),
    }
    for field, stored in POOL_OPTIONAL.items():
        if stored in data:
            spec[field] = data[stored]
    return {"metadata": meta, "spec": spec}


def pool_data(raw: JSON) -> JSON:
    """An IPPool's ``metadata`` and ``spec`` as the pool document (the inverse of
    ``pool_raw``): what the Kubernetes datastore hands out for an IPPool object."""
    meta = raw.get("metadata")
    meta = meta if isinstance(meta, Mapping) else {}
    spec = raw.get("spec")
    spec = spec if isinstance(spec, Mapping) else {}
    size = spec.get("blockSize")
    if size is None:  # left out (kubectl apply): the family's default, as tabbyctl apply's
        size = _default_block_size(spec.get("cidr"))
    data: JSON = {
        "cidr": spec.get("cidr"),
        "block_size": size,
        "disabled": bool(spec.get("disabled", False)),
    }
    if isinstance(meta.get("name"), str):
        data["name"] = meta["name"]
    for field, stored in POOL_OPTIONAL.items():
        if spec.get(field) is not None:
            data[stored] = spec[field]
    for field, stored in POOL_META.items():
        if meta.get(field) is not None:
            data[stored] = meta[field]
    return data


def _default_block_size(cidr: object) -> int | None:
    """The default block size of ``cidr``'s family (None: not a CIDR; the IPAM says so)."""
    import ipaddress

    from ipam.core.model import DEFAULT_BLOCK_SIZE

    try:
        return DEFAULT_BLOCK_SIZE[ipaddress.ip_network(str(cidr), strict=False).version]
    except ValueError:
        return None
