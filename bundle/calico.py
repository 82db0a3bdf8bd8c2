"""Calico's vocabulary, defined once: the labels its selectors see on an endpoint or a
network set, its protocol names, its default tier and where Kubernetes policies go in it.

Standard library only (layer 0): the resources (``resources.selector`` folds namespace and
service-account selectors into selectors over these labels; ``resources.calico`` validates
with these names) and the policy engine (``policy.engine`` and ``policy.calico``, which
import no resource) share them.
"""

from __future__ import annotations

from collections.abc import Mapping

#: The label every namespaced endpoint and network set carries (its namespace's name).
NAMESPACE_LABEL = "projectcalico.org/namespace"
#: The label an endpoint with a service account carries (the account's name).
SERVICE_ACCOUNT_LABEL = "projectcalico.org/serviceaccount"
#: Under the prefixes below: the namespace's / service account's own name.
NAME_LABEL = "projectcalico.org/name"
#: Prefix of a namespace's labels among its endpoints' labels (``namespaceSelector``).
NAMESPACE_PREFIX = "pcns."
#: Prefix of a service account's labels among its endpoints' labels (``serviceAccountSelector``).
SERVICE_ACCOUNT_PREFIX = "pcsa."

#: The protocol names Calico takes (as it spells them), and their numbers.
PROTOCOLS = {"TCP": 6, "UDP": 17, "ICMP": 1, "ICMPv6": 58, "SCTP": 132, "UDPLite": 136}
#: The tier every policy without ``tier`` is in (and every Kubernetes NetworkPolicy); it
#: always exists.
DEFAULT_TIER = "default"
#: The default tier's order (Calico's): after every tier an administrator orders.
DEFAULT_TIER_ORDER = 1_000_000.0
#: The order of a Kubernetes NetworkPolicy in the default tier (Calico's conversion).
KUBERNETES_POLICY_ORDER = 1000.0
#: What Calico's conversion puts before a Kubernetes NetworkPolicy's name (a reserved prefix).
KUBERNETES_POLICY_PREFIX = "knp.default."


def endpoint_labels(
    labels: Mapping[str, str],
    *,
    namespace: str | None = None,
    namespace_labels: Mapping[str, str] | None = None,
    service_account: str | None = None,
    service_account_labels: Mapping[str, str] | None = None,
) -> dict[str, str]:
    """The labels selectors see on an endpoint (or network set), as Calico builds them.

    Its own labels; for a namespaced object ``projectcalico.org/namespace`` and its
    namespace's labels under ``pcns.`` (with ``pcns.projectcalico.org/name``); with a
    service account ``projectcalico.org/serviceaccount`` and the account's labels under
    ``pcsa.`` (with ``pcsa.projectcalico.org/name``). The derived labels win over an own label
    of the same key, so a pod cannot claim another namespace's labels. A global object (a host
    endpoint, a global network set) is given no namespace: ``global()`` selects it.
    """
    out = dict(labels)
    if namespace is not None:
        for key, value in (namespace_labels or {}).items():
            out[NAMESPACE_PREFIX + key] = value
        out[NAMESPACE_PREFIX + NAME_LABEL] = namespace
        out[NAMESPACE_LABEL] = namespace
    if service_account is not None:
        for key, value in (service_account_labels or {}).items():
            out[SERVICE_ACCOUNT_PREFIX + key] = value
        out[SERVICE_ACCOUNT_PREFIX + NAME_LABEL] = service_account
        out[SERVICE_ACCOUNT_LABEL] = service_account
    return out
