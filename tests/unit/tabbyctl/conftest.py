"""tabbyctl on the Kubernetes datastore: the in-memory API server (tests/kube_fake.py) with a
kubeconfig file pointing at it, a conflist naming it (``datastore_type: kubernetes``), fake
host veths, and a CliRunner. A small cluster is made through the API as Kubernetes and
tabby-node would make it: v1 Nodes (Ready, labelled), tabby Nodes, Namespaces, Pods, a
NetworkPolicy, and each pod's allocation as tabby-ipam records it (its pod, node, container,
interface, host interface, netns): the WorkloadEndpoints are made of those."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner, Result

import dataplane
from bundle.types import JSON
from dataplane import HostVeth, host_veth_name
from ipam.core import AssignRequest, Ipam, PoolSpec, handle_id
from stores.kube import kinds
from stores.kube.client import KubeClient, KubeConfig
from stores.kube.store import KubeStore
from tabbyctl.cli import cli
from tests.kube_fake import FakeApi, fake_api, namespace, pod, policy, ready_node, write_kubeconfig

NET = "k8s-pod-network"
POOL = "10.244.0.0/16"
NODES = "/api/v1/nodes"
PODS = "/api/v1/pods"
NAMESPACES = "/api/v1/namespaces"
POLICIES = "/apis/networking.k8s.io/v1/networkpolicies"


class Kdd:
    """The fake API server, tabbyctl's conflist and kubeconfig for it, a store on it."""

    def __init__(
        self, fake: FakeApi, url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        from cni_config.resolve import SOURCES

        for _flag, var in SOURCES.values():
            monkeypatch.delenv(var, raising=False)
        self.fake = fake
        self.url = url
        self.tmp = tmp_path
        self.run_dir = tmp_path / "run"
        self.kubeconfig = write_kubeconfig(str(tmp_path / "kubeconfig"), url)
        self.conf = tmp_path / "10-tabby.conflist"
        self.netns_dir = tmp_path / "netns"
        self.netns_dir.mkdir()
        self.veths: list[HostVeth] = []
        monkeypatch.setattr(dataplane, "list_host_veths", self._list_host_veths)
        self.write_conf()
        self.store = KubeStore(
            KubeClient(KubeConfig(server=url)), lock_timeout=5, lock_dir=str(tmp_path / "locks")
        )

    def _list_host_veths(self, prefix: str) -> list[HostVeth]:
        return [v for v in self.veths if v.name.startswith(prefix)]

    def write_conf(self, node: str = "node-1") -> None:
        doc = {
            "cniVersion": "1.0.0",
            "name": NET,
            "plugins": [
                {
                    "type": "tabby",
                    "nodename": node,
                    "ipam": {
                        "type": "tabby-ipam",
                        "datastore_type": "kubernetes",
                        "kubeconfig": self.kubeconfig,
                        "ipv4_pools": [POOL],
                        "lock_timeout_seconds": 5,
                    },
                }
            ],
        }
        self.conf.write_text(json.dumps(doc))

    # -- the cluster, as Kubernetes and tabby make it ---------------------------------------------

    def node(self, name: str, labels: dict[str, str], address: str, ready: bool = True) -> None:
        self.fake.put(NODES, ready_node(name, labels, ready))
        spec = {"backend": "vxlan", "ipv4Address": address}
        self.store.put("node", name, {"metadata": {"name": name}, "spec": spec}, None)

    def pod(
        self,
        ns: str,
        name: str,
        labels: dict[str, str],
        node: str,
        *,
        ports: tuple[tuple[str, int], ...] = (),
        veth: bool = True,
        netns: bool = True,
        age: float = 3600.0,
    ) -> str:
        """The pod in the API and its attachment as tabby-ipam records it (its address)."""
        cid = f"{ns}-{name}"
        Ipam(self.store, "").ensure_pools([PoolSpec(POOL, 26)])
        host = host_veth_name("cali", NET, cid, "eth0")
        path = self.netns_dir / cid
        if netns:
            path.touch()
        attrs: dict[str, Any] = {
            "node": node,
            "network": NET,
            "container_id": cid,
            "ifname": "eth0",
            "pod_namespace": ns,
            "pod_name": name,
            "pod_uid": f"uid-{cid}",
            "netns": str(path),
            "host_interface": host,
            "time": time.time() - age,
        }
        (got,) = Ipam(self.store, node).assign(
            AssignRequest(handle_id(NET, cid, "eth0"), attrs, v4_pools=[POOL])
        )
        ip = str(got.ip)
        obj = pod(ns, name, labels, node=node, ips=(ip,), ports=ports)
        obj["metadata"]["uid"] = f"uid-{cid}"
        self.fake.put(PODS, obj)
        if veth and node == "node-1":
            import ipaddress

            net = ipaddress.ip_network(f"{ip}/32")
            self.veths.append(HostVeth(host, 100 + len(self.veths), True, f"tabby:{cid}", (net,)))
        return ip

    def cluster(self) -> dict[str, str]:
        """Two nodes, namespaces x and y, pods x/a (node-1), x/b (node-2), y/c (node-1), and
        x's policy a-from-b: x/a only from pods labelled pod=b on TCP 80."""
        self.node("node-1", {"zone": "a"}, "192.168.7.1/24")
        self.node("node-2", {"zone": "b"}, "192.168.7.2/24")
        self.fake.put(NAMESPACES, namespace("x", {"team": "x"}))
        self.fake.put(NAMESPACES, namespace("y", {"team": "y"}))
        ips = {
            "x/a": self.pod("x", "a", {"pod": "a"}, "node-1", ports=(("http", 80),)),
            "x/b": self.pod("x", "b", {"pod": "b"}, "node-2"),
            "y/c": self.pod("y", "c", {"pod": "c"}, "node-1"),
        }
        rule = {"from": [{"podSelector": {"matchLabels": {"pod": "b"}}}], "ports": [{"port": 80}]}
        spec: JSON = {"podSelector": {"matchLabels": {"pod": "a"}}, "ingress": [rule]}
        self.fake.put(POLICIES, policy("x", "a-from-b", spec))
        return ips

    # -- what the API server holds ----------------------------------------------------------------

    def objects(self, kind: str) -> dict[str, JSON]:
        """tabby's objects of ``kind`` as kubectl sees them (``kubectl get ippools.tabby.io``)."""
        return dict(self.fake.objects[kinds.CRDS[kind].path])

    def writes(self, since: int = 0) -> list[str]:
        return [r for r in self.fake.requests[since:] if r.split()[0] in ("POST", "PUT", "DELETE")]

    # -- running tabbyctl -------------------------------------------------------------------------

    def run(self, *args: str, conf: bool = True, stdin: str | None = None) -> Result:
        argv = (["--conf", str(self.conf)] if conf else []) + list(args)
        result = CliRunner().invoke(cli, argv, prog_name="tabbyctl", input=stdin)
        assert "Traceback" not in result.output, result.output
        if result.exception is not None:
            assert isinstance(result.exception, SystemExit), repr(result.exception)
        return result

    def json(self, *args: str) -> Any:
        result = self.run(*args, "-o", "json")
        assert result.exit_code in (0, 1), result.output
        return json.loads(result.stdout)

    def close(self) -> None:
        self.store.close()


@pytest.fixture
def kdd(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Kdd]:
    with fake_api() as (fake, url):
        made = Kdd(fake, url, tmp_path, monkeypatch)
        yield made
        made.close()
