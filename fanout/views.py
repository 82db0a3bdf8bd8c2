"""What each node receives of each watched document: its own node's whole, other nodes' as
the projection they read (docs/typha.md "Per-node views").

- Pods, WorkloadEndpoints: the node they run on (``spec.nodeName``, ``spec.node``) gets the
  document whole (its CNI calls build on it); every other node the reduction policy reads
  (``resources.remote.reduce_pod``/``reduce_endpoint``: name, namespace, labels, named
  ports, addresses), which a status-only change (phase, conditions, annotations) leaves as
  it was: such a change is sent to its own node alone.
- IPAM blocks: the affine node (``affinity: host:X``) gets the block whole; every other node
  the routing projection: the affinity, and the addresses held by a node other than the
  affine one (borrowed: they need a route of their own), each as the one record of its
  holder. A pod's ADD or DEL in its own node's block changes no other node's projection and
  is sent to no other node.
- Every other kind (nodes, heartbeats, pools, BGP, network policies, namespaces, traces) is
  cluster-wide and small: every node gets it whole.

A projection is compared with the previous one once per event (``Change.remote``), not once
per node.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from resources.remote import reduce_endpoint, reduce_pod

if TYPE_CHECKING:
    from bundle.types import JSON

#: The handle of every borrowed allocation in another node's block, as projected (its
#: owner's handles are read from the store, never from the projection).
REMOTE_HANDLE = "(another node's)"


def owner(kind: str, data: JSON | None) -> str | None:
    """The node that gets ``data`` whole, if only one node does (None: every node does)."""
    if data is None:
        return None
    if kind == "pod" or kind == "workloadendpoint":
        spec = data.get("spec")
        node = spec.get("nodeName" if kind == "pod" else "node") if isinstance(spec, dict) else None
        return node if isinstance(node, str) and node else None
    if kind == "block":
        affinity = data.get("affinity")
        if isinstance(affinity, str) and affinity.startswith("host:"):
            return affinity[5:] or None
    return None


def projection(kind: str, data: JSON) -> JSON:
    """What a node other than ``owner`` gets of ``data`` (``data`` itself when whole)."""
    if kind == "pod":
        return reduce_pod(data) or data
    if kind == "workloadendpoint":
        return reduce_endpoint(data) or data
    if kind == "block":
        return block_projection(data)
    return data


def block_projection(data: JSON) -> JSON:
    """A block as a node other than its affine one needs it for routing: the affinity, and
    the borrowed addresses (held by another node than the affine one), each as its holder's
    record; every other ordinal empty. Its sequence number and free list are its owner's
    (0 and empty: a valid block, the same projection until the routing changes). A
    malformed block is sent as it is (refused where it is parsed, as the stored one)."""
    allocations = data.get("allocations")
    if not isinstance(allocations, list):
        return data
    affine = owner("block", data)
    projected: list[JSON | None] = []
    for a in allocations:
        if a is None:
            projected.append(None)
            continue
        if not isinstance(a, dict) or not isinstance(a.get("attrs", {}), dict):
            return data
        holder = (a.get("attrs") or {}).get("node")
        if affine is not None and holder == affine:
            projected.append(None)  # the affine node's own: routed with the block
        else:
            attrs = {} if holder is None else {"node": holder}
            projected.append({"handle": REMOTE_HANDLE, "seq": 0, "attrs": attrs})
    return {
        "cidr": data.get("cidr"),
        "pool": data.get("pool"),
        "affinity": data.get("affinity"),
        "seq": 0,
        "allocations": projected,
        "unallocated": [],
        "full": False,
    }
