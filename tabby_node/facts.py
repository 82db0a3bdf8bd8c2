"""What tabby-node found out about its node at start."""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from dataplane.nodeinfo import NodeAddress


@dataclasses.dataclass
class Facts:
    """What tabby-node found out about its node at start."""

    name: str
    ipv4: NodeAddress | None
    ipv6: NodeAddress | None
    uplink_mtu: int
    ipip_available: bool
    ipip_reason: str
