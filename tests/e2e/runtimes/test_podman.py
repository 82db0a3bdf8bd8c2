"""podman (CNI backend) runs containers on the chained example network (tabby, portmap,
tuning): two containers reach each other, a published port on 127.0.0.1 reaches one of them,
and `podman rm` leaves no address allocated. podman runs inside the throwaway node with a
private configuration, storage and state (see harness.Podman)."""

from __future__ import annotations

import shutil
from collections.abc import Iterator

import pytest

from .harness import (
    TOOLS_BIN,
    Flavor,
    Node,
    Podman,
    in_pools,
    kill_pid,
    mounts_under,
    unique,
    unmount_under,
    wait_for,
)

pytestmark = pytest.mark.e2e

NET = "k8s-pod-network"
HOST_PORT = 18081


@pytest.fixture(scope="module")
def podman_env(
    node: Node, flavor: Flavor, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Podman]:
    base = tmp_path_factory.mktemp("podman")
    pm = Podman(node, base, flavor.plugin_dirs)
    conf = flavor.conflist("chained", data_dir=base / "ipam", log_dir=base)
    pm.install_network(conf)
    pm.import_image(TOOLS_BIN / "rootfs.tar")
    # podman keeps a network only if every plugin in it answers VERSION.
    assert NET in pm("network", "ls", "--format", "{{.Name}}").stdout.split()
    try:
        yield pm
    finally:
        pm.remove_all()
        problems = []
        if ids := pm.container_ids():
            problems.append(f"containers: {ids}")
        for pid in pm.leftover_processes():
            problems.append(f"process {pid}")
            kill_pid(pid)
        if mounts := unmount_under(base):
            problems.append(f"mounts: {mounts}")
        if not mounts_under(base):
            shutil.rmtree(base / "root", ignore_errors=True)
        assert not problems, f"podman left things behind: {problems}"


@pytest.fixture
def podman(podman_env: Podman, node: Node, flavor: Flavor) -> Iterator[Podman]:
    yield podman_env
    podman_env.remove_all()
    node.remove_cni_chains()
    if flavor.name == "tabby":
        log = podman_env.base / "cni.log"
        if log.exists():
            print(f"--- last lines of {log} ---")
            print("\n".join(log.read_text(errors="replace").splitlines()[-60:]))


def run_container(pm: Podman, name: str, *args: str) -> str:
    return pm("run", "-d", "--name", name, "--network", NET, *args).stdout.strip()


def test_two_containers_reach_each_other(podman: Podman) -> None:
    a, b = unique("e2e-a-"), unique("e2e-b-")
    run_container(podman, a, "--cap-add", "NET_RAW", podman.IMAGE)
    run_container(podman, b, "--cap-add", "NET_RAW", podman.IMAGE)
    ip_a, ip_b = podman.ip_of(a, NET), podman.ip_of(b, NET)
    assert ip_a != ip_b
    assert in_pools(ip_a)
    assert in_pools(ip_b)
    for src, dst in ((a, ip_b), (b, ip_a)):
        out = podman("exec", src, "ping", "-c", "1", "-W", "2", dst, check=False)
        assert out.returncode == 0, f"{src} -> {dst}: {out.stdout}{out.stderr}"


def test_published_port_on_localhost_reaches_container(podman: Podman, node: Node) -> None:
    web = unique("e2e-web-")
    run_container(
        podman,
        web,
        "-p",
        f"127.0.0.1:{HOST_PORT}:8080",
        podman.IMAGE,
        "httpd",
        "-f",
        "-p",
        "8080",
        "-h",
        "/www",
    )
    reply = wait_for(
        "the published port",
        lambda: node.tcp_get("127.0.0.1", HOST_PORT, b"GET / HTTP/1.0\r\n\r\n").stdout,
        timeout=10,
    )
    assert "200 OK" in reply, reply
    assert "tabby-httpd" in reply, reply
    podman("rm", "--force", "--time", "0", web)
    assert not any(c.startswith("CNI-DN-") for c in node.cni_chains()), node.cni_chains()
    assert node.tcp_get("127.0.0.1", HOST_PORT, b"", timeout=2).returncode != 0


def test_rm_leaves_no_address_allocated(podman: Podman, node: Node, flavor: Flavor) -> None:
    name = unique("e2e-rm-")
    cid = run_container(podman, name, podman.IMAGE)
    ip = podman.ip_of(name, NET)
    data_dir = podman.base / "ipam"
    netns = podman.inspect(name)["NetworkSettings"]["SandboxKey"]
    assert flavor.store_mentions(data_dir, [cid, name]), "allocation not found in the store"
    cache = node.run(["ls", "/var/lib/cni/results"]).stdout.split()
    assert f"{NET}-{cid}-eth0" in cache

    podman("rm", "--force", "--time", "0", name)
    assert flavor.store_mentions(data_dir, [cid, name]) == []
    assert f"{NET}-{cid}-eth0" not in node.run(["ls", "/var/lib/cni/results"]).stdout.split()
    assert netns.rsplit("/", 1)[-1] not in node.netns_list()
    # The address is free again: the next container may get it, and nothing else holds it.
    assert not any(ip in line for line in node.pod_routes()), node.pod_routes()
