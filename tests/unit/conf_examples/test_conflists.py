"""conf-examples/*.conflist stay valid: structure, versions every runtime here can use, fields
tabby knows, and tabby's own config parsers accept them. (The e2e tier,
tests/e2e/runtimes, runs each example through libcni, podman and containerd.)"""

from __future__ import annotations

import ipaddress
import json
import re
from typing import Any

import pytest

from tests import REPO_ROOT

EXAMPLES = REPO_ROOT / "conf-examples"
FILES = ("10-tabby.conflist", "10-tabby-dualstack.conflist", "10-tabby-chained.conflist")

TABBY_VERSIONS = ("0.3.0", "0.3.1", "0.4.0", "1.0.0", "1.1.0")
# Debian 12's libcni (1.1.2, inside podman 4.3 and containerd 1.6 too) ignores `cniVersions`,
# sends `cniVersion` as is, and cannot parse a 1.1.0 result; Debian's portmap and tuning
# (containernetworking-plugins 1.1.1) speak up to 1.0.0. Newer libcni picks the highest of
# `cniVersions` it knows without asking the plugins.
MAX_CNI_VERSION_FOR_DEBIAN_RUNTIMES = "1.0.0"
DEBIAN_PLUGINS = {"bandwidth", "bridge", "firewall", "portmap", "tuning", "sbr", "vrf"}

PLUGIN_FIELDS = {
    "type",
    "mtu",
    "veth_prefix",
    "log_level",
    "log_file_path",
    "nodename",
    "nodename_file",
    "container_settings",
    "capabilities",
    "ipam",
}
IPAM_FIELDS = {
    "type",
    "assign_ipv4",
    "assign_ipv6",
    "ipv4_pools",
    "ipv6_pools",
    "block_size_ipv4",
    "block_size_ipv6",
    "strict_affinity",
    "max_blocks_per_host",
    "reserved",
    "datastore_type",
    "data_dir",
    "lock_timeout_seconds",
    "etcd_endpoints",
    "etcd_prefix",
    "etcd_ca_cert_file",
    "etcd_cert_file",
    "etcd_key_file",
    "etcd_watch_transport",
    "etcd_watch_endpoints",
}
POOL_V4 = ipaddress.ip_network("10.244.0.0/16")
POOL_V6 = ipaddress.ip_network("fd00:10:244::/48")


def _version_key(v: str) -> tuple[int, ...]:
    return tuple(int(p) for p in v.split("."))


def load(name: str) -> dict[str, Any]:
    data = json.loads((EXAMPLES / name).read_text())
    assert isinstance(data, dict)
    return data


def as_bool(value: Any) -> bool:
    assert value in (True, False, "true", "false"), value
    return value in (True, "true")


def test_the_three_examples_exist() -> None:
    assert sorted(p.name for p in EXAMPLES.glob("*.conflist")) == sorted(FILES)


@pytest.mark.parametrize("name", FILES)
def test_list_level(name: str) -> None:
    conf = load(name)
    assert re.fullmatch(r"[a-zA-Z0-9][a-zA-Z0-9_.\-]*", conf["name"])
    assert conf["name"] == "k8s-pod-network"
    versions = conf["cniVersions"]
    assert versions == sorted(versions, key=_version_key), "cniVersions must be ascending"
    assert set(versions) <= set(TABBY_VERSIONS)
    assert conf["cniVersion"] in versions
    assert _version_key(conf["cniVersion"]) <= _version_key(MAX_CNI_VERSION_FOR_DEBIAN_RUNTIMES)
    assert _version_key(conf["cniVersion"]) >= (0, 4, 0), "CHECK and cached DEL need >= 0.4.0"
    assert isinstance(conf["plugins"], list)
    assert conf["plugins"]


