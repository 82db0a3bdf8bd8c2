"""Value types of the public API, and the pool/handle/affinity documents.

Value types are ``NamedTuple``s and the documents plain ``__slots__`` classes: ``dataclasses``
imports ``inspect`` and costs ~5 ms of start-up per CNI call.

Documents (the block document lives in ``block.py``)::

    pool      {"cidr": "10.244.0.0/16", "block_size": 26, "disabled": false, ...}
              (the IPPool resource's other fields - name, ipip_mode, vxlan_mode,
              nat_outgoing, node_selector, ... - ride along untouched: ``Pool.extra``)
    affinity  {"node": "node-a", "format": 2,
               "blocks": [<the node's own blocks, claim order>],
               "borrowed": [<other blocks holding (or about to hold) its allocations>],
               "cursor": {<pool CIDR>: <next block index to try when claiming>}}

The affinity document is the node's index: every allocation made for the node lies in a
block it lists (invariant I2), so a release and a lookup by handle read the node's blocks
and nothing else. An attachment's handle is a field of its allocations, not a document.
Documents of format 1 (before 2) had no ``borrowed``; the node's handle documents
(``handle`` kind: ``{"id", "network", "container_id", "ifname", "node", "created",
"blocks"}``) indexed its allocations then, and are read once, to migrate them
(``ipam.core.legacy``).
"""

from __future__ import annotations

import ipaddress
from collections.abc import Iterable, Mapping, Sequence
from typing import NamedTuple

from bundle.types import JSON, IPAddress, IPNetwork
from ipam.core.errors import InvalidConfig, StoreCorrupt

BLOCK_SIZE_LIMITS = {4: (20, 32), 6: (116, 128)}
DEFAULT_BLOCK_SIZE = {4: 26, 6: 122}
AFFINITY_PREFIX = "host:"


# -- public value types ------------------------------------------------------------------


class PoolSpec(NamedTuple):
    """A pool as configured; ``block_size`` None = the family's default (26 / 122)."""

    cidr: str
    block_size: int | None = None
    disabled: bool = False


class AssignRequest(NamedTuple):
    """One attachment's address request (see ``Ipam.assign``)."""

    handle_id: str
    attrs: Mapping[str, object] | None = None
    want_v4: bool = True
    want_v6: bool = False
    v4_pools: Sequence[str] = ()
    v6_pools: Sequence[str] = ()
    specific_ips: Sequence[IPAddress | str] = ()
    strict_affinity: bool = False
    max_blocks_per_host: int = 0
    reserved: Sequence[str | IPNetwork | IPAddress] = ()


class Allocation(NamedTuple):
    """One address held by a handle. ``seq`` defeats stale release-by-address."""

    ip: IPAddress
    block_cidr: IPNetwork
    pool_cidr: IPNetwork
    handle_id: str
    seq: int


class GcReport(NamedTuple):
    released: list[str]  # handle ids released
    kept: list[str]  # handle ids in the valid list
    skipped_recent: list[str]  # stale-looking but younger than the grace period
    errors: list[str]  # "<handle id>: <error>", one per failure; GC went on after each


# The operator's report types (``release_node``, ``check``, usage tables, ``who_owns``) live
# in ``reports`` (exported lazily by ``ipam.core``): a CNI call never needs them, and each
# NamedTuple costs ~0.1 ms to define.


# -- identifiers and parsing ---------------------------------------------------------------


def handle_id(network: str, container_id: str, ifname: str) -> str:
    """The IPAM handle of one attachment: ``"<network>:<container id>:<ifname>"``."""
    for name, value in (("network", network), ("container id", container_id), ("ifname", ifname)):
        if not isinstance(value, str) or not value or ":" in value:
            raise InvalidConfig(f"invalid {name} for a handle id", repr(value))
    return f"{network}:{container_id}:{ifname}"


def split_handle_id(hid: str) -> tuple[str, str, str]:
    parts = hid.split(":")
    if len(parts) != 3 or not all(parts):
        raise InvalidConfig("invalid handle id", repr(hid))
    return parts[0], parts[1], parts[2]


def parse_network(text: object, what: str) -> IPNetwork:
    if isinstance(text, ipaddress.IPv4Network | ipaddress.IPv6Network):
        return text
    if not isinstance(text, str):
        raise InvalidConfig(f"invalid {what}", repr(text))
    try:
        return ipaddress.ip_network(text.strip(), strict=True)
    except ValueError as e:
        raise InvalidConfig(f"invalid {what}", f"{text!r}: {e}") from None


