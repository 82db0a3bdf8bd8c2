"""The plugin flavour a runtime test runs with: tabby itself, or Debian's ptp + host-local in
the same shape (to prove the harness without tabby), and the conflists for each."""

from __future__ import annotations

import ipaddress
import json
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .harness_base import (
    DEBIAN_CNI_DIR,
    EXAMPLES,
    NODE_NAME,
    POOL_V4,
    POOL_V6,
    TABBY_BIN_DIR,
    TINY_V4,
)


def load_example(filename: str) -> dict[str, Any]:
    return dict(json.loads((EXAMPLES / filename).read_text()))


EXAMPLE_FILES = {
    "ipv4": "10-tabby.conflist",
    "dualstack": "10-tabby-dualstack.conflist",
    "chained": "10-tabby-chained.conflist",
}


def _vkey(version: str) -> tuple[int, ...]:
    return tuple(int(part) for part in version.split("."))


def _as_bool(value: Any) -> bool:
    return value is True or str(value).lower() == "true"


@dataclass
class Flavor:
    """Which plugins play the pod network: tabby itself, or Debian's ptp + host-local in the
    same shape (to prove the harness without tabby)."""

    name: str
    plugin_dirs: list[str] = field(default_factory=list)

    @property
    def main_type(self) -> str:
        return "tabby" if self.name == "tabby" else "ptp"

    @property
    def ipam_type(self) -> str:
        return "tabby-ipam" if self.name == "tabby" else "host-local"

    def binaries(self) -> list[Path]:
        if self.name == "tabby":
            return [TABBY_BIN_DIR / "tabby", TABBY_BIN_DIR / "tabby-ipam"]
        return [DEBIAN_CNI_DIR / "ptp", DEBIAN_CNI_DIR / "host-local"]

    def conflist(
        self,
        example: str,
        *,
        data_dir: Path,
        log_dir: Path,
        tiny: bool = False,
        name: str | None = None,
    ) -> dict[str, Any]:
        """The example `example` (ipv4|dualstack|chained), rewritten for one test: private
        IPAM state dir, node name and log file; optionally a pool of a few addresses."""
        conf = load_example(EXAMPLE_FILES[example])
        if name:
            conf["name"] = name
        first = conf["plugins"][0]
        assert first["type"] == "tabby", "conf-examples must start with tabby"
        if self.name == "tabby":
            first["nodename"] = NODE_NAME
            first["log_file_path"] = str(log_dir / "cni.log")
            first["log_level"] = "debug"
            first["ipam"]["data_dir"] = str(data_dir)
            if tiny:
                first["ipam"].update(
                    {
                        "assign_ipv6": False,
                        "ipv4_pools": [str(TINY_V4)],
                        "block_size_ipv4": TINY_V4.prefixlen,
                        "reserved": [],
                    }
                )
            return conf
        conf["plugins"][0] = self._reference_plugin(first, data_dir, tiny)
        # Debian's reference plugins speak CNI up to 1.0.0.
        if _vkey(conf["cniVersion"]) > _vkey("1.0.0"):
            conf["cniVersion"] = "1.0.0"
        if "cniVersions" in conf:
            conf["cniVersions"] = [v for v in conf["cniVersions"] if _vkey(v) <= _vkey("1.0.0")]
        return conf

    @staticmethod
    def _reference_plugin(tabby: dict[str, Any], data_dir: Path, tiny: bool) -> dict[str, Any]:
        ipam = tabby["ipam"]
        ranges: list[list[dict[str, str]]] = []
        routes: list[dict[str, str]] = []
        if tiny:
            first = TINY_V4.network_address
            ranges.append(
                [
                    {
                        "subnet": str(ipaddress.ip_network(f"{first}/29")),
                        "rangeStart": str(first + 2),
                        "rangeEnd": str(first + 3),
                    }
                ]
            )
            routes.append({"dst": "0.0.0.0/0"})
        else:
            if _as_bool(ipam.get("assign_ipv4", True)):
                ranges.append([{"subnet": p} for p in ipam.get("ipv4_pools", [str(POOL_V4)])])
                routes.append({"dst": "0.0.0.0/0"})
            if _as_bool(ipam.get("assign_ipv6", False)):
                ranges.append([{"subnet": p} for p in ipam.get("ipv6_pools", [str(POOL_V6)])])
                routes.append({"dst": "::/0"})
        return {
            "type": "ptp",
            "mtu": tabby.get("mtu", 1500),
            "ipMasq": False,
            "ipam": {
                "type": "host-local",
                "ranges": ranges,
                "routes": routes,
                "dataDir": str(data_dir),
            },
        }

    def store_mentions(self, data_dir: Path, needles: Iterable[str]) -> list[str]:
        """Files of the IPAM store under data_dir that mention any of needles (a container ID,
        a pod name): evidence that an allocation for that attachment is still recorded.

        host-local keeps one file per address holding "<container id>\\r\\n<ifname>"; tabby's
        file store records the pod name and attachment with every allocation."""
        wanted = [n.encode() for n in needles if n]
        hits: list[str] = []
        if not data_dir.exists():
            return hits
        for path in sorted(data_dir.rglob("*")):
            if not path.is_file() or path.name in ("lock",) or path.suffix == ".lock":
                continue
            try:
                data = path.read_bytes()
            except OSError:
                continue
            hits.extend(f"{path}: {n.decode()}" for n in wanted if n in data)
        return hits


def pod_ips(result: dict[str, Any]) -> list[str]:
    """Bare addresses of a CNI result's ips (any version >= 0.3.0)."""
    return [str(ipaddress.ip_interface(ip["address"]).ip) for ip in result.get("ips", [])]


def in_pools(addr: str) -> bool:
    ip = ipaddress.ip_address(addr)
    return ip in (POOL_V4 if ip.version == 4 else POOL_V6)
