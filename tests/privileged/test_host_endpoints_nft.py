"""Host endpoints in the kernel: a node namespace whose interface ``hep0`` (192.168.77.1) is a
host endpoint, a peer namespace beyond it (192.168.77.2), a pod behind the node (10.244.77.5
on a ``cali*`` veth). Servers listen on the node (SSH, BGP, etcd, the API server's ports, and
8080 and UDP 9000, which no failsafe covers) and in the pod (TCP and UDP 80, 81).

Each scenario is applied through :class:`PolicyDataplane` (Calico's default failsafe ports)
and probed from the peer: what the kernel lets through must be what ``engine.explain``
decides for the connection arriving on ``hep0``, and a deny-all host-endpoint policy must
leave SSH, the API server, etcd and BGP working (issue 30).
"""

from __future__ import annotations

import dataclasses
import ipaddress
import subprocess
from collections.abc import Iterator
from typing import Any

import pytest

import dataplane
from policy import engine
from policy.calico import CalicoPolicy, CalicoRule, EntityMatch, HostEndpoint, PortMatch
from policy.engine import ClusterState, Endpoint, Namespace, Pod
from policy.state import PolicyDataplane
from resources.selector import parse_selector
from tests.policy_probes import Job, probe_many, start_server, stop_process
from tests.privileged.netns_util import Netns, Node, netns_pool, run_in_thread_netns

pytestmark = pytest.mark.privileged

TCP, UDP = 6, 17
HOST, PEER, POD = "192.168.77.1", "192.168.77.2", "10.244.77.5"
IFACE = "hep0"
NODE_PORTS = (22, 179, 2379, 6443, 8080, 9000)
NODES = parse_selector("role == 'node'")
HEP = HostEndpoint("node1-hep0", "node1", IFACE, (HOST,), (("role", "node"),))
FAILSAFE_PROBES: list[Job] = [(HOST, "TCP", p) for p in (22, 6443, 2379, 179)]


@dataclasses.dataclass
class World:
    node: Node
    peer: Netns
    pod_iface: str
    dp: PolicyDataplane

    def state(self, *policies: CalicoPolicy) -> ClusterState:
        return ClusterState(
            namespaces=(Namespace("x"),),
            pods=(Pod("x", "web", (("app", "web"),)),),
            endpoints=(Endpoint("x", "web", "node1", self.pod_iface, (POD,)),),
            calico_policies=policies,
            host_endpoints=(HEP,),
        )

    def apply(self, state: ClusterState) -> None:
        self.node.run(self.dp.sync, state)

    def probe(self, jobs: list[Job], timeout: float = 0.5) -> dict[Job, bool]:
        got = run_in_thread_netns(self.peer.path, lambda: probe_many(jobs, timeout))
        again = [j for j, ok in got.items() if not ok]
        if again:  # a slow start is not a denial: the denied ones are tried once more
            got.update(run_in_thread_netns(self.peer.path, lambda: probe_many(again, 2.0)))
        return got

    def expected(self, state: ClusterState, jobs: list[Job]) -> dict[Job, bool]:
        out = {}
        for addr, proto, port in jobs:
            ex = self.node.run(
                engine.explain,
                state,
                PEER,
                addr,
                proto,
                port,
                node="node1",
                host_addresses=[HOST],
                in_interface=IFACE,
                workload_prefix="cali",
            )
            out[(addr, proto, port)] = ex.allowed
        return out


@pytest.fixture(scope="module")
def world() -> Iterator[World]:
    servers: list[subprocess.Popen[str]] = []
    with netns_pool() as pool:
        try:
            node = pool.node()
            peer = pool.pod()
            node.ip(
                "link", "add", IFACE, "type", "veth", "peer", "name", "eth0", "netns", peer.name
            )
            node.ip("addr", "add", f"{HOST}/24", "dev", IFACE)
            node.ip("link", "set", IFACE, "up")
            peer.ip("link", "set", "lo", "up")
            peer.ip("addr", "add", f"{PEER}/24", "dev", "eth0")
            peer.ip("link", "set", "eth0", "up")
            peer.ip("route", "add", "default", "via", HOST)
            pod = pool.pod()
            host_if = dataplane.host_veth_name("cali", "k8s-pod-network", pod.name, "eth0")
            spec = dataplane.SetupSpec(
                netns_path=pod.path,
                ifname="eth0",
                host_ifname=host_if,
                addresses=[ipaddress.IPv4Address(POD)],
            )
            node.run(dataplane.setup, spec)
            servers.append(start_server(node.name, NODE_PORTS))
            servers.append(start_server(pod.name))
            dp = PolicyDataplane("node1", families=(4,))
            yield World(node, peer, host_if, dp)
        finally:
            for proc in servers:
                stop_process(proc)


