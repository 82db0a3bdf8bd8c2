"""Host-side veth names: ``<prefix>`` + 11 hex chars of a hash of the attachment."""

from __future__ import annotations

import hashlib

from cni_plugin.cni.errors import CniError, Code

#: Longest interface name the kernel accepts (IFNAMSIZ - 1). Defined here, not imported
#: from model.py, so that computing a name does not load dataclasses.
IFNAME_MAX = 15

#: Hex characters of the attachment hash in a host veth name.
HASH_CHARS = 11
#: Longest prefix that still leaves room for the hash within IFNAMSIZ - 1 bytes.
PREFIX_MAX = IFNAME_MAX - HASH_CHARS

_FORBIDDEN = frozenset("/:%")


def validate_veth_prefix(prefix: str) -> None:
    """Raise ``CniError`` (code 7) unless ``prefix`` + the hash is a usable interface name.

    The prefix must be 1 to 4 bytes, printable ASCII, and contain no ``/``, ``:``, ``%`` or
    whitespace (the kernel rejects ``/``, ``:`` and whitespace; ``%`` means "pick a number").
    """
    problem = ""
    if not prefix:
        problem = "is empty"
    elif len(prefix.encode()) > PREFIX_MAX:
        problem = f"is longer than {PREFIX_MAX} bytes (the name must fit {IFNAME_MAX} bytes)"
    elif not prefix.isascii() or not prefix.isprintable() or any(c.isspace() for c in prefix):
        problem = "must be printable ASCII without whitespace"
    elif _FORBIDDEN.intersection(prefix):
        problem = "must not contain '/', ':' or '%'"
    if problem:
        raise CniError(
            Code.INVALID_CONFIG,
            f"invalid veth_prefix {prefix!r}",
            f"veth_prefix {prefix!r} {problem}",
        )


def host_veth_name(prefix: str, network: str, container_id: str, ifname: str) -> str:
    """Deterministic host veth name of the attachment (network, container id, ifname).

    The same attachment always gets the same name, so a DEL finds what its ADD made and a
    repeated ADD replaces its own stale veth. ``len(result) == len(prefix) + 11``.
    """
    validate_veth_prefix(prefix)
    # NUL cannot occur in any of the three (they come from env vars / JSON names), so the
    # joined string identifies the tuple unambiguously.
    key = "\0".join((network, container_id, ifname)).encode()
    return prefix + hashlib.sha256(key).hexdigest()[:HASH_CHARS]
