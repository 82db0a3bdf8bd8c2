"""The names of what tabby makes in the kernel: host-side veths (``<prefix>`` + 11 hex chars
of a hash of the attachment) and the nftables table."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from hashlib import sha256 as _sha256
else:
    try:  # CPython's own SHA-256: hashlib would load OpenSSL first (3-12 ms a CNI process)
        _sha256 = importlib.import_module("_sha256").sha256
    except ImportError:  # pragma: no cover - another interpreter
        from hashlib import sha256 as _sha256

#: Longest interface name the kernel accepts (IFNAMSIZ - 1). Defined here, not imported
#: from model.py, so that computing a name does not load dataclasses.
IFNAME_MAX = 15

#: Hex characters of the attachment hash in a host veth name.
HASH_CHARS = 11
#: Longest prefix that still leaves room for the hash within IFNAMSIZ - 1 bytes.
PREFIX_MAX = IFNAME_MAX - HASH_CHARS

#: Default ``veth_prefix`` (docs/configuration.md "`tabby` fields"), as Calico names its host veths.
DEFAULT_VETH_PREFIX = "cali"

#: The name of tabby's own nftables table (``inet tabby``).
NFT_TABLE = "tabby"

_PREFIX_CHARS = frozenset("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789_-")


def veth_prefix_problem(prefix: str) -> str | None:
    """Why ``prefix`` cannot start host veth names, or None. The one rule for veth_prefix
    (the configuration models, the dataplane and tabbyctl all use it): 1 to 4 characters, a
    letter first, then letters, digits, ``_`` or ``-``, so that prefix + 11 hex characters is
    an interface name the kernel and every tool accept."""
    if not isinstance(prefix, str) or not 1 <= len(prefix) <= PREFIX_MAX:
        return f"must be 1 to {PREFIX_MAX} characters (the name must fit {IFNAME_MAX} bytes)"
    if not (prefix[0].isascii() and prefix[0].isalpha()) or not _PREFIX_CHARS.issuperset(prefix):
        return "must be a letter followed by letters, digits, '_' or '-'"
    return None


def validate_veth_prefix(prefix: str) -> None:
    """Raise :class:`~dataplane.errors.InvalidVethPrefix` unless ``prefix`` can start host
    veth names."""
    problem = veth_prefix_problem(prefix)
    if problem:
        from dataplane.errors import InvalidVethPrefix  # only when refused: names stay cheap

        raise InvalidVethPrefix(prefix, problem)


def host_veth_name(prefix: str, network: str, container_id: str, ifname: str) -> str:
    """Deterministic host veth name of the attachment (network, container id, ifname).

    The same attachment always gets the same name, so a DEL finds what its ADD made and a
    repeated ADD replaces its own stale veth. ``len(result) == len(prefix) + 11``.
    """
    validate_veth_prefix(prefix)
    # NUL cannot occur in any of the three (they come from env vars / JSON names), so the
    # joined string identifies the tuple unambiguously.
    key = "\0".join((network, container_id, ifname)).encode()
    return prefix + str(_sha256(key).hexdigest())[:HASH_CHARS]
