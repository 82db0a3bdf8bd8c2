"""What tabby-node finds out about its node at start (discovery): its name, its underlay
addresses, the uplink's MTU, whether the kernel can do IP-in-IP."""

from __future__ import annotations

import dataclasses
import ipaddress
import logging
import os
import socket
from typing import TYPE_CHECKING

from cni_protocol.errors import CniError, Code
from tabby_node.cluster import Underlay

if TYPE_CHECKING:
    from dataplane.nodeinfo import NodeAddress
    from tabby_node.options import NodeOptions

log = logging.getLogger("tabby.node")


@dataclasses.dataclass(frozen=True)
class Facts:
    """What tabby-node found out about its node at start."""

    name: str
    ipv4: NodeAddress | None
    ipv6: NodeAddress | None
    uplink_mtu: int
    ipip_available: bool
    ipip_reason: str

    def underlay(self) -> Underlay:
        """This node's underlay addresses, uplinks and MTU (what its VXLAN devices use)."""
        v4, v6 = self.ipv4, self.ipv6
        return Underlay(
            ipv4=ipaddress.IPv4Interface(f"{v4.address}/{v4.prefixlen}") if v4 else None,
            ipv6=ipaddress.IPv6Interface(f"{v6.address}/{v6.prefixlen}") if v6 else None,
            uplink_v4=v4.interface if v4 else None,
            uplink_v6=v6.interface if v6 else None,
            mtu=self.uplink_mtu,
        )


def node_name(options: NodeOptions) -> str:
    """``--nodename``, else the name a previous start wrote to ``<state-dir>/nodename``,
    else the hostname."""
    if options.nodename:
        return options.nodename
    from cni_config.values import node_name_problem

    try:
        with open(options.nodename_file, encoding="utf-8") as f:
            text = f.read().strip()
    except OSError:
        text = ""
    if text and node_name_problem(text) is None:
        return text
    return socket.gethostname().lower()


def discover(options: NodeOptions) -> Facts:
    """The node's facts, as ``--node-ip``/``--node-ip6`` and the kernel say (CniError code 7
    when an address the backend needs cannot be found)."""
    from dataplane import nodeinfo

    name = node_name(options)
    v4: NodeAddress | None = None
    v6: NodeAddress | None = None
    try:
        v4 = nodeinfo.detect_address(options.node_ip, 4)
    except nodeinfo.AutodetectError as e:
        if options.backend != "none":
            raise CniError(
                Code.INVALID_CONFIG, "cannot find the node's IPv4 address", str(e)
            ) from None
        log.warning("no node IPv4 address (%s); fine for --backend none", e)
    if options.node_ip6:
        try:
            v6 = nodeinfo.detect_address(options.node_ip6, 6)
        except nodeinfo.AutodetectError as e:
            raise CniError(
                Code.INVALID_CONFIG, "cannot find the node's IPv6 address", str(e)
            ) from None
    uplink = nodeinfo.uplink_mtu([a for a in (v4, v6) if a is not None])
    ipip = nodeinfo.ipip_support()
    return Facts(name, v4, v6, uplink, ipip.available, ipip.reason)


def write_file(path: str, text: str) -> None:
    """``path`` replaced whole with ``text`` (a reader sees the old or the new): the
    node's name in ``<state-dir>/nodename``, the pod MTU in ``<state-dir>/mtu``."""
    tmp = f"{path}.{os.getpid()}.tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        f.write(text)
    os.replace(tmp, path)