def parse_ip(value: object, what: str = "IP address") -> IPAddress:
    if isinstance(value, ipaddress.IPv4Address | ipaddress.IPv6Address):
        return value
    if isinstance(value, str):
        try:
            return ipaddress.ip_address(value.strip())
        except ValueError:
            pass
    raise InvalidConfig(f"invalid {what}", repr(value))


class Reserved:
    """Addresses never handed out: merged, sorted ``(lo, hi)`` int ranges per family."""

    __slots__ = ("ranges",)

    def __init__(self, ranges: dict[int, list[tuple[int, int]]]) -> None:
        self.ranges = ranges

    @classmethod
    def parse(cls, items: Iterable[object]) -> Reserved:
        raw: dict[int, list[tuple[int, int]]] = {4: [], 6: []}
        for item in items:
            if isinstance(item, ipaddress.IPv4Address | ipaddress.IPv6Address):
                raw[item.version].append((int(item), int(item)))
                continue
            if isinstance(item, ipaddress.IPv4Network | ipaddress.IPv6Network):
                net = item
            elif isinstance(item, str):
                try:
                    net = ipaddress.ip_network(item.strip(), strict=False)
                except ValueError:
                    raise InvalidConfig("invalid reserved address or CIDR", repr(item)) from None
            else:
                raise InvalidConfig("invalid reserved address or CIDR", repr(item))
            raw[net.version].append((int(net.network_address), int(net.broadcast_address)))
        merged: dict[int, list[tuple[int, int]]] = {}
        for fam, ranges in raw.items():
            out: list[tuple[int, int]] = []
            for lo, hi in sorted(ranges):
                if out and lo <= out[-1][1] + 1:
                    out[-1] = (out[-1][0], max(out[-1][1], hi))
                else:
                    out.append((lo, hi))
            merged[fam] = out
        return cls(merged)

    def within(self, version: int, lo: int, hi: int) -> list[tuple[int, int]]:
        """The reserved ranges overlapping ``[lo, hi]``."""
        return [(a, b) for a, b in self.ranges.get(version, ()) if a <= hi and b >= lo]

    def contains(self, ip: IPAddress) -> bool:
        n = int(ip)
        return any(a <= n <= b for a, b in self.ranges.get(ip.version, ()))

    def count(self, version: int, lo: int, hi: int) -> int:
        return sum(min(b, hi) - max(a, lo) + 1 for a, b in self.within(version, lo, hi))

    def covering(self, version: int, lo: int, hi: int) -> int | None:
        """The end of a reserved range covering all of ``[lo, hi]``, else None."""
        for a, b in self.ranges.get(version, ()):
            if a <= lo and b >= hi:
                return b
        return None


# -- documents ------------------------------------------------------------------------------


def _need(cond: bool, where: str, what: str) -> None:
    if not cond:
        raise StoreCorrupt(where, f"malformed document: {what}")


def _str_list(value: object) -> bool:
    return isinstance(value, list) and set(map(type, value)) <= {str}  # fast on long lists


_POOL_KEYS = ("cidr", "block_size", "disabled")


