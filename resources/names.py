"""Name and label syntax as Kubernetes defines it, and the store keys of resources.

Standard library only: the CNI binaries' WorkloadEndpoint helpers (``resources.wep``)
use it without importing pydantic. Each rule is written here once; the pydantic models in
``resources.meta`` / ``k8s`` / ``tabby`` call these checkers.

Every checker returns ``None`` when the value is valid, else the reason (Kubernetes' wording),
so callers can attach it to a field path.
"""

from __future__ import annotations

import re

DNS1123_LABEL_MAX = 63
DNS1123_SUBDOMAIN_MAX = 253
LABEL_VALUE_MAX = 63
QUALIFIED_NAME_MAX = 63
PORT_NAME_MAX = 15
#: IFNAMSIZ - 1: the longest interface name the kernel takes.
INTERFACE_NAME_MAX = 15

_LABEL = "[a-z0-9]([-a-z0-9]*[a-z0-9])?"
_PATTERNS = {
    "label": f"{_LABEL}",
    "subdomain": rf"{_LABEL}(\.{_LABEL})*",
    "qualified": r"([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9]",
    "port": r"[a-z0-9]([a-z0-9-]*[a-z0-9])?",
    "interface": r"[A-Za-z0-9][A-Za-z0-9_.-]*",
}
_compiled: dict[str, re.Pattern[str]] = {}


def _matches(pattern: str, value: str) -> bool:
    """Compiled on first use: the CNI plugin needs one of these, and only sometimes."""
    rx = _compiled.get(pattern)
    if rx is None:
        rx = _compiled[pattern] = re.compile(_PATTERNS[pattern])
    return rx.fullmatch(value) is not None


#: Every Namespace carries this label, set to its name (applied or not).
NAMESPACE_NAME_LABEL = "kubernetes.io/metadata.name"


def dns1123_label(value: str) -> str | None:
    """A Namespace name, a container name: at most 63 of ``[a-z0-9-]``, alphanumeric ends."""
    if len(value) > DNS1123_LABEL_MAX:
        return f"must be no more than {DNS1123_LABEL_MAX} characters"
    if not _matches("label", value):
        return (
            "a lowercase RFC 1123 label must consist of lower case alphanumeric characters "
            "or '-', and must start and end with an alphanumeric character"
        )
    return None


def dns1123_subdomain(value: str) -> str | None:
    """Most object names: dot-separated DNS-1123 labels, at most 253 characters."""
    if len(value) > DNS1123_SUBDOMAIN_MAX:
        return f"must be no more than {DNS1123_SUBDOMAIN_MAX} characters"
    if not _matches("subdomain", value):
        return (
            "a lowercase RFC 1123 subdomain must consist of lower case alphanumeric "
            "characters, '-' or '.', and must start and end with an alphanumeric character"
        )
    return None


def qualified_name(value: str) -> str | None:
    """A label or annotation key: ``[prefix/]name``, the prefix a DNS-1123 subdomain."""
    prefix, slash, name = value.rpartition("/")
    if slash:
        if not prefix:
            return "prefix part must be non-empty"
        why = dns1123_subdomain(prefix)
        if why is not None:
            return f"prefix part {why}"
    if not name:
        return "name part must be non-empty"
    if len(name) > QUALIFIED_NAME_MAX:
        return f"name part must be no more than {QUALIFIED_NAME_MAX} characters"
    if not _matches("qualified", name):
        return (
            "name part must consist of alphanumeric characters, '-', '_' or '.', and must "
            "start and end with an alphanumeric character"
        )
    return None


def label_value(value: str) -> str | None:
    """Empty, or at most 63 of ``[A-Za-z0-9-_.]`` with alphanumeric ends."""
    if not value:
        return None
    if len(value) > LABEL_VALUE_MAX:
        return f"must be no more than {LABEL_VALUE_MAX} characters"
    if not _matches("qualified", value):
        return (
            "a valid label must be an empty string or consist of alphanumeric characters, "
            "'-', '_' or '.', and must start and end with an alphanumeric character"
        )
    return None


def port_name(value: str) -> str | None:
    """An IANA service name (a named container port): at most 15 of ``[a-z0-9-]``, one
    letter at least, no ``--``, alphanumeric ends."""
    if len(value) > PORT_NAME_MAX:
        return f"must be no more than {PORT_NAME_MAX} characters"
    if not _matches("port", value):
        return "must contain only alpha-numeric characters (a-z, 0-9), and hyphens (-)"
    if "--" in value:
        return "must not contain consecutive hyphens"
    if not any("a" <= c <= "z" for c in value):
        return "must contain at least one letter (a-z)"
    return None


def interface_name(value: str) -> str | None:
    """A host interface tabby names (a WorkloadEndpoint's ``hostInterface``): at most 15
    of ``[A-Za-z0-9_.-]``, alphanumeric first. The name becomes part of nftables chain,
    map and counter names, so nothing else may pass (a ``;`` would end an nft command)."""
    if len(value) > INTERFACE_NAME_MAX:
        return f"must be no more than {INTERFACE_NAME_MAX} characters"
    if not _matches("interface", value):
        return (
            "must consist of alphanumeric characters, '-', '_' or '.', and must start with "
            "an alphanumeric character"
        )
    return None


# -- store keys ------------------------------------------------------------------------------


def namespaced_key(namespace: str, name: str) -> str:
    """The store key of a namespaced resource: ``"<namespace>/<name>"``."""
    return f"{namespace}/{name}"


def split_namespaced_key(key: str) -> tuple[str, str]:
    """``(namespace, name)`` of a namespaced key."""
    namespace, _, name = key.partition("/")
    return namespace, name


def namespace_labels(name: str, labels: dict[str, str] | None = None) -> dict[str, str]:
    """A Namespace's labels: its own plus ``kubernetes.io/metadata.name: <name>`` (which
    always wins, as the API server sets it). ``labels=None`` is a Namespace never applied."""
    return {**(labels or {}), NAMESPACE_NAME_LABEL: name}
