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


def refusal(label: str, writer: str) -> str:
    """One line for an owner's write that the other owner's resource refuses."""
    if writer == OPERATOR:
        return (
            f"{label} is mirrored from Kubernetes ({SOURCE_ANNOTATION}: {KUBERNETES}): "
            "change it with kubectl"
        )
    return f"{label} was made with tabbyctl: tabby-kube-controllers leave it alone"