class Pool:
    """A pool document. ``extra`` holds the keys the allocator does not know (the IPPool
    resource's name, modes, selectors, ...): every rewrite of the document keeps them."""

    __slots__ = ("block_size", "disabled", "extra", "network")

    def __init__(
        self,
        network: IPNetwork,
        block_size: int,
        disabled: bool = False,
        extra: JSON | None = None,
    ) -> None:
        self.network = network
        self.block_size = block_size
        self.disabled = disabled
        self.extra = extra if extra is not None else {}

    @property
    def cidr(self) -> str:
        return str(self.network)

    @property
    def version(self) -> int:
        return self.network.version

    @property
    def block_count(self) -> int:
        return 1 << (self.block_size - self.network.prefixlen)

    @property
    def block_addresses(self) -> int:
        return 1 << (self.network.max_prefixlen - self.block_size)

    def block_network(self, index: int) -> IPNetwork:
        base = int(self.network.network_address) + index * self.block_addresses
        return type(self.network)((base, self.block_size))

    def block_index(self, ip: IPAddress) -> int:
        return (int(ip) - int(self.network.network_address)) // self.block_addresses

    @classmethod
    def from_spec(cls, cidr: str, block_size: int | None, disabled: bool = False) -> Pool:
        net = parse_network(cidr, "pool CIDR")
        size = DEFAULT_BLOCK_SIZE[net.version] if block_size is None else block_size
        lo, hi = BLOCK_SIZE_LIMITS[net.version]
        if isinstance(size, bool) or not isinstance(size, int) or not lo <= size <= hi:
            raise InvalidConfig(
                f"invalid IPv{net.version} block size", f"{size!r} for pool {net}: expect {lo}-{hi}"
            )
        if net.prefixlen > size:
            raise InvalidConfig(
                "pool smaller than one block", f"pool {net} cannot hold a /{size} block"
            )
        return cls(net, size, bool(disabled))

    @classmethod
    def from_data(cls, data: JSON, where: str) -> Pool:
        try:
            net = ipaddress.ip_network(data.get("cidr"))  # type: ignore[arg-type]
        except (ValueError, TypeError):
            raise StoreCorrupt(where, "malformed document: cidr") from None
        size = data.get("block_size")
        _need(type(size) is int and net.prefixlen <= size <= net.max_prefixlen, where, "block_size")
        _need(isinstance(data.get("disabled", False), bool), where, "disabled")
        extra = {k: v for k, v in data.items() if k not in _POOL_KEYS}
        return cls(net, size, bool(data.get("disabled", False)), extra)  # type: ignore[arg-type]

    def to_data(self) -> JSON:
        data: JSON = {
            "cidr": self.cidr,
            "block_size": self.block_size,
            "disabled": self.disabled,
        }
        data.update(self.extra)
        return data


class Handle:
    """A handle document of format 1 (``ipam.core.legacy`` migrates them)."""

    __slots__ = ("blocks", "id", "node")

    def __init__(self, hid: str, node: str, blocks: list[str]) -> None:
        self.id = hid
        self.node = node
        self.blocks = blocks

    @classmethod
    def from_data(cls, data: JSON, where: str) -> Handle:
        for field in ("id", "node"):
            _need(isinstance(data.get(field), str), where, field)
        _need(_str_list(data.get("blocks")), where, "blocks")
        return cls(data["id"], data["node"], list(data["blocks"]))


#: The affinity document's format: 2 = the node's index (``blocks`` + ``borrowed``), no
#: handle documents.
AFFINITY_FORMAT = 2


class Affinity:
    __slots__ = ("blocks", "borrowed", "cursor", "format", "node")

    def __init__(
        self,
        node: str,
        blocks: list[str],
        borrowed: list[str],
        cursor: dict[str, int],
        format: int = AFFINITY_FORMAT,
    ) -> None:
        self.node = node
        self.blocks = blocks
        self.borrowed = borrowed
        self.cursor = cursor
        self.format = format

    @classmethod
    def new(cls, node: str) -> Affinity:
        return cls(node, [], [], {})

    @classmethod
    def from_data(cls, data: JSON, where: str) -> Affinity:
        _need(isinstance(data.get("node"), str), where, "node")
        _need(_str_list(data.get("blocks")), where, "blocks")
        borrowed = data.get("borrowed", [])
        _need(_str_list(borrowed), where, "borrowed")
        cursor = data.get("cursor", {})
        _need(
            isinstance(cursor, dict) and all(type(v) is int for v in cursor.values()),
            where,
            "cursor",
        )
        fmt = data.get("format", 1)
        _need(type(fmt) is int, where, "format")
        return cls(data["node"], list(data["blocks"]), list(borrowed), dict(cursor), fmt)

    def to_data(self) -> JSON:
        return {
            "node": self.node,
            "format": self.format,
            "blocks": list(self.blocks),
            "borrowed": list(self.borrowed),
            "cursor": dict(self.cursor),
        }

    def copy(self) -> Affinity:
        return Affinity(
            self.node, list(self.blocks), list(self.borrowed), dict(self.cursor), self.format
        )

    @property
    def legacy(self) -> bool:
        """Written before format 2: the node's handle documents may index allocations."""
        return self.format < AFFINITY_FORMAT

    def indexed(self) -> list[str]:
        """Every block that may hold an allocation of the node: its own, then borrowed."""
        return [*self.blocks, *(c for c in self.borrowed if c not in self.blocks)]
