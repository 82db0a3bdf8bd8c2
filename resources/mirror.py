"""Who owns a resource: the operator (``tabbyctl``) or Kubernetes (tabby-kube-controllers).

In Kubernetes mode the controllers mirror Namespaces, Pods, NetworkPolicies and the Nodes'
labels from the Kubernetes API into the datastore, and mark each resource they write with
the annotation ``tabby.io/source: kubernetes``. The rules (one place, applied by
``resources.client.ResourceClient`` to every apply and delete):

- the operator may not change or delete a marked resource (change it with kubectl), nor
  mark one; on a marked Node only what Kubernetes does not own may change (``spec.bgp``:
  the AS number and the route reflector cluster id), never its labels;
- the controllers change only marked resources, and a Node's labels (tabby-node writes the
  rest of a Node): what an operator made with tabbyctl stays as it is.

In the Kubernetes datastore nothing is mirrored: what Kubernetes owns is read where it lives
(``stores.kube.kinds``), and tabbyctl may not write it at all (``kubernetes_own``): a Pod,
Namespace or NetworkPolicy is changed with kubectl, a WorkloadEndpoint is made of its pod's
IPAM allocations, and a Node's labels are the Kubernetes Node's (tabby's Node holds the
rest). A refusal is one line, given before anything is written.

Standard library only.
"""

from __future__ import annotations

from collections.abc import Mapping

SOURCE_ANNOTATION = "tabby.io/source"
KUBERNETES = "kubernetes"
#: The owners a ResourceClient writes as.
OPERATOR = "operator"


def is_mirrored(data: Mapping[str, object] | None) -> bool:
    """Whether a stored (or applied) document carries the mark of the controllers."""
    if not isinstance(data, Mapping):
        return False
    meta = data.get("metadata")
    annotations = meta.get("annotations") if isinstance(meta, Mapping) else None
    return isinstance(annotations, Mapping) and annotations.get(SOURCE_ANNOTATION) == KUBERNETES


#: The store kinds Kubernetes owns in the Kubernetes datastore (``stores.kube.kinds.NATIVE``),
#: and the one made of other documents there (an attachment's allocations).
KUBERNETES_OWN = frozenset({"pod", "namespace", "serviceaccount", "networkpolicy"})
DERIVED = frozenset({"workloadendpoint"})


def kubernetes_own_refusal(label: str, store_kind: str) -> str | None:
    """One line for a write of ``store_kind`` in the Kubernetes datastore, or None when
    tabbyctl may write it."""
    if store_kind in KUBERNETES_OWN:
        return f"{label} is Kubernetes' own in the Kubernetes datastore: change it with kubectl"
    if store_kind in DERIVED:
        return (
            f"{label} is made of its pod's IPAM allocations in the Kubernetes datastore: "
            "nothing to write (it goes with the pod)"
        )
    return None


def node_labels_refusal(label: str, name: str) -> str:
    """A Node's labels changed with tabbyctl in the Kubernetes datastore."""
    return (
        f"{label}: its labels are the Kubernetes Node's in the Kubernetes datastore: change "
        f"them with kubectl label node {name}"
    )


def refusal(label: str, writer: str) -> str:
    """One line for an owner's write that the other owner's resource refuses."""
    if writer == OPERATOR:
        return (
            f"{label} is mirrored from Kubernetes ({SOURCE_ANNOTATION}: {KUBERNETES}): "
            "change it with kubectl"
        )
    return f"{label} was made with tabbyctl: tabby-kube-controllers leave it alone"
