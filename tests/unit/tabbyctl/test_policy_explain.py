"""``tabbyctl policy explain``: which policies select a pod and why traffic is allowed or
denied, computed from the datastore's resources with tabby-node's engine.

The cluster: namespaces x and y; pods x/a (app=a, container port ``http`` 80/TCP), x/b
(app=b) on node-a, y/c (app=c) on node-b, each with its WorkloadEndpoint as the plugin
writes it; nodes with their underlay addresses. Resources go in with ``tabbyctl apply``
(file store under ``tmp_path``); the pure ``explain`` also runs over a MemoryStore.
"""

from __future__ import annotations

import json
import uuid
from pathlib import Path
from typing import Any

import pytest
from click.testing import Result

from datastore.base import Store
from datastore.file import FileStore
from datastore.memory import MemoryStore
from resources import wep
from resources.client import ResourceClient
from tabbyctl import policy
from tests.unit.tabbyctl.helpers import invoke, without_datastore_environment

A, B, C = "10.244.0.10", "10.244.0.11", "10.244.1.10"
NODE_A, NODE_B = "192.168.7.1", "192.168.7.2"


def _ns(name: str, **labels: str) -> dict[str, Any]:
    return {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": name, "labels": labels}}


def _pod(ns: str, name: str, labels: dict[str, str], ports: list[Any] | None = None) -> Any:
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"namespace": ns, "name": name, "labels": labels},
        "spec": {"containers": [{"name": "main", "ports": ports or []}]},
    }


def _node(name: str, ip: str) -> dict[str, Any]:
    return {
        "apiVersion": "tabby.io/v1",
        "kind": "Node",
        "metadata": {"name": name},
        "spec": {"backend": "vxlan", "ipv4Address": f"{ip}/24"},
    }


def netpol(ns: str, name: str, spec: dict[str, Any]) -> dict[str, Any]:
    return {
        "apiVersion": "networking.k8s.io/v1",
        "kind": "NetworkPolicy",
        "metadata": {"namespace": ns, "name": name},
        "spec": spec,
    }


CLUSTER = [
    _ns("x", team="blue"),
    _ns("y", team="red"),
    _pod("x", "a", {"app": "a"}, [{"name": "http", "containerPort": 80}]),
    _pod("x", "b", {"app": "b"}),
    _pod("y", "c", {"app": "c"}),
    _node("node-a", NODE_A),
    _node("node-b", NODE_B),
]
ENDPOINTS = [("x", "node-a", "a", A), ("x", "node-a", "b", B), ("y", "node-b", "c", C)]

