"""The ``tabby`` plugin's configuration fields (PRODUCT.md "Network configuration")."""

from __future__ import annotations

import re
from typing import Any

from cni_plugin.cni import conf as c
from cni_plugin.cni.errors import CniError, Code

DEFAULT_MTU_FILE = "/var/lib/tabby/mtu"
_PREFIX_RE = re.compile(r"^[a-zA-Z][a-zA-Z0-9_-]{0,3}$")


class PluginConf:
    __slots__ = ("allow_ip_forwarding", "ipam_type", "mtu", "network", "veth_prefix")

    def __init__(self, config: dict[str, Any], *, for_teardown: bool = False) -> None:
        self.network = str(config.get("name", ""))
        ipam = c.get_section(config, "ipam")
        ipam_type = ipam.get("type")
        if not isinstance(ipam_type, str) or not ipam_type:
            raise CniError(
                Code.INVALID_CONFIG,
                "ipam.type is required",
                "tabby delegates addressing to the plugin named in ipam.type",
            )
        if "/" in ipam_type or ipam_type in (".", ".."):
            raise CniError(
                Code.INVALID_CONFIG,
                "invalid ipam.type",
                f"ipam.type {ipam_type!r} must be a plain binary name (CFG-4)",
            )
        self.ipam_type = ipam_type
        self.veth_prefix = c.get_str(config, "veth_prefix", "cali")
        if not _PREFIX_RE.match(self.veth_prefix):
            raise c.unsupported(
                "veth_prefix",
                self.veth_prefix,
                "1-4 characters (letter first, then letters, digits, '_' or "
                "'-'), so that prefix + 11 hex chars fits 15 bytes",
            )
        settings = c.get_section(config, "container_settings")
        self.allow_ip_forwarding = c.get_bool(
            settings, "allow_ip_forwarding", False, prefix="container_settings."
        )
        # Teardown needs neither the MTU nor a readable mtu file.
        self.mtu = 1500 if for_teardown else _mtu(config)


def _mtu(config: dict[str, Any]) -> int:
    mtu = config.get("mtu", 1500)
    if mtu == 0:
        try:
            with open(DEFAULT_MTU_FILE, encoding="utf-8") as f:
                mtu = int(f.read().strip())
        except (OSError, ValueError):
            mtu = 1500
        if not 68 <= mtu <= 65535:
            mtu = 1500
    if isinstance(mtu, bool) or not isinstance(mtu, int) or not 68 <= mtu <= 65535:
        raise c.unsupported("mtu", mtu, "expected 0 (auto) or an integer from 68 to 65535")
    return mtu
