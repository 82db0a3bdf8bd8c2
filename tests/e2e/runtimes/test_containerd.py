"""containerd 1.6's CRI plugin drives the plugins the way a kubelet node does: RunPodSandbox for
two pods that then reach each other, StopPodSandbox and RemovePodSandbox (DEL twice, the second
time without a netns), and a failing ADD whose CNI error surfaces in the CRI error.

containerd runs inside the throwaway node on its own root, state, socket and CNI dirs, started
and stopped by PID; the CRI client is generated from tests/e2e/tools/cri/cri_v1.proto."""

from __future__ import annotations

import shutil
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from .harness import (
    TOOLS_BIN,
    CniTool,
    Containerd,
    Flavor,
    Node,
    in_pools,
    mounts_under,
    unique,
)

pytestmark = pytest.mark.e2e

NET = "k8s-pod-network"


@pytest.fixture(scope="module")
def containerd(
    node: Node, flavor: Flavor, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Containerd]:
    base = tmp_path_factory.mktemp("containerd")
    image_ref = (TOOLS_BIN / "image-ref").read_text().strip()
    ctd = Containerd(node, base, flavor, image_ref)
    try:
        ctd.start()
        yield ctd
    finally:
        problems = ctd.stop()
        if not mounts_under(base):
            shutil.rmtree(base / "root", ignore_errors=True)
        assert not problems, f"containerd left things behind: {problems}\n{ctd.log_tail()}"


@pytest.fixture
def network(
    containerd: Containerd, workdir: Path, flavor: Flavor, plugin_log: Path
) -> Iterator[Path]:
    """Install the IPv4 example (private store) as containerd's network; yields the store dir.
    After the test: no pod may remain."""
    containerd.install_network(
        flavor.conflist("ipv4", data_dir=workdir / "ipam", log_dir=workdir / "log")
    )
    yield workdir / "ipam"
    left = containerd.list_pods()
    for pod in left:
        containerd.stop_pod(pod.id)
        containerd.remove_pod(pod.id)
    assert not left, f"test left pods: {[p.metadata.name for p in left]}"


def test_two_pods_reach_each_other_and_teardown_releases(
    containerd: Containerd, network: Path, node: Node, flavor: Flavor
) -> None:
    names = [unique("e2e-a-"), unique("e2e-b-")]
    pods = [containerd.run_pod(name) for name in names]
    ips = [containerd.pod_ips(pod) for pod in pods]
    netns = [containerd.pod_netns(pod) for pod in pods]
    for pod_ips in ips:
        assert len(pod_ips) == 1, pod_ips
        assert in_pools(pod_ips[0]), pod_ips
    assert ips[0] != ips[1]
    node.ping(ips[1][0], from_pod=netns[0])
    node.ping(ips[0][0], from_pod=netns[1])
    for pod, name in zip(pods, names, strict=True):
        assert flavor.store_mentions(network, [pod, name]), f"{name} not in the store"
        assert [c.command for c in containerd.cni_calls(pod)] == ["ADD"]

    for pod, name, ns in zip(pods, names, netns, strict=True):
        containerd.stop_pod(pod)
        assert flavor.store_mentions(network, [pod, name]) == [], f"{name} still allocated"
        containerd.remove_pod(pod)
        calls = containerd.cni_calls(pod)
        assert [(c.command, c.netns) for c in calls] == [("ADD", ns), ("DEL", ns), ("DEL", "")]
        assert all(f"K8S_POD_NAME={name}" in c.args for c in calls)
    assert containerd.list_pods() == []


def test_failing_add_surfaces_plugin_error(
    containerd: Containerd,
    workdir: Path,
    node: Node,
    flavor: Flavor,
    cni: CniTool,
    pod_netns: Callable[[], tuple[str, str]],
) -> None:
    import grpc

    conf = flavor.conflist("ipv4", data_dir=workdir / "ipam", log_dir=workdir / "log", tiny=True)
    containerd.install_network(conf)
    started: list[str] = []
    failure: grpc.RpcError | None = None
    name = ""
    for _ in range(6):
        name = unique("e2e-fill-")
        try:
            started.append(containerd.run_pod(name))
        except grpc.RpcError as exc:
            failure = exc
            break
    try:
        assert failure is not None, "the tiny pool never ran out"
        assert len(started) >= 2, "the tiny pool should hold at least two pods"
        details = failure.details() or ""
        failed = [
            c
            for c in containerd.cni_calls()
            if c.container_id not in started and f"K8S_POD_NAME={name};" in c.args + ";"
        ]
        # containerd DELs the attachment of every failed ADD.
        assert [c.command for c in failed] == ["ADD", "DEL"], failed
        failed_id = failed[0].container_id

        # The same ADD through libcni shows the plugin's own error; containerd must pass it on.
        cni.install(conf)
        _, path = pod_netns()
        probe_id = unique("e2e-probe-")
        reply = cni(
            "add",
            NET,
            path,
            container_id=probe_id,
            cni_args={"K8S_POD_NAMESPACE": "e2e", "K8S_POD_NAME": name, "IgnoreUnknown": "1"},
        )
        err = reply.error()
        if flavor.name == "tabby":
            assert err["code"] == 100, err
        else:
            assert "no IP addresses available" in err["msg"], err
        expected = err["msg"].replace(probe_id, "<id>")
        assert expected in details.replace(failed_id, "<id>"), (
            f"CRI error does not carry the plugin's message:\n  plugin: {err['msg']}\n"
            f"  CRI:    {details}"
        )
        assert flavor.store_mentions(workdir / "ipam", [failed_id]) == []
    finally:
        for pod in started:
            containerd.stop_pod(pod)
            containerd.remove_pod(pod)
    assert containerd.list_pods() == []
    assert flavor.store_mentions(workdir / "ipam", started) == []
