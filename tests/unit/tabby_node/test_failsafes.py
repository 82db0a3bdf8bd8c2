"""tabby-node's failsafe ports: the flags (Calico's defaults, ``none``, a bad entry refused
naming its flag) and its own needs derived from its configuration (datastore endpoints,
API server, typha, BGP)."""

from __future__ import annotations

import pytest

from cni_config.common import DatastoreSettings
from cni_protocol.errors import CniError
from policy.calico import FailsafePort, Failsafes
from tabby_node import options as node_options
from tabby_node.failsafes import node_failsafes, own_needs


def _resolve(host: str) -> list[str]:
    return {"etcd.example": ["10.1.0.1", "fd00::1"], "typha.local": ["10.1.0.9"]}.get(host, [])


def test_defaults_are_calicos() -> None:
    opts, settings = node_options.parse([], env={})
    fs = node_failsafes(opts, settings, resolve=_resolve)
    default = Failsafes()
    assert set(default.inbound) <= set(fs.inbound)
    assert set(default.outbound) <= set(fs.outbound)


def test_flags_and_env() -> None:
    opts, _ = node_options.parse(["--failsafe-inbound-host-ports", "tcp:2222"], env={})
    assert opts.failsafe_inbound_host_ports == "tcp:2222"
    env = {"TABBY_FAILSAFE_OUTBOUND_HOST_PORTS": "none"}
    opts, settings = node_options.parse(["--backend", "vxlan"], env=env)
    fs = node_failsafes(opts, settings, resolve=_resolve)
    assert fs.outbound == (FailsafePort("udp", 4789),)  # VXLAN: its own need
    with pytest.raises(CniError, match="failsafe"):
        node_options.parse(["--failsafe-inbound-host-ports", "tcp:99999"], env={})


def test_own_needs() -> None:
    opts, _ = node_options.parse(
        ["--typha-endpoints", "typha.local:5473", "--failsafe-outbound-host-ports", "none"],
        env={},
    )
    etcd = DatastoreSettings(
        datastore_type="etcdv3",
        etcd_endpoints=["https://etcd.example:2379", "http://10.2.0.2:12379"],
    )
    inbound, outbound = own_needs(opts, etcd, resolve=_resolve)
    assert FailsafePort("tcp", 179) in inbound
    assert FailsafePort("tcp", 179) in outbound
    assert FailsafePort("tcp", 2379, "10.1.0.1") in outbound
    assert FailsafePort("tcp", 2379, "fd00::1") in outbound
    assert FailsafePort("tcp", 12379, "10.2.0.2") in outbound
    assert FailsafePort("tcp", 5473, "10.1.0.9") in outbound
    kube = DatastoreSettings(datastore_type="kubernetes")
    _, out = own_needs(opts, kube, api_server="https://10.96.0.1:443", resolve=_resolve)
    assert FailsafePort("tcp", 443, "10.96.0.1") in out
    assert FailsafePort("udp", 4789) in out
    vx, _ = node_options.parse(["--backend", "vxlan"], env={})
    assert own_needs(vx, kube, resolve=_resolve) == (
        [FailsafePort("udp", 4789)],
        [FailsafePort("udp", 4789)],
    )
    svc, _ = node_options.parse(["--typha-service", "kube-system/tabby-typha"], env={})
    assert FailsafePort("tcp", 5473) in own_needs(svc, kube, resolve=_resolve)[1]
    alone, _ = node_options.parse(["--backend", "none"], env={})
    assert own_needs(alone, kube, resolve=_resolve) == ([], [])


def test_a_needed_port_with_an_address_beside_the_same_default_port_for_any() -> None:
    """The manifest's tabby-node (Kubernetes datastore, API server on 6443, Calico's default
    tcp:6443 to anywhere): both kept, in one order, and tabby-node starts (it failed with a
    TypeError comparing the default's net None with the needed one's address)."""
    opts, _ = node_options.parse(["--typha-service", "tabby-system/tabby-typha"], env={})
    kube = DatastoreSettings(datastore_type="kubernetes")
    fs = node_failsafes(opts, kube, api_server="https://10.250.70.1:6443", resolve=_resolve)
    mine = FailsafePort("tcp", 6443, "10.250.70.1")
    assert {FailsafePort("tcp", 6443), mine} <= set(fs.outbound)
    assert fs.outbound.index(FailsafePort("tcp", 6443)) < fs.outbound.index(mine)
    assert Failsafes(fs.inbound, fs.outbound[::-1]) == fs
