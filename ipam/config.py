"""tabby-ipam's view of the network configuration (PRODUCT.md "Network configuration").

Hand-written validation (no pydantic on the hot path: it costs ~85 ms per process to import
and build models). Every field error names the field and the value (code 2) or says what
is structurally wrong (code 7).
"""

from __future__ import annotations

import ipaddress
from typing import Any

from cni_plugin.cni import conf as c
from cni_plugin.cni.errors import CniError, Code

DEFAULT_DATA_DIR = "/var/lib/tabby/ipam"
DEFAULT_V4_POOLS = ("10.244.0.0/16",)
DEFAULT_V6_POOLS = ("fd00:10:244::/48",)
P = "ipam."


class IpamConf:
    __slots__ = (
        "assign_ipv4",
        "assign_ipv6",
        "block_size_ipv4",
        "block_size_ipv6",
        "data_dir",
        "datastore_type",
        "gc_grace_seconds",
        "ipv4_pools",
        "ipv6_pools",
        "lock_timeout_seconds",
        "max_blocks_per_host",
        "reserved",
        "strict_affinity",
    )

    def __init__(self, ipam: dict[str, Any]) -> None:
        self.assign_ipv4 = c.get_bool(ipam, "assign_ipv4", True, prefix=P)
        self.assign_ipv6 = c.get_bool(ipam, "assign_ipv6", False, prefix=P)
        self.block_size_ipv4 = c.get_int(ipam, "block_size_ipv4", 26, lo=20, hi=32, prefix=P)
        self.block_size_ipv6 = c.get_int(ipam, "block_size_ipv6", 122, lo=116, hi=128, prefix=P)
        self.ipv4_pools = _pools(ipam, "ipv4_pools", 4, DEFAULT_V4_POOLS)
        self.ipv6_pools = _pools(ipam, "ipv6_pools", 6, DEFAULT_V6_POOLS)
        self.strict_affinity = c.get_bool(ipam, "strict_affinity", False, prefix=P)
        self.max_blocks_per_host = c.get_int(
            ipam, "max_blocks_per_host", 0, lo=0, hi=1 << 30, prefix=P
        )
        self.reserved = [
            _network(r, "reserved") for r in c.get_str_list(ipam, "reserved", prefix=P)
        ]
        self.datastore_type = c.get_str(ipam, "datastore_type", "file", prefix=P)
        if self.datastore_type == "etcdv3":
            raise c.unsupported(
                P + "datastore_type",
                self.datastore_type,
                "the etcd store is not available in this release; use 'file'",
            )
        if self.datastore_type != "file":
            raise c.unsupported(
                P + "datastore_type", self.datastore_type, "expected 'file' or 'etcdv3'"
            )
        self.data_dir = c.get_str(ipam, "data_dir", DEFAULT_DATA_DIR, prefix=P)
        if not self.data_dir.startswith("/"):
            raise c.unsupported(P + "data_dir", self.data_dir, "must be an absolute path")
        timeout = ipam.get("lock_timeout_seconds", 30)
        if isinstance(timeout, bool) or not isinstance(timeout, int | float) or timeout <= 0:
            raise c.unsupported(P + "lock_timeout_seconds", timeout, "expected a number > 0")
        self.lock_timeout_seconds = float(timeout)
        grace = ipam.get("gc_grace_seconds", 0)
        if isinstance(grace, bool) or not isinstance(grace, int | float) or grace < 0:
            raise c.unsupported(P + "gc_grace_seconds", grace, "expected a number >= 0")
        self.gc_grace_seconds = float(grace)
        if not (self.assign_ipv4 or self.assign_ipv6):
            raise CniError(
                Code.INVALID_CONFIG,
                "nothing to assign",
                "assign_ipv4 and assign_ipv6 are both false",
            )


def _network(text: str, field: str) -> ipaddress.IPv4Network | ipaddress.IPv6Network:
    try:
        return ipaddress.ip_network(text, strict=False)
    except ValueError:
        raise c.unsupported(P + field, text, "not an IP address or CIDR") from None


def _pools(ipam: dict[str, Any], field: str, family: int, default: tuple[str, ...]) -> list[str]:
    raw = c.get_str_list(ipam, field, prefix=P) if field in ipam else list(default)
    out = []
    for text in raw:
        try:
            net = ipaddress.ip_network(text, strict=True)
        except ValueError:
            raise c.unsupported(P + field, text, "not a CIDR (host bits must be zero)") from None
        if net.version != family:
            raise c.unsupported(P + field, text, f"not an IPv{family} CIDR")
        out.append(str(net))
    return out


def parse(config: dict[str, Any]) -> IpamConf:
    return IpamConf(c.get_section(config, "ipam"))