def deny_all(**flags: Any) -> CalicoPolicy:
    rules = (CalicoRule("Deny"),)
    both: frozenset[engine.Direction] = frozenset({"ingress", "egress"})
    return CalicoPolicy("deny-all", None, NODES, types=both, ingress=rules, egress=rules, **flags)


def allow(name: str, protocol: int, port: int, **flags: Any) -> CalicoPolicy:
    rule = CalicoRule("Allow", protocol, destination=EntityMatch(ports=(PortMatch(port, port),)))
    return CalicoPolicy(name, None, NODES, order=10, ingress=(rule,), **flags)


AOF: dict[str, Any] = {"apply_on_forward": True}
PREDNAT: dict[str, Any] = {"pre_dnat": True, "apply_on_forward": True}
UNTRACKED: dict[str, Any] = {"do_not_track": True, "apply_on_forward": True}

JOBS: list[Job] = [
    *FAILSAFE_PROBES,
    (HOST, "TCP", 8080),
    (HOST, "UDP", 9000),
    (POD, "TCP", 80),
    (POD, "TCP", 81),
]

SCENARIOS: dict[str, tuple[tuple[CalicoPolicy, ...], dict[Job, bool]]] = {
    # what issue 30 asks: nothing closes SSH, the API server, etcd, BGP; the rest of the
    # node is closed; forwarded traffic is not this policy's (no applyOnForward)
    "deny-all": (
        (deny_all(),),
        {(HOST, "TCP", 8080): False, (HOST, "UDP", 9000): False, (POD, "TCP", 80): True},
    ),
    "no-policy": ((), {(HOST, "TCP", 8080): False, (POD, "TCP", 81): True}),
    "apply-on-forward": (
        (deny_all(**AOF), allow("pod-81", TCP, 81, **AOF)),
        {(POD, "TCP", 80): False, (POD, "TCP", 81): True, (HOST, "TCP", 8080): False},
    ),
    # a pre-DNAT Allow skips the normal deny-all; a pre-DNAT Deny closes a pod's port
    "prednat": (
        (
            deny_all(),
            allow("pre-8080", TCP, 8080, **PREDNAT),
            CalicoPolicy(
                "pre-deny-80",
                None,
                NODES,
                order=20,
                ingress=(
                    CalicoRule("Deny", TCP, destination=EntityMatch(ports=(PortMatch(80, 80),))),
                    CalicoRule("Deny", TCP, destination=EntityMatch(ports=(PortMatch(22, 22),))),
                ),
                **PREDNAT,
            ),
        ),
        {(HOST, "TCP", 8080): True, (POD, "TCP", 80): False, (POD, "TCP", 81): True},
    ),
    # untracked both ways for UDP 9000 (its replies are untracked too); a doNotTrack
    # deny-all cannot close the failsafe ports
    "do-not-track": (
        (
            deny_all(**UNTRACKED),
            CalicoPolicy(
                "raw-9000",
                None,
                NODES,
                order=10,
                types=frozenset({"ingress", "egress"}),
                ingress=(
                    CalicoRule(
                        "Allow", UDP, destination=EntityMatch(ports=(PortMatch(9000, 9000),))
                    ),
                ),
                egress=(
                    CalicoRule("Allow", UDP, source=EntityMatch(ports=(PortMatch(9000, 9000),))),
                ),
                **UNTRACKED,
            ),
        ),
        {(HOST, "UDP", 9000): True, (HOST, "TCP", 8080): False, (POD, "TCP", 80): False},
    ),
}


@pytest.mark.parametrize("name", list(SCENARIOS))
def test_host_endpoint_policy_in_the_kernel(world: World, name: str) -> None:
    policies, must = SCENARIOS[name]
    state = world.state(*policies)
    try:
        world.apply(state)
        want = world.expected(state, JOBS)
        for job, ok in must.items():
            assert want[job] is ok, f"explain: {job}"
        for job in FAILSAFE_PROBES:
            assert want[job], f"explain closes a failsafe port: {job}"
        got = world.probe(JOBS)
        bad = [f"{j}: kernel {got[j]}, explain {want[j]}" for j in JOBS if got[j] != want[j]]
        assert not bad, "\n".join(bad)
    finally:
        world.apply(world.state())


def test_untracked_without_its_reverse_rule_loses_the_reply(world: World) -> None:
    """Calico's doNotTrack: the reply of an untracked flow is untracked too and needs its own
    rule; without one it meets the normal egress policy (deny-all) and is lost."""
    state = world.state(deny_all(), allow("raw-9000", UDP, 9000, **UNTRACKED))
    try:
        world.apply(state)
        got = world.probe([(HOST, "UDP", 9000)], timeout=0.5)
        assert not got[(HOST, "UDP", 9000)]
    finally:
        world.apply(world.state())