DENY_INGRESS_X = netpol("x", "default-deny", {"podSelector": {}})
DENY_EGRESS_Y = netpol("y", "deny-egress", {"podSelector": {}, "policyTypes": ["Egress"]})
ALLOW_FROM_Y = netpol(
    "x",
    "allow-from-y",
    {
        "podSelector": {"matchLabels": {"app": "a"}},
        "ingress": [
            {"from": [{"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "y"}}}]}
        ],
    },
)
ALLOW_HTTP = netpol(
    "x",
    "allow-http",
    {"podSelector": {"matchLabels": {"app": "a"}}, "ingress": [{"ports": [{"port": "http"}]}]},
)
ALLOW_DNS_OUT = netpol(
    "y",
    "dns-out",
    {
        "podSelector": {},
        "policyTypes": ["Egress"],
        "egress": [
            {
                "to": [{"ipBlock": {"cidr": "8.8.0.0/16", "except": ["8.8.4.0/24"]}}],
                "ports": [{"protocol": "UDP", "port": 53}],
            }
        ],
    },
)


def populate(store: Store, *policies: dict[str, Any]) -> None:
    ResourceClient(store).apply([*CLUSTER, *policies])
    for ns, node, pod, ip in ENDPOINTS:
        wep.write_endpoint(
            store,
            namespace=ns,
            node=node,
            pod=pod,
            container_id=f"cid-{pod}",
            interface="eth0",
            host_interface=f"cali{pod}",
            ip_networks=[f"{ip}/32"],
        )


class Ctl:
    def __init__(self, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
        without_datastore_environment(monkeypatch)
        self.tmp = tmp_path
        self.data_dir = tmp_path / "store"
        self.flags = ["--datastore-type", "file", "--data-dir", str(self.data_dir)]

    def store(self) -> FileStore:
        return FileStore(str(self.data_dir), lock_timeout=5)

    def apply(self, *docs: dict[str, Any]) -> None:
        path = self.tmp / f"{uuid.uuid4().hex}.json"
        path.write_text(json.dumps(list(docs)))
        result = self.run("apply", "-f", str(path))
        assert result.exit_code == 0, result.stderr

    def run(self, *args: str) -> Result:
        argv = ["--conf", str(self.tmp / "none.conflist"), *self.flags, *args]
        (self.tmp / "none.conflist").write_text(
            json.dumps({"name": "n", "plugins": [{"type": "tabby", "nodename": "node-a"}]})
        )
        return invoke(argv)

    def explain(self, *args: str) -> list[str]:
        result = self.run("policy", "explain", *args)
        assert result.exit_code == 0, (result.stdout, result.stderr)
        assert result.stderr == ""
        return result.stdout.splitlines()

    def json(self, *args: str) -> Any:
        result = self.run("policy", "explain", *args, "-o", "json")
        assert result.exit_code == 0, (result.stdout, result.stderr)
        return json.loads(result.stdout)

    def fails(self, *args: str, code: int = 1) -> str:
        result = self.run("policy", "explain", *args)
        assert result.exit_code == code, (result.stdout, result.stderr)
        assert result.stdout == ""
        lines = result.stderr.strip().splitlines()
        if code == 1:
            assert len(lines) == 1, lines
        return lines[-1]


@pytest.fixture
def ctl(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Ctl:
    c = Ctl(tmp_path, monkeypatch)
    populate(c.store())
    return c


# == which policies select a pod ===============================================================


def test_no_policy_nothing_isolated(ctl: Ctl) -> None:
    assert ctl.explain("x/a") == [
        "pod x/a",
        "  ingress: not isolated (no policy selects it for ingress): all allowed",
        "  egress: not isolated (no policy selects it for egress): all allowed",
    ]
    assert ctl.json("x/a") == {
        "pod": "x/a",
        "policies": {"ingress": [], "egress": []},
        "isolated": {"ingress": False, "egress": False},
        "traffic": None,
    }


def test_selecting_policies_per_direction(ctl: Ctl) -> None:
    ctl.apply(DENY_INGRESS_X, ALLOW_FROM_Y, ALLOW_HTTP, DENY_EGRESS_Y)
    data = ctl.json("x/a")
    assert data["policies"] == {
        "ingress": ["x/allow-from-y", "x/allow-http", "x/default-deny"],
        "egress": [],
    }
    assert data["isolated"] == {"ingress": True, "egress": False}
    assert ctl.json("x/b")["policies"]["ingress"] == ["x/default-deny"]
    assert ctl.json("y/c")["policies"] == {"ingress": [], "egress": ["y/deny-egress"]}
    lines = ctl.explain("x/b")
    assert lines[1] == "  ingress: isolated, selected by x/default-deny"


def test_a_pod_known_only_by_its_pod_resource(ctl: Ctl) -> None:
    ctl.apply(_pod("x", "later", {"app": "a"}), DENY_INGRESS_X, ALLOW_HTTP)
    assert ctl.json("x/later")["policies"]["ingress"] == ["x/allow-http", "x/default-deny"]
    # but without an address its traffic cannot be evaluated
    line = ctl.fails("x/later", "--from", "x/b")
    assert "no endpoint with an address for pod x/later" in line


def test_json_names_calicos_tier_rule_logs_and_staged_verdict(ctl: Ctl) -> None:
    """-o json says what the text says in Calico's model: the tier and the rule that
    decided, the Log rules met on the way, and what a staged policy would have done."""
    v3 = "projectcalico.org/v3"
    tier = {"apiVersion": v3, "kind": "Tier", "metadata": {"name": "sec"}, "spec": {"order": 1}}
    guard = {
        "apiVersion": v3,
        "kind": "GlobalNetworkPolicy",
        "metadata": {"name": "sec.guard"},
        "spec": {
            "tier": "sec",
            "selector": "app == 'a'",
            "ingress": [
                {"action": "Log"},
                {"action": "Deny", "protocol": "UDP"},
                {"action": "Pass"},
            ],
        },
    }
    staged = {
        "apiVersion": v3,
        "kind": "StagedNetworkPolicy",
        "metadata": {"name": "lock", "namespace": "x"},
        "spec": {"selector": "app == 'a'", "ingress": [{"action": "Deny"}]},
    }
    ctl.apply(tier, guard, staged)
    udp = ctl.json("x/a", "--from", "y/c", "--port", "53/UDP")["traffic"]["ingress"]
    assert (udp["allowed"], udp["tier"], udp["decided_by"]) == (
        False,
        "sec",
        "sec/sec.guard ingress[1]",
    )
    assert udp["logged"] == ["sec/sec.guard ingress[0]"]
    tcp = ctl.json("x/a", "--from", "y/c", "--port", "80/TCP")["traffic"]["ingress"]
    assert (tcp["allowed"], tcp["tier"], tcp["decided_by"]) == (True, None, "")
    assert tcp["staged"].startswith("would have denied: by ")
    assert "lock ingress[0]" in tcp["staged"]


# == the truth-table cases =====================================================================


def test_default_deny_ingress(ctl: Ctl) -> None:
    ctl.apply(DENY_INGRESS_X)
    lines = ctl.explain("x/a", "--from", "x/b", "--port", "80/TCP")
    assert lines[-5:] == [
        "x/b -> x/a TCP/80: DENIED",
        "  egress of x/b: selected by none",
        "    allowed: no policy selects the pod for egress",
        "  ingress of x/a: selected by x/default-deny",
        "    denied: isolated by 1 policy and none of their 0 ingress rules matches",
    ]
    traffic = ctl.json("x/a", "--from", "x/b", "--port", "80/TCP")["traffic"]
    assert traffic == {
        "src": "x/b",
        "dst": "x/a",
        "protocol": "TCP",
        "port": 80,
        "port_name": None,
        "allowed": False,
        "egress": {
            "pod": "x/b",
            "direction": "egress",
            "selected_by": [],
            "isolated": False,
            "allowed": True,
            "allowed_by": [],
            "reason": "no policy selects the pod for egress",
            "tier": None,
            "decided_by": "",
            "logged": [],
            "staged": "",
        },
        "ingress": {
            "pod": "x/a",
            "direction": "ingress",
            "selected_by": ["x/default-deny"],
            "isolated": True,
            "allowed": False,
            "allowed_by": [],
            "reason": "isolated by 1 policy and none of their 0 ingress rules matches",
            "tier": "default",
            "decided_by": "",
            "logged": [],
            "staged": "",
        },
    }
    # x/b's ingress is isolated by the same policy
    assert ctl.json("x/a", "--to", "x/b", "--port", "80")["traffic"]["allowed"] is False
    # y's pods are not selected by x's policy
    assert ctl.json("y/c", "--from", "x/a", "--port", "80")["traffic"]["allowed"] is True


def test_allow_from_a_namespace(ctl: Ctl) -> None:
    ctl.apply(DENY_INGRESS_X, ALLOW_FROM_Y)
    allowed = ctl.json("x/a", "--from", "y/c", "--port", "8080/TCP")["traffic"]
    assert allowed["allowed"] is True
    assert allowed["ingress"]["allowed_by"] == ["x/allow-from-y ingress[0]"]
    lines = ctl.explain("x/a", "--from", "y/c", "--port", "8080/TCP")
    assert "x/c" not in " ".join(lines)
    assert lines[-5] == "y/c -> x/a TCP/8080: ALLOWED"
    assert lines[-1] == "    allowed: by x/allow-from-y ingress[0]"
    # same namespace, not y: denied; and x/b is not selected by allow-from-y at all
    assert ctl.json("x/a", "--from", "x/b", "--port", "8080/TCP")["traffic"]["allowed"] is False
    assert ctl.json("x/b", "--from", "y/c", "--port", "8080/TCP")["traffic"]["allowed"] is False
    # a pod address works like the pod
    by_ip = ctl.json("x/a", "--from", C, "--port", "8080/TCP")["traffic"]
    assert (by_ip["src"], by_ip["allowed"]) == (f"y/c ({C})", True)


def test_named_port(ctl: Ctl) -> None:
    ctl.apply(DENY_INGRESS_X, ALLOW_HTTP)
    by_number = ctl.json("x/a", "--from", "x/b", "--port", "80/TCP")["traffic"]
    assert by_number["allowed"] is True
    assert by_number["ingress"]["allowed_by"] == ["x/allow-http ingress[0]"]
    by_name = ctl.json("x/a", "--from", "x/b", "--port", "http")["traffic"]
    assert (by_name["port"], by_name["port_name"], by_name["allowed"]) == (80, "http", True)
    assert "  (port http is 80/TCP on the destination pod)" in ctl.explain(
        "x/a", "--from", "x/b", "--port", "http/tcp"
    )
    for other in ("81/TCP", "80/UDP", "80/SCTP"):
        assert ctl.json("x/a", "--from", "x/b", "--port", other)["traffic"]["allowed"] is False
    # the name resolves on the destination: x/b declares no http port
    assert "declares no container port 'http' (TCP)" in ctl.fails(
        "x/b", "--from", "x/a", "--port", "http"
    )
    assert "declares no container port 'http' (UDP)" in ctl.fails(
        "x/a", "--from", "x/b", "--port", "http/UDP"
    )


def test_without_a_port_only_rules_for_every_port_count(ctl: Ctl) -> None:
    ctl.apply(DENY_INGRESS_X, ALLOW_HTTP)
    lines = ctl.explain("x/a", "--from", "x/b")
    assert lines[-6] == "x/b -> x/a TCP: DENIED"
    assert lines[-1] == (
        "  (without --port only rules that allow every port count: give --port P/PROTO)"
    )
    ctl.apply(ALLOW_FROM_Y)  # no ports: every port
    assert ctl.json("x/a", "--from", "y/c")["traffic"]["allowed"] is True


def test_egress_isolation_and_ip_blocks(ctl: Ctl) -> None:
    ctl.apply(ALLOW_DNS_OUT)
    out = ctl.json("y/c", "--to", "8.8.8.8", "--port", "53/UDP")["traffic"]
    assert (out["dst"], out["allowed"], out["ingress"]) == ("8.8.8.8", True, None)
    assert out["egress"]["allowed_by"] == ["y/dns-out egress[0]"]
    assert ctl.json("y/c", "--to", "8.8.4.4", "--port", "53/UDP")["traffic"]["allowed"] is False
    assert ctl.json("y/c", "--to", "8.8.8.8", "--port", "53/TCP")["traffic"]["allowed"] is False
    # a CIDR stands for its first address
    assert ctl.json("y/c", "--to", "8.8.0.0/16", "--port", "53/UDP")["traffic"]["allowed"] is True
    # to a pod: egress of y/c denied, ingress of x/a not isolated
    to_pod = ctl.json("y/c", "--to", "x/a", "--port", "80")["traffic"]
    assert (to_pod["allowed"], to_pod["egress"]["allowed"], to_pod["ingress"]["allowed"]) == (
        False,
        False,
        True,
    )


def test_the_node_reaches_its_own_pods_unpoliced(ctl: Ctl) -> None:
    ctl.apply(DENY_INGRESS_X)
    own = ctl.json("x/a", "--from", NODE_A, "--port", "80")["traffic"]
    assert own["allowed"] is True
    assert own["ingress"]["reason"] == "traffic from node node-a to its own pods is not policed"
    other = ctl.json("x/a", "--from", NODE_B, "--port", "80")["traffic"]
    assert other["allowed"] is False


# == errors: one line, exit 1 (usage errors: exit 2) ===========================================


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["x/nope"], "pod x/nope not found: no Pod resource and no WorkloadEndpoint"),
        (["x/a", "--to", "y/nope"], "pod y/nope not found"),
        (["a/b/c"], "pod 'a/b/c': expected NAMESPACE/NAME"),
        (["x/a", "--to", "10.0.0.300"], "--to '10.0.0.300': not a valid address or CIDR"),
        (["x/a", "--to", "x/b", "--port", "80/ICMP"], "protocol must be one of TCP, UDP, SCTP"),
        (["x/a", "--to", "x/b", "--port", "0"], "a port number is 1..65535"),
        (["x/a", "--to", "x/b", "--port", "/TCP"], "expected P/PROTO"),
    ],
)
def test_errors_are_one_line(ctl: Ctl, args: list[str], message: str) -> None:
    assert message in ctl.fails(*args)


def test_usage_errors(ctl: Ctl) -> None:
    assert "not both" in ctl.fails("x/a", "--to", "x/b", "--from", "y/c", code=2)
    assert "--port goes with --to or --from" in ctl.fails("x/a", "--port", "80", code=2)


def test_a_bare_name_is_in_default(ctl: Ctl) -> None:
    assert "pod default/a not found" in ctl.fails("a")
    ctl.apply(_pod("default", "a", {}))
    assert ctl.json("a")["pod"] == "default/a"


def test_unreadable_store_is_one_line(ctl: Ctl) -> None:
    ctl.flags = ["--datastore-type", "file", "--data-dir", str(ctl.tmp / "no" / "such")]
    # an empty store knows no pod
    assert "pod x/a not found" in ctl.fails("x/a")
    ctl.flags = ["--datastore-type", "consul"]
    assert "datastore" in ctl.fails("x/a").lower()


# == the pure answer over the memory store =====================================================


def test_explain_over_the_memory_store() -> None:
    store = MemoryStore()
    populate(store, DENY_INGRESS_X, ALLOW_FROM_Y)
    cluster = policy.read_cluster(store)
    assert {n: a for n, a in cluster.node_addresses.items()} == {
        "node-a": (NODE_A,),
        "node-b": (NODE_B,),
    }
    answer = policy.explain(cluster, "x/a", from_="y/c", port="53/UDP")
    assert answer["traffic"]["allowed"] is True
    denied = policy.explain(cluster, "x/a", from_="x/b")
    assert denied["traffic"]["allowed"] is False
    with pytest.raises(policy.ExplainError, match="not both"):
        policy.explain(cluster, "x/a", to="x/b", from_="y/c")


def test_an_invalid_document_is_skipped_as_tabby_node_skips_it(
    caplog: pytest.LogCaptureFixture,
) -> None:
    store = MemoryStore()
    populate(store, DENY_INGRESS_X)
    bad = netpol("x", "broken", {"podSelector": {}})
    store.put("networkpolicy", "x/broken", {**bad, "spec": {"podSelector": 7}}, None)
    cluster = policy.read_cluster(store)
    assert [p.name for p in cluster.state.policies] == ["default-deny"]
    assert "skipping NetworkPolicy x/broken" in caplog.text


# == etcd ======================================================================================


@pytest.mark.etcd
def test_explain_on_etcd(ctl: Ctl, etcd1: Any) -> None:
    from datastore.etcd.store import EtcdStore

    prefix = f"/test-{uuid.uuid4().hex[:12]}"
    store = EtcdStore(etcd1.endpoints, prefix=prefix, lock_timeout=5, lock_dir=str(ctl.tmp))
    try:
        populate(store, DENY_INGRESS_X, ALLOW_HTTP)
    finally:
        store.close()
    ctl.flags = [
        "--datastore-type",
        "etcdv3",
        "--etcd-endpoints",
        ",".join(etcd1.endpoints),
        "--etcd-prefix",
        prefix,
    ]
    data = ctl.json("x/a", "--from", "x/b", "--port", "http")
    assert data["policies"]["ingress"] == ["x/allow-http", "x/default-deny"]
    assert data["traffic"]["allowed"] is True
    assert ctl.json("x/a", "--from", "x/b", "--port", "81")["traffic"]["allowed"] is False


# == host endpoints ==============================================================================

HEP = {
    "apiVersion": "projectcalico.org/v3",
    "kind": "HostEndpoint",
    "metadata": {"name": "node-a-eth0", "labels": {"role": "node"}},
    "spec": {"node": "node-a", "interfaceName": "eth0", "expectedIPs": ["192.168.5.1"]},
}
HOST_DENY_ALL = {
    "apiVersion": "projectcalico.org/v3",
    "kind": "GlobalNetworkPolicy",
    "metadata": {"name": "host-deny-all"},
    "spec": {
        "selector": "role == 'node'",
        "types": ["Ingress", "Egress"],
        "ingress": [{"action": "Deny"}],
        "egress": [{"action": "Deny"}],
    },
}


def test_explain_host(ctl: Ctl) -> None:
    """A deny-all host-endpoint policy: SSH to the node passes by its failsafe port, 8080
    is denied by the policy's rule; a pod to its node is not the host endpoint's."""
    ctl.apply(HEP, HOST_DENY_ALL)

    def host(*args: str) -> Any:
        result = ctl.run("policy", "explain-host", "node-a", *args, "-o", "json")
        assert result.exit_code == 0, (result.stdout, result.stderr)
        return json.loads(result.stdout)

    ssh = host("--from", "192.168.5.9", "--port", "22/TCP", "--in-interface", "eth0")
    assert ssh["allowed"]
    assert "failsafe port tcp:22" in ssh["host"][-1]["reason"]
    web = host("--from", "192.168.5.9", "--port", "8080")
    assert not web["allowed"]
    assert web["host"][-1]["reason"] == "ingress: by default/host-deny-all ingress[0] (Deny)"
    assert web["host"][-1]["pod"] == "host endpoint node-a-eth0 (eth0)"
    out = host("--to", "192.168.5.9", "--port", "443")
    assert not out["allowed"]
    assert out["host"][-1]["direction"] == "egress"
    lines = ctl.run("policy", "explain-host", "node-a", "--from", "192.168.5.9", "--port", "8080")
    assert lines.exit_code == 0
    assert "DENIED" in lines.stdout.splitlines()[0]
    result = ctl.run("policy", "explain-host", "node-a")
    assert result.exit_code == 1
    assert "give --from, --to, or both" in result.stderr