@pytest.mark.parametrize("name", FILES)
def test_tabby_plugin(name: str) -> None:
    plugin = load(name)["plugins"][0]
    assert plugin["type"] == "tabby"
    assert set(plugin) <= PLUGIN_FIELDS, set(plugin) - PLUGIN_FIELDS
    assert isinstance(plugin["mtu"], int)
    assert plugin["mtu"] == 0 or 68 <= plugin["mtu"] <= 65535
    assert plugin["log_level"] in ("debug", "info", "warning", "error")
    assert plugin["log_file_path"].startswith("/")
    assert isinstance(plugin["capabilities"], dict)
    assert all(v is True for v in plugin["capabilities"].values())


@pytest.mark.parametrize("name", FILES)
def test_tabby_ipam(name: str) -> None:
    ipam = load(name)["plugins"][0]["ipam"]
    assert ipam["type"] == "tabby-ipam"
    assert set(ipam) <= IPAM_FIELDS, set(ipam) - IPAM_FIELDS
    v4, v6 = as_bool(ipam.get("assign_ipv4", True)), as_bool(ipam.get("assign_ipv6", False))
    assert v4 or v6
    assert v6 == (name == "10-tabby-dualstack.conflist")
    pools = []
    for family, key, bound, block_key, lo, hi in (
        (4, "ipv4_pools", POOL_V4, "block_size_ipv4", 20, 32),
        (6, "ipv6_pools", POOL_V6, "block_size_ipv6", 116, 128),
    ):
        if not (v4 if family == 4 else v6):
            continue
        assert ipam[key], f"{key} needed when assigning IPv{family}"
        for cidr in ipam[key]:
            net = ipaddress.ip_network(cidr)  # strict: no host bits
            assert net.version == family
            assert net.subnet_of(bound), f"{cidr} outside {bound}"  # type: ignore[arg-type]
            assert lo <= ipam[block_key] <= hi
            assert ipam[block_key] >= net.prefixlen
            pools.append(net)
    for cidr in ipam.get("reserved", []):
        net = ipaddress.ip_network(cidr)
        assert any(
            net.version == p.version and net.subnet_of(p)  # type: ignore[arg-type]
            for p in pools
        ), cidr
    assert ipam["datastore_type"] == "file"
    assert ipam["data_dir"] == "/var/lib/tabby/ipam"
    assert ipam["lock_timeout_seconds"] > 0


def test_chained_example_runs_debian_plugins_after_tabby() -> None:
    conf = load("10-tabby-chained.conflist")
    assert _version_key(conf["cniVersions"][-1]) <= _version_key(
        MAX_CNI_VERSION_FOR_DEBIAN_RUNTIMES
    ), "libcni >= 1.2 would send Debian's portmap 1.1.0"
    types = [p["type"] for p in conf["plugins"]]
    assert types == ["tabby", "portmap", "tuning"]
    assert set(types[1:]) <= DEBIAN_PLUGINS
    portmap = conf["plugins"][1]
    assert portmap["capabilities"] == {"portMappings": True}
    assert portmap["snat"] is True  # hostPorts on 127.0.0.1 need SNAT
    assert all(k.startswith("net.") for k in conf["plugins"][2]["sysctl"])


@pytest.mark.parametrize("name", FILES)
def test_tabby_parsers_accept_the_example(name: str) -> None:
    """What the plugins themselves make of the example (libcni hands each plugin its own
    object with the list's name and cniVersion)."""
    from cni_plugin.config import parse_plugin
    from ipam import config as ipam_config

    conf = load(name)
    plugin = dict(conf["plugins"][0], name=conf["name"], cniVersion=conf["cniVersion"])
    parsed = parse_plugin(plugin)
    assert parsed.ipam_type == "tabby-ipam"
    assert parsed.mtu == plugin["mtu"]
    ipam = ipam_config.parse_plugin(plugin).ipam
    assert [str(p) for p in ipam.ipv4_pools] == plugin["ipam"]["ipv4_pools"]
    assert ipam.assign_ipv6 == as_bool(plugin["ipam"].get("assign_ipv6", False))
