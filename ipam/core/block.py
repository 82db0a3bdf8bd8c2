"""The allocation block: one self-contained document, the unit of claim and of routing.

::

    {"cidr": "10.244.3.0/26", "pool": "10.244.0.0/16", "affinity": "host:node-a" | null,
     "seq": 41,                          # +1 on every assign, and at least the revision
                                         # the assign read (unique over re-creations)
     "allocations": [null | {"handle": "<handle id>", "seq": <block seq at assign>,
                             "attrs": {...}}, ...],        # one entry per ordinal
     "unallocated": [7, 12, 3, ...],     # FIFO of free ordinals: longest-free first
     "full": false}                      # last usable ordinal gone: the node's "avail"
                                         # hint dropped it, so a release must restore it

Ordinal ``o`` is address ``network_address + o``. The methods that change a block mutate
``self``: the allocator always works on ``copy()`` and persists before trusting the result.
"""

from __future__ import annotations

import ipaddress

from bundle.types import JSON, IPAddress, IPNetwork
from ipam.core.errors import StoreCorrupt
from ipam.core.model import AFFINITY_PREFIX, Reserved


class Block:
    __slots__ = ("affinity", "allocations", "full", "network", "pool", "seq", "unallocated")

    def __init__(
        self,
        network: IPNetwork,
        pool: str,
        affinity: str | None,
        seq: int,
        allocations: list[JSON | None],
        unallocated: list[int],
        full: bool = False,
    ) -> None:
        self.network = network
        self.pool = pool
        self.affinity = affinity
        self.seq = seq
        self.allocations = allocations
        self.unallocated = unallocated
        self.full = full

    # -- construction and (de)serialisation -----------------------------------------------

    @classmethod
    def new(cls, network: IPNetwork, pool: str, node: str | None) -> Block:
        size = network.num_addresses
        affinity = AFFINITY_PREFIX + node if node else None
        return cls(network, pool, affinity, 0, [None] * size, list(range(size)))

    @classmethod
    def from_data(cls, data: JSON, where: str) -> Block:
        cidr = data.get("cidr")
        try:
            if not isinstance(cidr, str):  # ip_network() reads an int (or a bool) as a /32
                raise TypeError(cidr)
            network = ipaddress.ip_network(cidr)
        except (ValueError, TypeError):
            raise StoreCorrupt(where, "malformed block: cidr") from None
        size = network.num_addresses
        pool = data.get("pool")
        affinity = data.get("affinity")
        seq = data.get("seq")
        allocations = data.get("allocations")
        unallocated = data.get("unallocated")
        full = data.get("full", False)
        bad = None
        if not isinstance(pool, str):
            bad = "pool"
        elif affinity is not None and not isinstance(affinity, str):
            bad = "affinity"
        elif type(seq) is not int or seq < 0:
            bad = "seq"
        elif not isinstance(allocations, list) or len(allocations) != size:
            bad = "allocations"
        elif not isinstance(unallocated, list) or not all(
            type(o) is int and 0 <= o < size for o in unallocated
        ):
            bad = "unallocated"
        elif not isinstance(full, bool):
            bad = "full"
        else:
            for a in allocations:
                if a is not None and not (
                    isinstance(a, dict)
                    and isinstance(a.get("handle"), str)
                    and type(a.get("seq")) is int
                    and isinstance(a.get("attrs", {}), dict)
                ):
                    bad = "allocation entry"
                    break
        if bad is not None:
            raise StoreCorrupt(where, f"malformed block: {bad}")
        return cls(network, pool, affinity, seq, allocations, unallocated, full)  # type: ignore[arg-type]

    def to_data(self) -> JSON:
        return {
            "cidr": str(self.network),
            "pool": self.pool,
            "affinity": self.affinity,
            "seq": self.seq,
            "allocations": self.allocations,
            "unallocated": self.unallocated,
            "full": self.full,
        }

    def copy(self) -> Block:
        return Block(
            self.network,
            self.pool,
            self.affinity,
            self.seq,
            list(self.allocations),
            list(self.unallocated),
            self.full,
        )

    # -- arithmetic ---------------------------------------------------------------------

    @property
    def cidr(self) -> str:
        return str(self.network)

    @property
    def size(self) -> int:
        return len(self.allocations)

    @property
    def node(self) -> str | None:
        """The node this block is affine to, or None."""
        a = self.affinity
        if a is not None and a.startswith(AFFINITY_PREFIX):
            return a[len(AFFINITY_PREFIX) :]
        return None

    def ip(self, ordinal: int) -> IPAddress:
        first = self.network.network_address
        return type(first)(int(first) + ordinal)

    def ordinal(self, ip: IPAddress) -> int:
        """The ordinal of ``ip``; ValueError if it is not in this block."""
        o = int(ip) - int(self.network.network_address)
        if ip.version != self.network.version or not 0 <= o < self.size:
            raise ValueError(f"{ip} is not in block {self.network}")
        return o

    def _reserved_ranges(self, reserved: Reserved) -> list[tuple[int, int]]:
        base = int(self.network.network_address)
        return [
            (a - base, b - base)
            for a, b in reserved.within(self.network.version, base, base + self.size - 1)
        ]

    # -- queries ------------------------------------------------------------------------

    def first_usable(self, reserved: Reserved) -> int | None:
        """The longest-free ordinal that is not reserved, or None (block full for us)."""
        ranges = self._reserved_ranges(reserved)
        allocations = self.allocations
        for o in self.unallocated:
            if allocations[o] is not None:
                continue  # inconsistent FIFO entry: never hand out an owned address
            if ranges and any(a <= o <= b for a, b in ranges):
                continue
            return o
        return None

    def usable_count(self, reserved: Reserved) -> int:
        ranges = self._reserved_ranges(reserved)
        allocations = self.allocations
        return sum(
            1
            for o in self.unallocated
            if allocations[o] is None and not any(a <= o <= b for a, b in ranges)
        )

    def in_use(self) -> int:
        return sum(1 for a in self.allocations if a is not None)

    def is_empty(self) -> bool:
        return all(a is None for a in self.allocations)

    def holds_for(self, node: str) -> bool:
        """Whether an allocation here was made for ``node`` (its ``node`` attribute)."""
        return any(
            a is not None and (a.get("attrs") or {}).get("node") == node for a in self.allocations
        )

    def ordinals_of(self, handle: str) -> list[int]:
        return [
            o for o, a in enumerate(self.allocations) if a is not None and a["handle"] == handle
        ]

    # -- changes (on a copy) ------------------------------------------------------------

    def assign(self, ordinal: int, handle: str, attrs: JSON, reserved: Reserved) -> int:
        """Give ``ordinal`` to ``handle``; returns the allocation's sequence number."""
        if self.allocations[ordinal] is not None:
            raise ValueError(f"ordinal {ordinal} of {self.network} is in use")
        self.seq += 1
        self.allocations[ordinal] = {"handle": handle, "seq": self.seq, "attrs": attrs}
        self.unallocated = [o for o in self.unallocated if o != ordinal]
        self.full = self.first_usable(reserved) is None
        return self.seq

    def release(self, ordinal: int) -> JSON | None:
        """Free ``ordinal`` (to the back of the FIFO); returns the allocation it had."""
        alloc = self.allocations[ordinal]
        if alloc is None:
            return None
        self.allocations[ordinal] = None
        if ordinal not in self.unallocated:
            self.unallocated.append(ordinal)
        self.full = False
        return alloc
