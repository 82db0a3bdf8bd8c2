"""tabby installed the Kubernetes way (docs/kubernetes.md "Installing on Kubernetes"), per
cluster of ``CLUSTERS`` (a backend and a datastore: the manifest as shipped, the Kubernetes
datastore, and etcd mode by its ConfigMap's one change), on a fresh 3-node Kubernetes whose
lab installs no network (lab.kubernetes.cluster.KubeLab with ``install_cni=False``;
lab.kubernetes.manifest does what docs/kubernetes.md tells an operator):

* the manifest passes the API server's validation and admission (server-side dry run, RBAC
  on); the nodes are NotReady: no network;
* the image imported into every node's containerd, ``kubectl apply`` of the manifest (as
  shipped, or with the ConfigMap set to the lab's etcd): the nodes turn Ready, tabby-node is
  ready everywhere, the controllers elect a leader; each node got its files (the bundle under
  /opt/tabby/bundles, the links, the conflist, its name, the plugins' kubeconfig) and the
  BIRD tabby-node runs has the image's environment, not the bundle's library path;
* as shipped, nothing of tabby is in etcd: its state is the API's (pools, blocks, Nodes);
* the API server refuses what ``tabbyctl apply`` refuses, naming the field
  (tests/crd_cases.py's table; ``kubectl apply`` of a pool of ``10.0.0.0/33`` fails on
  ``spec.cidr``), and takes what it takes;
* a Deployment's pods across the nodes reach each other; a NetworkPolicy applied with
  kubectl is enforced;
* every service account is allowed exactly what its roles grant (tests/rbac.py reads them
  from the manifest) and denied what no component needs; tabbyctl in a tabby-node pod reads
  another node's policy log with the pod's own token, and is refused without it;
* a rolling update of the DaemonSet to another image (another bundle: a real install on
  every node) while ICMP streams at 50 packets/s run between pods on different nodes, in a
  ring that crosses every node: no packet lost; a pod created while a node's tabby-node is
  being replaced is networked;
* ``kubectl delete -f`` removes tabby; every tabby-node sees an uninstall (a rolling update
  is not one: nothing is removed) and removes its conflist and nftables table: the nodes
  turn NotReady, a pod created afterwards stays Pending (network not ready); running pods
  keep their interfaces and routes and reach each other.

The tests of one cluster run in this order on it, the last one leaves it without tabby; then
the cluster is torn down (nothing may be left on the machine). The numbers (image import,
install to Ready, rollout, packets) are printed (``-s``).
"""

from __future__ import annotations

import base64
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from lab.kubernetes import build
from lab.kubernetes import node as knode
from lab.kubernetes.cluster import HTTPD, KubeLab, KubePod, processes
from lab.kubernetes.manifest import NAMESPACE, TYPHA_LABEL, ManifestInstall
from tabbyctl.demo.proc import LabError
from tests import REPO_ROOT as REPO
from tests import crd_cases, packaging_image, rbac
from tests.kubernetes.helpers import eventually
from tests.kubernetes.icmp import Stream

pytestmark = pytest.mark.kubernetes

IMAGE = packaging_image.load()
WEB_NS = "mf-web"
RATE = 50.0  # packets per second, per stream
#: (backend, datastore) of each cluster: the manifest as shipped, and etcd mode
CLUSTERS = [("bird", "kubernetes"), ("vxlan", "etcdv3")]


@dataclass
class Images:
    first: Path
    upgrade: Path
    seconds: float


@pytest.fixture(scope="module")
def images(tmp_path_factory: pytest.TempPathFactory) -> Images:
    """The image to install (``TABBY_IMAGE_ARCHIVE``, else built from the bundle the
    installed tabbyctl runs from, or ``TABBY_BUNDLE_DIR``) and the upgrade: the same bundle
    with one file more (so another bundle id, a real install on every node), tagged
    ``<version>-upgrade``."""
    if os.geteuid() != 0:
        pytest.fail("the Kubernetes tier needs root")
    if build.find_binaries() is None:
        pytest.fail("Kubernetes is not built: python -m lab.kubernetes.build (tests/run.sh does)")
    found = shutil.which("tabbyctl")
    default = os.path.dirname(os.path.realpath(found)) if found else "/opt/tabby"
    bundle = Path(os.environ.get("TABBY_BUNDLE_DIR") or default)
    if not os.access(bundle / "tabby", os.X_OK):
        pytest.fail(f"no bundle in {bundle}: ./build.sh --no-demo (or set TABBY_BUNDLE_DIR)")
    work = tmp_path_factory.mktemp("images")
    cache = Path(IMAGE.DEFAULT_CACHE)
    started = time.monotonic()
    given = os.environ.get("TABBY_IMAGE_ARCHIVE")
    if given:
        first = Path(given)
    else:
        out = work / "tabby.oci.tar"
        first = IMAGE.build_image(bundle, out, IMAGE.DEFAULT_NAME, None, cache).archive
    changed = work / "bundle-upgrade"
    shutil.copytree(bundle, changed, symlinks=True)
    (changed / "_internal" / "UPGRADE-TEST").write_text("another bundle, the same programs\n")
    version = IMAGE.bundle_version(bundle)
    upgrade = IMAGE.build_image(
        changed, work / "tabby-upgrade.oci.tar", IMAGE.DEFAULT_NAME, f"{version}-upgrade", cache
    ).archive
    shutil.rmtree(changed)
    return Images(first, upgrade, time.monotonic() - started)


def datastore_of(kube: KubeLab) -> str:
    """The datastore the cluster is installed with (and tabbyctl's flags point at)."""
    return kube.datastore


@pytest.fixture(scope="module", params=CLUSTERS, ids=[f"{b}-{d}" for b, d in CLUSTERS])
def bare(request: pytest.FixtureRequest, images: Images) -> Iterator[KubeLab]:
    """A 3-node Kubernetes with no network (nothing installed in /opt/cni/bin but loopback,
    no conflist)."""
    backend, datastore = request.param
    lab = KubeLab(install_cni=False, backend=backend, datastore=datastore)
    try:
        try:
            lab.build()
        except LabError as e:
            pytest.fail(f"the cluster without a network did not come up: {e}")
        print(f"\n[{backend} {datastore}] cluster without a network up: {lab.timings}")
        yield lab
    finally:
        problems = lab.teardown()
        assert not problems, f"the cluster left things behind: {problems}"


_INSTALLS: dict[str, ManifestInstall] = {}


@pytest.fixture
def tabby(bare: KubeLab, images: Images) -> ManifestInstall:
    """tabby installed by the manifest on ``bare`` (once per cluster): the image imported
    on every node, the manifest applied, everything ready."""
    found = _INSTALLS.get(bare.prefix)
    if found is not None:
        return found
    install = ManifestInstall(bare, backend=bare.backend, datastore=datastore_of(bare))
    ref = install.import_image(images.first)
    install.apply(ref)
    install.wait_installed()
    _INSTALLS[bare.prefix] = install
    print(f"\n[{bare.backend}] installed: {install.timings}")
    return install


_WEB: dict[str, list[KubePod]] = {}


@pytest.fixture
def web(bare: KubeLab, tabby: ManifestInstall) -> list[KubePod]:
    """6 busybox httpd pods of one Deployment, 2 per node (made once per cluster)."""
    if bare.prefix not in _WEB:
        bare.kubectl("create", "namespace", WEB_NS)
        bare.apply(bare.web_deployment("web", WEB_NS, 6))
        _WEB[bare.prefix] = bare.wait_pods(WEB_NS, "app=web", 6, timeout=180)
    return _WEB[bare.prefix]


def in_node(kube: KubeLab, node: str, *argv: str) -> str:
    proc = kube.run_on(node, list(argv))
    assert proc.returncode == 0, f"{node}: {argv}: {proc.stderr}"
    return str(proc.stdout)


def node_files(kube: KubeLab, node: str) -> dict[str, str]:
    """What the install put on a node's filesystem (links as their targets)."""
    kn = kube.kube_node(node)
    out: dict[str, str] = {}
    for link in ("/opt/tabby/current", "/opt/cni/bin/tabby", "/opt/cni/bin/tabby-ipam"):
        try:
            out[link] = os.readlink(kn.path(link))
        except OSError:
            out[link] = ""
    for path in (
        "/var/lib/tabby/nodename",
        "/etc/cni/net.d/10-tabby.conflist",
        "/etc/cni/net.d/tabby-kubeconfig",
    ):
        out[path] = kn.read(path)
    try:
        out["bundles"] = " ".join(sorted(os.listdir(kn.path("/opt/tabby/bundles"))))
    except OSError:
        out["bundles"] = ""
    return out


def bird_process(kube: KubeLab, node: str) -> tuple[int, dict[str, str]]:
    """The BIRD on a node (its PID on the machine, its environment)."""
    kn = kube.kube_node(node)
    netns = os.readlink(f"/proc/{kn.pid}/ns/net")
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            if Path(f"/proc/{entry}/comm").read_text().strip() != "bird":
                continue
            if os.readlink(f"/proc/{entry}/ns/net") != netns:
                continue
            raw = Path(f"/proc/{entry}/environ").read_bytes()
        except OSError:
            continue
        env = dict(v.split("=", 1) for v in raw.decode(errors="replace").split("\0") if "=" in v)
        return int(entry), env
    raise AssertionError(f"no BIRD runs on {node}")


def node_status(kube: KubeLab, node: str) -> dict[str, Any]:
    """``tabbyctl node status -o json`` in the node's tabby-node container."""
    pod = tabby_pod(kube, node)
    proc = kube.kubectl(
        "exec", "-n", NAMESPACE, pod, "-c", "tabby-node", "--", "tabbyctl", "node", "status",
        "-o", "json", check=False,
    )  # fmt: skip
    assert proc.stdout, proc.stderr
    return dict(json.loads(proc.stdout))


def peered(kube: KubeLab, node: str) -> None:
    """``node``'s BIRD in session with both other nodes: soon, not at once (a node ready
    with one peer adds the third when it registers; that session starts Passive)."""

    def both() -> bool:
        states = sorted(p["state"] for p in node_status(kube, node)["peers"])
        assert states == ["Established"] * 2, states
        return True

    eventually(f"{node} peered with both other nodes", both, timeout=60)


def tabby_pod(kube: KubeLab, node: str) -> str:
    install = _INSTALLS[kube.prefix]
    return str(install.node_pods()[node]["metadata"]["name"])


def has_table(kube: KubeLab, node: str) -> bool:
    """Whether tabby-node's nftables table ``inet tabby`` is on ``node``."""
    return kube.run_on(node, ["nft", "list", "table", "inet", "tabby"]).returncode == 0


class NodeLog:
    """``kubectl logs -f`` of one tabby-node container from now to its end (its last lines
    say what its stop was: an uninstall or not)."""

    def __init__(self, kube: KubeLab, pod: str) -> None:
        argv = [
            *("nsenter", f"--net=/run/netns/{kube.nodes[0].netns}", "--"),
            *kube.kubectl_argv(),
            *("logs", "-f", "-n", NAMESPACE, pod, "-c", "tabby-node", "--tail", "1"),
        ]
        self.proc = subprocess.Popen(
            argv,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env=knode.frozen_env(),
        )

    def text(self, timeout: float = 60) -> str:
        """What it wrote until the container ended (stopped after ``timeout``)."""
        try:
            out, _ = self.proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            out, _ = self.proc.communicate()
        return str(out)

    @staticmethod
    def cut(text: str) -> bool:
        """Whether the stream ended before the container's last lines: the kubelet removed
        the container of a deleted pod first (``kubectl logs -f`` then ends with an error)."""
        return "rpc error" in text[-600:] or "tabby-node stopped after" not in text


def one_per_node(pods: list[KubePod]) -> dict[str, KubePod]:
    out: dict[str, KubePod] = {}
    for p in sorted(pods, key=lambda p: p.name):
        out.setdefault(p.node, p)
    return out


# == install ======================================================================================


def test_the_manifest_is_valid_and_the_nodes_wait_for_a_network(bare: KubeLab) -> None:
    """The API server (RBAC on) validates and admits every object (server-side dry run:
    nothing kept); until tabby is installed no node is Ready, for want of a network."""
    install = ManifestInstall(bare, backend=bare.backend, datastore=datastore_of(bare))
    bare.kubectl("create", "namespace", NAMESPACE)  # a dry run cannot create it for the rest
    out = install.dry_run()
    for what in (
        "customresourcedefinition.apiextensions.k8s.io/ippools.tabby.io",
        "customresourcedefinition.apiextensions.k8s.io/policytraces.tabby.io",
        "serviceaccount/tabby-node",
        "serviceaccount/tabby-cni",
        "secret/tabby-cni-token",
        "clusterrole.rbac.authorization.k8s.io/tabby-node",
        "clusterrole.rbac.authorization.k8s.io/tabby-kube-controllers",
        "clusterrole.rbac.authorization.k8s.io/tabby-cni",
        "configmap/tabby-config",
        "daemonset.apps/tabby-node",
        "deployment.apps/tabby-kube-controllers",
        "serviceaccount/tabby-typha",
        "clusterrole.rbac.authorization.k8s.io/tabby-typha",
        "role.rbac.authorization.k8s.io/tabby-kube-controllers-typha-certs",
        "deployment.apps/tabby-typha",
        "service/tabby-typha",
        "poddisruptionbudget.policy/tabby-typha",
    ):
        assert f"{what} created (server dry run)" in out, out
    assert bare.kubectl("get", "daemonset", "-n", NAMESPACE, "-o", "name").stdout == ""
    conditions = bare.node_conditions()
    assert sorted(conditions) == ["node-1", "node-2", "node-3"]
    assert all(c.get("Ready") != "True" for c in conditions.values()), conditions
    node = bare.kubectl_json("get", "node", "node-1")
    ready = next(c for c in node["status"]["conditions"] if c["type"] == "Ready")
    assert "network" in ready["message"].lower(), ready
    assert node_files(bare, "node-1")["/etc/cni/net.d/10-tabby.conflist"] == ""


def test_kubectl_apply_installs_tabby_on_every_node(bare: KubeLab, tabby: ManifestInstall) -> None:
    assert bare.nodes_ready()
    assert tabby.lease_holder().startswith("tabby-kube-controllers-")
    for node in bare.kube:
        files = node_files(bare, node)
        assert files["/var/lib/tabby/nodename"] == f"{node}\n"
        current = files["/opt/tabby/current"]
        assert current.startswith("bundles/0.")
        assert files["bundles"] == current.removeprefix("bundles/")
        for name in ("tabby", "tabby-ipam"):
            assert files[f"/opt/cni/bin/{name}"] == "/opt/tabby/current/tabby"
        conflist = json.loads(files["/etc/cni/net.d/10-tabby.conflist"])
        ipam = conflist["plugins"][0]["ipam"]
        assert ipam["datastore_type"] == datastore_of(bare)
        if datastore_of(bare) == "kubernetes":
            assert ipam["kubeconfig"] == "/etc/cni/net.d/tabby-kubeconfig"
            assert not [k for k in ipam if k.startswith("etcd_")]
            kubeconfig = json.loads(files["/etc/cni/net.d/tabby-kubeconfig"])
            assert kubeconfig["users"][0]["user"]["token"]  # tabby-cni's
            mode = os.stat(bare.kube_node(node).path("/etc/cni/net.d/tabby-kubeconfig")).st_mode
            assert mode & 0o777 == 0o600
        else:
            assert ipam["etcd_endpoints"] == bare.endpoints()
            assert ipam["etcd_prefix"] == bare.etcd_prefix
            assert files["/etc/cni/net.d/tabby-kubeconfig"] == ""
        status = node_status(bare, node)
        assert status["backend"] == bare.backend
        assert status["node"] == node
        if bare.backend == "bird":
            peered(bare, node)
            # the fix of bundle/environ.py where it matters: BIRD started by the frozen
            # tabby-node gets the image's environment, not the bundle's library path
            _, env = bird_process(bare, node)
            assert "LD_LIBRARY_PATH" not in env, env.get("LD_LIBRARY_PATH")
            assert "LD_LIBRARY_PATH_ORIG" not in env
        else:
            assert len(status["vxlan"]) == 2
    # the plugins' token goes to the installer only
    spec = tabby.node_pods()["node-1"]["spec"]
    (init,) = spec["initContainers"]
    assert "cni-token" in {m["name"] for m in init["volumeMounts"]}
    (node_container,) = spec["containers"]
    assert "cni-token" not in {m["name"] for m in node_container["volumeMounts"]}


#: The capabilities the manifest may name, by their bit in /proc/<pid>/status (linux/capability.h).
CAPABILITY_BITS = {
    "CHOWN": 0, "DAC_OVERRIDE": 1, "FOWNER": 3, "KILL": 5, "SETGID": 6, "SETUID": 7,
    "NET_BIND_SERVICE": 10, "NET_ADMIN": 12, "NET_RAW": 13, "SYS_CHROOT": 18,
    "SYS_PTRACE": 19, "SYS_ADMIN": 21,
}  # fmt: skip


def _running(kube: KubeLab, program: str) -> list[int]:
    """The PIDs of ``program`` (argv[0]'s name) running in any node's network namespace."""
    netns = {os.readlink(f"/proc/{kn.pid}/ns/net") for kn in kube.kube.values()}
    found = []
    for pid, argv in processes():
        if not argv or os.path.basename(argv.split()[0]) != program:
            continue
        try:
            if os.readlink(f"/proc/{pid}/ns/net") in netns:
                found.append(pid)
        except OSError:
            continue
    return found


def _process_privileges(pid: int) -> tuple[set[str], int, bool]:
    """A process's effective capabilities (by name, as CAPABILITY_BITS names them; an
    unnamed one as its bit), its effective uid, and whether its root filesystem is
    mounted read-only."""
    status = dict(
        line.split(":", 1) for line in Path(f"/proc/{pid}/status").read_text().splitlines()
    )
    bits = int(status["CapEff"].strip(), 16)
    names = {name for name, bit in CAPABILITY_BITS.items() if bits >> bit & 1}
    names |= {f"bit {b}" for b in range(64) if bits >> b & 1} - {
        f"bit {CAPABILITY_BITS[n]}" for n in names
    }
    uid = int(status["Uid"].split()[1])
    (root,) = [
        line.split()
        for line in Path(f"/proc/{pid}/mountinfo").read_text().splitlines()
        if line.split()[4] == "/"
    ][-1:]
    return names, uid, "ro" in root[5].split(",")


def test_each_container_runs_with_the_privileges_the_manifest_names(
    bare: KubeLab, tabby: ManifestInstall
) -> None:
    """None of tabby's containers is privileged (docs/security.md): tabby-node and the
    BIRD it starts hold exactly the capabilities the manifest adds, tabby-kube-controllers
    none and not as root, every root filesystem read-only; and with that much, the install
    above worked (nodes Ready, BGP sessions up or VXLAN peers, a leader)."""
    import yaml

    docs = {d["metadata"]["name"]: d for d in yaml.safe_load_all(tabby.applied) if d}
    (node_c,) = docs["tabby-node"]["spec"]["template"]["spec"]["containers"]
    assert "privileged" not in node_c["securityContext"]
    wanted = set(node_c["securityContext"]["capabilities"]["add"])
    assert wanted <= set(CAPABILITY_BITS)
    programs = {"tabby-node": len(bare.kube), "tabby-kube-controllers": 2, "tabby-typha": 2}
    if bare.backend == "bird":
        programs["bird"] = len(bare.kube)
    seen = {}
    for program, count in programs.items():
        pids = _running(bare, program)
        assert len(pids) == count, (program, pids)
        for pid in pids:
            caps, uid, read_only = _process_privileges(pid)
            seen[program] = (sorted(caps), uid, read_only)
            assert read_only, f"{program} ({pid}): its root filesystem is writable"
            if program in ("tabby-kube-controllers", "tabby-typha"):
                assert (caps, uid) == (set(), 10001), (program, caps, uid)
            else:
                assert (caps, uid) == (wanted, 0), (program, caps, uid)
    print(f"\n[{bare.backend}] privileges: {seen}")
    # none of them restarted for want of a privilege
    controllers = tabby.pods("app.kubernetes.io/name=tabby-kube-controllers")
    for pod in [*tabby.pods(), *controllers, *tabby.pods(TYPHA_LABEL)]:
        for c in pod["status"].get("containerStatuses", []):
            assert c["restartCount"] == 0, (pod["metadata"]["name"], c["name"], tabby.describe())


def _etcd_keys(kube: KubeLab, prefix: str) -> int:
    """How many keys of the lab's etcd lie under ``prefix`` (its v3 JSON gateway, from
    node-1, where etcd listens)."""
    import base64

    from tabbyctl.demo.lab import http_get

    def b64(text: str) -> str:
        return base64.b64encode(text.encode()).decode()

    end = prefix[:-1] + chr(ord(prefix[-1]) + 1)
    body = json.dumps({"key": b64(prefix), "range_end": b64(end), "count_only": True}).encode()
    code, answer = http_get(kube.nodes[0].netns, f"{kube.endpoints()[0]}/v3/kv/range", body=body)
    assert code == 200, answer[:200]
    return int(json.loads(answer).get("count", 0))


def test_as_shipped_tabby_keeps_nothing_in_etcd(
    bare: KubeLab, tabby: ManifestInstall, web: list[KubePod]
) -> None:
    """The Kubernetes datastore: the pods got their addresses from pools and blocks on the
    API (one block per node at least, the default pool, every tabby Node), and no key of
    tabby's is in etcd (the lab's etcd is Kubernetes' own, which tabby never reaches)."""
    if datastore_of(bare) != "kubernetes":
        pytest.skip("etcd mode: tabby's state is in etcd")
    pools = bare.kubectl_json("get", "ippools.tabby.io")["items"]
    assert [p["spec"]["cidr"] for p in pools] == ["10.244.0.0/16"]
    blocks = bare.kubectl_json("get", "ipamblocks.tabby.io")["items"]
    owners = {b["metadata"]["labels"]["tabby.io/node"] for b in blocks}
    assert owners >= {p.node for p in web}
    tabby_nodes = bare.kubectl_json("get", "nodes.tabby.io")["items"]
    assert sorted(n["metadata"]["name"] for n in tabby_nodes) == sorted(bare.kube)
    for prefix in ("/tabby", bare.etcd_prefix):
        assert _etcd_keys(bare, prefix) == 0, prefix
    shown = tabby.tabbyctl("ipam", "show", "-o", "json")
    assert shown.returncode == 0, shown.stderr
    held = {a["ip"] for a in json.loads(shown.stdout)["allocations"]}
    assert {p.ip for p in web} <= held


def test_the_api_server_refuses_what_tabbyctl_refuses_naming_the_field(
    bare: KubeLab, tabby: ManifestInstall
) -> None:
    """The manifest's CRDs at work: ``kubectl apply`` of a pool of 10.0.0.0/33 fails at the
    API server, naming spec.cidr; then every document of tests/crd_cases.py, sent as they are
    (``--validate=false``: the server's own verdict), refused naming its field or taken."""
    bad = crd_cases.Case("IPPool", {"cidr": "10.0.0.0/33", "blockSize": 26}, name="bad-pool")
    applied = bare.kubectl("apply", "-f", "-", input=json.dumps(bad.document()), check=False)
    assert applied.returncode != 0
    assert "spec.cidr" in applied.stderr, applied.stderr
    assert bare.kubectl("get", "ippools.tabby.io", "bad-pool", check=False).returncode != 0
    wrong = []
    for group, refused in (
        ("REFUSED", True),
        ("STRICTER", True),
        ("ACCEPTED", False),
        ("LAXER", False),
    ):
        for case in getattr(crd_cases, group):
            proc = bare.kubectl(
                "create", "--dry-run=server", "--validate=false", "-f", "-",
                input=json.dumps(case.document()), check=False,
            )  # fmt: skip
            if (proc.returncode != 0) != refused:
                wrong.append(f"{group} {case.label}: {proc.stderr.strip()[:300]}")
            elif refused and api_server_path(case.field) not in proc.stderr:
                wrong.append(f"{group} {case.label}: {case.field} not named: {proc.stderr[:600]}")
    assert wrong == [], "\n".join(wrong)


def api_server_path(field: str) -> str:
    """A field as the API server (1.20) names it in a refusal: an item of a list without its
    index (``spec.ingress[0].action`` is ``spec.ingress.action``)."""
    return re.sub(r"\[\d+\]", "", field)


def test_pods_across_nodes_reach_each_other(bare: KubeLab, web: list[KubePod]) -> None:
    assert sorted({p.node for p in web}) == ["node-1", "node-2", "node-3"]
    assert bare.http_matrix(web) == []


def test_a_network_policy_applied_with_kubectl_is_enforced(
    bare: KubeLab, web: list[KubePod]
) -> None:
    """web pods accept only pods labelled role=client: a client reaches them all, a stranger
    none; deleting the policy opens them again."""
    assert bare.busybox is not None
    clients = []
    for name, role, node in (("client", "client", "node-1"), ("stranger", "stranger", "node-2")):
        bare.apply(
            {
                "apiVersion": "v1",
                "kind": "Pod",
                "metadata": {"name": name, "namespace": WEB_NS, "labels": {"role": role}},
                "spec": {
                    "nodeName": node,
                    "terminationGracePeriodSeconds": 1,
                    "containers": [
                        {
                            "name": "c",
                            "image": bare.busybox.ref,
                            "imagePullPolicy": "Never",
                            "command": ["sleep", "100000"],
                        }
                    ],
                },
            }
        )
    clients = bare.wait_pods(WEB_NS, "role in (client,stranger)", 2)
    client = next(p for p in clients if p.name == "client")
    stranger = next(p for p in clients if p.name == "stranger")
    policy = {
        "apiVersion": "networking.k8s.io/v1",
        "kind": "NetworkPolicy",
        "metadata": {"name": "web-from-clients", "namespace": WEB_NS},
        "spec": {
            "podSelector": {"matchLabels": {"app": "web"}},
            "ingress": [{"from": [{"podSelector": {"matchLabels": {"role": "client"}}}]}],
        },
    }
    addresses = [p.ip for p in web]
    try:
        bare.apply(policy)

        def enforced() -> bool:
            return all(bare.probe_http(client, addresses, 2).values()) and not any(
                bare.probe_http(stranger, addresses, 2).values()
            )

        eventually("the policy enforced on every node", enforced, timeout=30)
    finally:
        bare.kubectl("delete", "networkpolicy", "-n", WEB_NS, "web-from-clients")
    eventually(
        "the web pods open again",
        lambda: all(bare.probe_http(stranger, addresses, 2).values()),
        timeout=30,
    )
    bare.kubectl("delete", "pod", "-n", WEB_NS, "client", "stranger", "--wait=false")


# == typha ========================================================================================

#: a client of the deployed typha, run in a node's network namespace: it connects with the
#: certificate files given, for a few seconds; what it received and its last error (JSON)
_TYPHA_CLIENT = """
import json, sys, threading, time
from fanout.client import ClientTls, TyphaSync
ca, cert, key = (open(p, "rb").read() for p in sys.argv[2:5])
source = TyphaSync([sys.argv[1]], "intruder", ClientTls(ca, cert, key, "tabby-typha"),
                   backoff=(0.2, 0.5))
stop, events = threading.Event(), []
def run():
    for event in source.sync(["pod"], stop):
        events.append(event.type)
thread = threading.Thread(target=run, daemon=True)
thread.start()
deadline = time.monotonic() + 10
while time.monotonic() < deadline and not source.last_error and not events:
    time.sleep(0.1)
stop.set()
thread.join(5)
print(json.dumps({"events": events, "error": source.last_error}))
"""


def typha_pods(tabby: ManifestInstall) -> dict[str, dict[str, Any]]:
    """typha's running pods by node."""
    return {
        p["spec"]["nodeName"]: p
        for p in tabby.pods(TYPHA_LABEL)
        if p.get("spec", {}).get("nodeName") and not p["metadata"].get("deletionTimestamp")
    }


def typha_metrics(kube: KubeLab, pod: dict[str, Any]) -> dict[str, float]:
    """One typha's /metrics (on its node's address: host network), sample -> value."""
    from tabbyctl.demo.lab import http_get

    url = f"http://{pod['status']['podIP']}:9093/metrics"
    code, body = http_get(kube.nodes[0].netns, url)
    assert code == 200, (url, code, body[:200])
    out: dict[str, float] = {}
    for line in body.decode().splitlines():
        if line.startswith("tabby_typha_"):
            name, _, value = line.rpartition(" ")
            out[name] = float(value)
    return out


def _arrivals(metrics: dict[str, float]) -> float:
    """Clients a typha took in: each with a snapshot, a resume or a resync."""
    names = (
        "tabby_typha_snapshots_total",
        "tabby_typha_resumes_total",
        "tabby_typha_resyncs_total",
    )
    return sum(metrics.get(n, 0.0) for n in names)


def _kill(kube: KubeLab, program: str, node: str) -> int:
    """SIGKILL of ``program`` on ``node`` (the kubelet restarts its container); its PID."""
    netns = os.readlink(f"/proc/{kube.kube_node(node).pid}/ns/net")
    for pid in _running(kube, program):
        if os.readlink(f"/proc/{pid}/ns/net") == netns:
            os.kill(pid, signal.SIGKILL)
            return pid
    raise AssertionError(f"no {program} on {node}")


class Takeover:
    """The survivor's /metrics read every 0.2 s from the kill on (a thread): the seconds
    until it had taken in as many clients as the killed replica held."""

    def __init__(self, kube: KubeLab, pod: dict[str, Any], base: float, wanted: float) -> None:
        self.kube, self.pod, self.base, self.wanted = kube, pod, base, wanted
        self.started = time.monotonic()
        self.seconds: float | None = None
        self.done = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        while not self.done.wait(0.2) and time.monotonic() - self.started < 120:
            try:
                moved = _arrivals(typha_metrics(self.kube, self.pod)) - self.base
            except AssertionError:
                continue
            if moved >= self.wanted:
                self.seconds = time.monotonic() - self.started
                return

    def stop(self) -> None:
        self.done.set()
        self.thread.join(5)


def test_churn_while_a_typha_and_a_tabby_node_are_killed(
    bare: KubeLab, tabby: ManifestInstall, web: list[KubePod], tmp_path: Path
) -> None:
    """Every tabby-node reads the cluster from typha (the manifest's default): pods created
    and deleted and a NetworkPolicy applied and changed while the typha holding most nodes
    and the tabby-node of another node are SIGKILLed; afterwards every pod reaches every
    other (routes on every node), the policy is enforced on every node as last changed, and
    typha's metrics show the clients that were on the killed replica taken in by the other.
    A client of the deployed typha with a certificate of the cluster's CA but another CN is
    refused (PERMISSION_DENIED, counted); one whose certificate is of another CA fails the
    handshake (UNAVAILABLE), counted as a handshake refused once it settled (10 s).
    Printed: the seconds from the typha's kill until the survivor had taken in as many
    clients as it held, and how (snapshots, resumes, resyncs by digests)."""
    from kube_controllers import typha_certs

    assert bare.busybox is not None
    typhas = typha_pods(tabby)
    assert len(typhas) == 2, tabby.describe()
    before = {node: typha_metrics(bare, pod) for node, pod in typhas.items()}
    held = {node: m["tabby_typha_connections"] for node, m in before.items()}
    assert sum(held.values()) == len(bare.kube), held  # every tabby-node on a typha
    victim = max(held, key=lambda n: held[n])
    (survivor,) = [n for n in typhas if n != victim]
    node_victim = next(n for n in sorted(bare.kube) if n != victim)
    print(f"\n[{bare.backend}] typha connections before: {held}")
    # the churn: pods on every node, a policy that keeps strangers from them
    churn = bare.web_deployment("churn", WEB_NS, 3)
    policy = {
        "apiVersion": "networking.k8s.io/v1",
        "kind": "NetworkPolicy",
        "metadata": {"name": "churn-from-friends", "namespace": WEB_NS},
        "spec": {
            "podSelector": {"matchLabels": {"app": "churn"}},
            "ingress": [
                {
                    "from": [
                        {"podSelector": {"matchLabels": {"role": "friend"}}},
                        {"podSelector": {"matchLabels": {"app": "web"}}},
                    ]
                }
            ],
        },
    }
    friend = {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": "friend", "namespace": WEB_NS, "labels": {"role": "friend"}},
        "spec": {
            "nodeName": node_victim,
            "terminationGracePeriodSeconds": 1,
            "containers": [
                {"name": "c", "image": bare.busybox.ref, "imagePullPolicy": "Never",
                 "command": ["sleep", "100000"]}
            ],
        },
    }  # fmt: skip
    started = time.monotonic()
    takeover: Takeover | None = None
    try:
        bare.apply(churn)
        _kill(bare, "tabby-typha", victim)
        takeover = Takeover(bare, typhas[survivor], _arrivals(before[survivor]), held[victim])
        bare.apply(policy)
        _kill(bare, "tabby-node", node_victim)
        bare.apply(friend)
        # the policy changed while both come back: the web pods no longer let in
        policy["spec"]["ingress"][0]["from"].pop()
        bare.apply(policy)
        bare.kubectl("delete", "pods", "-n", WEB_NS, "-l", "app=churn", "--wait=false")
        steps = {"churn applied": time.monotonic() - started}
        pods = bare.wait_pods(WEB_NS, "app=churn", 3, timeout=180)
        steps["churn pods running"] = time.monotonic() - started
        (friend_pod,) = bare.wait_pods(WEB_NS, "role=friend", 1, timeout=120)
        steps["friend running"] = time.monotonic() - started
        tabby.wait_installed()
        steps["all ready again"] = time.monotonic() - started
        print(f"\n[{bare.backend}] churn, seconds from its start: "
              f"{ {k: round(v, 1) for k, v in steps.items()} }")  # fmt: skip
        # the replica killed restarted (its container), the survivor took its clients
        now = typha_pods(tabby)
        restarts = {n: p["status"]["containerStatuses"][0]["restartCount"] for n, p in now.items()}
        assert restarts[victim] >= 1, restarts
        after = {node: typha_metrics(bare, pod) for node, pod in now.items()}
        moved = _arrivals(after[survivor]) - _arrivals(before[survivor])
        assert moved >= held[victim], (before, after)
        connected = {n: m["tabby_typha_connections"] for n, m in after.items()}
        how = {
            what: after[survivor].get(f"tabby_typha_{what}_total", 0.0)
            - before[survivor].get(f"tabby_typha_{what}_total", 0.0)
            for what in ("snapshots", "resumes", "resyncs")
        }
        takeover.stop()
        print(f"\n[{bare.backend}] typha connections after: {connected}; the survivor took "
              f"{moved:.0f} clients in ({held[victim]:.0f} were on the killed one) within "
              f"{takeover.seconds if takeover.seconds is None else round(takeover.seconds, 2)} s "
              f"of the kill: {how}")  # fmt: skip
        assert takeover.seconds is not None
        eventually(
            "every tabby-node on a typha",
            lambda: (
                sum(
                    typha_metrics(bare, p)["tabby_typha_connections"]
                    for p in typha_pods(tabby).values()
                )
                == len(bare.kube)
            ),
            timeout=60,
        )
        # routes: the web pods (two on every node) reach each other; the friend, made
        # while its node's tabby-node was down, reaches them all
        assert sorted({p.node for p in pods}) == sorted(bare.kube)
        assert bare.http_matrix(web) == []
        # policy as last changed, enforced on every node (a churn pod on each): the
        # friend in, the web pods out
        addresses = [p.ip for p in pods]

        def enforced() -> bool:
            seen = bare.probe_http(friend_pod, [*addresses, *(w.ip for w in web)], 2)
            return all(seen.values()) and not any(bare.probe_http(web[0], addresses, 2).values())

        eventually("the policy enforced on every node", enforced, timeout=60)
        # identities: the cluster's CA, another CN; then another CA
        ca = {
            k: base64.b64decode(v)
            for k, v in bare.kubectl_json("get", "secret", "-n", NAMESPACE, typha_certs.CA_SECRET)[
                "data"
            ].items()
        }
        strangers = {
            "identity": typha_certs.make_leaf(
                ca["ca.crt"], ca["ca.key"], typha_certs.Leaf("x", "intruder", False)
            ),
        }
        other_ca, other_key = typha_certs.make_ca()
        strangers["another CA"] = typha_certs.make_leaf(
            other_ca, other_key, typha_certs.Leaf("x", typha_certs.CLIENT_NAME, False)
        )
        target = typha_pods(tabby)[survivor]
        reasons = ("identity", "handshake")

        def refusals() -> dict[str, float]:
            m = typha_metrics(bare, target)
            return {
                r: m.get(f'tabby_typha_connections_refused_total{{reason="{r}"}}', 0.0)
                for r in reasons
            }

        refused_before = refusals()
        for what, (cert, key) in strangers.items():
            files = []
            for name, data in (("ca", ca["ca.crt"]), ("cert", cert), ("key", key)):
                path = tmp_path / f"{what.replace(' ', '-')}-{name}.pem"
                path.write_bytes(data)
                files.append(str(path))
            proc = bare.in_ns(
                bare.nodes[0].netns, "env", f"PYTHONPATH={REPO}", sys.executable, "-c",
                _TYPHA_CLIENT, f"{target['status']['podIP']}:5473", *files,
            )  # fmt: skip
            assert proc.returncode == 0, proc.stderr
            got = json.loads(proc.stdout)
            assert got["events"] == [], (what, got)
            wanted = "PERMISSION_DENIED" if what == "identity" else "UNAVAILABLE"
            assert wanted in (got["error"] or ""), (what, got)

        def counted() -> bool:
            now = refusals()
            assert all(now[r] >= refused_before[r] + 1 for r in reasons), (refused_before, now)
            return True

        waited = eventually("both refusals counted", counted, timeout=40)
        print(f"\n[{bare.backend}] refusals counted ({waited:.1f} s later): {refusals()}")
    finally:
        if takeover is not None:
            takeover.stop()
        bare.kubectl("delete", "networkpolicy", "-n", WEB_NS, "churn-from-friends",
                     "--ignore-not-found")  # fmt: skip
        bare.kubectl("delete", "deployment", "-n", WEB_NS, "churn", "--ignore-not-found")
        bare.kubectl("delete", "pod", "-n", WEB_NS, "friend", "--wait=false",
                     "--ignore-not-found")  # fmt: skip


def test_every_service_account_has_least_privilege(bare: KubeLab, tabby: ManifestInstall) -> None:
    """The API server's RBAC allows each account every verb its roles grant (tests/rbac.py
    reads them from the manifest; tests/unit/test_manifest_rbac.py derives them from the calls
    each component makes), and denies what no component needs; the accounts do not reach
    into each other's grants."""

    def can(account: str, verb: str, what: str, ns: str | None) -> bool:
        user = f"system:serviceaccount:{NAMESPACE}:{account}"
        resource, _, sub = what.partition("#")  # a subresource (nodes/policylog) after #
        args = ["auth", "can-i", verb, resource, f"--as={user}"]
        args += [f"--subresource={sub}"] if sub else []
        args += ["-n", ns] if ns else ["--all-namespaces"]
        return str(bare.kubectl(*args, check=False).stdout.strip()) == "yes"

    def target(atom: rbac.Atom) -> list[tuple[str, str | None]]:
        kind, _, sub = atom.resource.partition("/")
        resource = kind if not atom.group else f"{kind}.{atom.group}"
        names: list[str | None] = [*sorted(atom.names)] or [None]
        found = [(resource if n is None else f"{resource}/{n}", atom.namespace) for n in names]
        return [(f"{what}#{sub}" if sub else what, ns) for what, ns in found]

    grants = {account: rbac.granted(account) for account in rbac.ACCOUNTS}
    denied = [
        (account, atom.verb, what, ns)
        for account, atoms in grants.items()
        for atom in atoms
        for what, ns in target(atom)
        if not can(account, atom.verb, what, ns)
    ]
    assert denied == []
    nobody_needs = [
        ("create", "pods", "default"),
        ("delete", "pods", "default"),
        ("patch", "pods", "default"),
        ("update", "nodes", None),
        ("delete", "nodes", None),
        ("update", "namespaces", None),
        ("create", "networkpolicies.networking.k8s.io", "default"),
        ("get", "secrets", NAMESPACE),
        ("list", "secrets", None),
        ("get", "configmaps", NAMESPACE),
        ("list", "configmaps", None),
        ("update", "daemonsets.apps", NAMESPACE),
        ("create", "serviceaccounts", NAMESPACE),
        ("delete", "leases.coordination.k8s.io/tabby-kube-controllers", NAMESPACE),
        ("update", "leases.coordination.k8s.io/another-lease", NAMESPACE),
        ("create", "leases.coordination.k8s.io", "kube-system"),
        ("get", "endpoints", None),
        ("create", "pods/exec", "default"),
        ("delete", "customresourcedefinitions.apiextensions.k8s.io", None),
        ("delete", "ippools.tabby.io", None),
        ("update", "ippools.tabby.io", None),
        ("create", "bgppeers.tabby.io", None),
        ("update", "bgpconfigurations.tabby.io", None),
    ]
    allowed = [(a, *n) for a in rbac.ACCOUNTS for n in nobody_needs if can(a, *n)]
    assert allowed == []
    # another node's policy log: tabby-node's own token only (the reader role is unbound)
    for account in rbac.ACCOUNTS:
        log = can(account, "get", "nodes.tabby.io/node-2#policylog", None)
        assert log == (account == "tabby-node"), account
    # the plugins' token reads nothing of Kubernetes' own, and creates no pool
    for verb, what in (("list", "pods"), ("get", "nodes"), ("create", "ippools.tabby.io")):
        assert not can("tabby-cni", verb, what, None), (verb, what)
    # and what they are allowed is enough: the controllers lead, tabbyctl reads the pods
    assert tabby.lease_holder()
    pods = tabby.tabbyctl("get", "pods", "-n", WEB_NS, "-o", "json")
    assert pods.returncode == 0, pods.stderr


def test_tabby_nodes_own_token_reads_another_nodes_policy_log(
    bare: KubeLab, tabby: ManifestInstall
) -> None:
    """``kubectl exec`` of ``tabbyctl policy log --node node-2`` in node-1's tabby-node pod:
    its projected token (audience tabby-node, TABBY_POLICY_LOG_TOKEN_FILE) is reviewed by
    node-2's tabby-node with the API server (in-cluster, its own account's RBAC) and
    served; the same without the token is refused (docs/kubernetes.md "Who reads the
    policy log")."""
    pod = tabby_pod(bare, "node-1")
    ctl = ["exec", "-n", NAMESPACE, pod, "-c", "tabby-node", "--"]
    read = ["tabbyctl", "policy", "log", "--node", "node-2", "-o", "json"]
    served = bare.kubectl(*ctl, *read, check=False)
    assert served.returncode == 0, served.stderr
    refused = bare.kubectl(*ctl, "env", "-u", "TABBY_POLICY_LOG_TOKEN_FILE", *read, check=False)
    assert refused.returncode == 1, refused.stdout
    assert "answered 401" in refused.stderr, refused.stderr


# == upgrade ======================================================================================


def test_a_rolling_update_moves_no_traffic(
    bare: KubeLab, tabby: ManifestInstall, web: list[KubePod], images: Images
) -> None:
    """ICMP at 50 packets/s in a ring node-1 -> node-2 -> node-3 -> node-1 (pod to pod)
    while the DaemonSet rolls to another image: one node at a time (no node's restart makes
    another's tabby-node unready), and no request goes unanswered. A pod created while a
    node's tabby-node is being replaced is networked (its ADD waits for the new tabby-node:
    the plugins refuse it while the table is there). Every tabby-node stopped knowing it was
    not an uninstall, and no node was without its conflist or its table at any moment."""
    ref = tabby.import_image(images.upgrade)
    logs = {n: NodeLog(bare, tabby_pod(bare, n)) for n in bare.kube}
    missing: set[str] = set()  # "node: what", seen absent during the rollout
    by_node = one_per_node(web)
    before = {n: node_files(bare, n) for n in bare.kube}
    birds = {n: bird_process(bare, n)[0] for n in bare.kube} if bare.backend == "bird" else {}
    ring = [("node-1", "node-2"), ("node-2", "node-3"), ("node-3", "node-1")]
    streams = [
        Stream(
            bare.pod_netns(WEB_NS, by_node[a].name),
            by_node[b].ip,
            RATE,
            f"{by_node[a].label} -> {by_node[b].label}",
        ).start()
        for a, b in ring
    ]
    born: tuple[str, float] | None = None
    most_down: set[str] = set()
    try:
        time.sleep(2)
        started = time.monotonic()
        tabby.set_image(ref)
        while not tabby.rolled_out(ref):
            assert time.monotonic() - started < 400, f"rollout: {tabby.describe()}"
            pods = tabby.node_pods()
            down = {
                n
                for n in bare.kube
                if n not in pods
                or pods[n].get("status", {}).get("phase") != "Running"
                or not all(c.get("ready") for c in pods[n]["status"].get("containerStatuses", []))
            }
            if len(down) > len(most_down):
                most_down = down
            if born is None and down:
                born = (sorted(down)[0], time.monotonic() - started)
                bare.apply(_httpd_pod(bare, "born-mid-rollout", born[0]))
            for n in down:
                if not node_files(bare, n)["/etc/cni/net.d/10-tabby.conflist"]:
                    missing.add(f"{n}: the conflist")
                if not has_table(bare, n):
                    missing.add(f"{n}: the table")
            time.sleep(0.3)
        rollout = time.monotonic() - started
        time.sleep(3)
    finally:
        for s in streams:
            s.stop()
    tabby.timings["rollout"] = round(rollout, 2)
    summary = "; ".join(s.summary() for s in streams)
    print(f"\n[{bare.backend}] rolling update in {rollout:.1f} s: {summary}")
    assert all(len(s.sent) >= rollout * RATE * 0.5 for s in streams), summary
    assert [s.lost for s in streams] == [[], [], []], summary
    # one node at a time: a node's restart never made another node's tabby-node unready
    # (a DaemonSet replaces an unready pod at once, whatever maxUnavailable says)
    assert len(most_down) == 1, f"down together: {sorted(most_down)}"
    # a restart, not an uninstall: nothing was removed at any moment, and each old
    # tabby-node said so (when its log could be read to the end: its pod is deleted)
    assert missing == set()
    said = 0
    for n, log in logs.items():
        text = log.text()
        assert "tabby is uninstalled" not in text, (n, text[-1500:])
        if not NodeLog.cut(text):
            said += 1
            assert f"not uninstalled (the DaemonSet {NAMESPACE}/tabby-node is there)" in text, (
                n,
                text[-1500:],
            )
    print(f"[{bare.backend}] {said} of 3 old tabby-nodes' logs read to their end")

    # every node runs the new bundle; the old one stays beside it (it may still run)
    for node in bare.kube:
        after = node_files(bare, node)
        assert after["/opt/tabby/current"] != before[node]["/opt/tabby/current"]
        old = before[node]["/opt/tabby/current"].removeprefix("bundles/")
        assert old in after["bundles"].split()
        if bare.backend == "bird":
            assert bird_process(bare, node)[0] != birds[node]  # BIRD was restarted with it
            peered(bare, node)
    # the pod born while a tabby-node was down is networked: reached from another node
    assert born is not None, "no moment of the rollout found a node without tabby-node"
    node, when = born
    (pod,) = bare.wait_pods(WEB_NS, "app=born", 1, timeout=120)
    src = next(p for p in web if p.node != node)
    eventually(
        f"the pod created on {node} {when:.1f} s into the rollout reached",
        lambda: bare.probe_http(src, [pod.ip], 3)[pod.ip],
        timeout=30,
    )
    print(f"[{bare.backend}] a pod created on {node} {when:.1f} s into the rollout: {pod.ip}")


def _httpd_pod(kube: KubeLab, name: str, node: str | None = None) -> dict[str, Any]:
    """A busybox httpd pod, on ``node`` (None: where the scheduler puts it)."""
    assert kube.busybox is not None
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "namespace": WEB_NS, "labels": {"app": "born"}},
        "spec": {
            **({"nodeName": node} if node else {}),
            "terminationGracePeriodSeconds": 5,
            "containers": [
                {
                    "name": "httpd",
                    "image": kube.busybox.ref,
                    "imagePullPolicy": "Never",
                    "command": HTTPD,
                }
            ],
        },
    }


# == uninstall ====================================================================================


def _pod_routes(kube: KubeLab, node: str, pods: list[KubePod]) -> list[str]:
    """The host routes of ``pods`` on ``node`` (the other tests' pods may still be going)."""
    out = in_node(kube, node, "ip", "-4", "route", "show")
    ips = {p.ip for p in pods}
    return sorted(
        line for line in out.splitlines() if " dev cali" in line and line.split()[0] in ips
    )


def test_kubectl_delete_leaves_nodes_without_a_network_and_running_pods_reachable(
    bare: KubeLab, tabby: ManifestInstall, web: list[KubePod]
) -> None:
    """Everything of tabby goes from the API. Every tabby-node knows its stop is an
    uninstall and leaves its node without tabby's network for new pods: the conflist, the
    plugins' kubeconfig and the nftables table are gone (the binaries stay), the node turns
    NotReady for want of a network, and a pod created on it afterwards is not started: it
    stays Pending, the kubelet reporting the network not ready (docs/kubernetes.md
    "Uninstall", the README). The running pods keep their interfaces, addresses and routes
    and reach each other, on their node and across nodes (without policy now)."""
    assert bare.http_matrix(web) == []  # routes converged before (the BGP sessions up)
    routes = {n: _pod_routes(bare, n, web) for n in bare.kube}
    assert sum(len(r) for r in routes.values()) == len(web)
    assert all(has_table(bare, n) for n in bare.kube)
    logs = {n: NodeLog(bare, tabby_pod(bare, n)) for n in bare.kube}
    tabby.delete()
    print(f"\n[{bare.backend}] uninstalled in {tabby.timings['uninstall']:.1f} s")
    assert bare.kubectl("get", "clusterrole", "tabby-kube-controllers", check=False).returncode
    assert bare.kubectl("get", "crd", "ippools.tabby.io", check=False).returncode
    pods = bare.get_pods(WEB_NS, "app=web")
    assert sorted(p.name for p in pods) == sorted(p.name for p in web)
    assert all(p.phase == "Running" for p in pods)
    for node in bare.kube:
        files = node_files(bare, node)
        assert files["/etc/cni/net.d/10-tabby.conflist"] == "", node
        assert files["/etc/cni/net.d/tabby-kubeconfig"] == "", node
        assert files["/opt/cni/bin/tabby"] == "/opt/tabby/current/tabby"  # the binaries stay
        assert not has_table(bare, node), node
        text = logs[node].text()  # (unless the kubelet removed the container first)
        assert NodeLog.cut(text) or "stopping: tabby is uninstalled" in text, text[-1500:]
        assert _pod_routes(bare, node, web) == routes[node], node
        links = in_node(bare, node, "ip", "-o", "link", "show")
        for route in routes[node]:
            assert f" {route.split()[2]}@" in links, route  # the route's interface
    # on their node (and from it), and across nodes
    for node, pod in one_per_node(web).items():
        same = [p for p in web if p.node == node and p is not pod]
        assert all(bare.probe_http(pod, [p.ip for p in same], 3).values()), node
        assert bare.ping(bare.node(node).netns, pod.ip), f"{node} -> {pod.label}"
    assert bare.http_matrix(web, timeout=10) == []

    # the nodes have no network now: NotReady, as before tabby was installed
    def not_ready() -> bool:
        conditions = bare.node_conditions()
        return all(conditions[n].get("Ready") != "True" for n in bare.kube)

    waited = eventually("every node NotReady (no network)", not_ready, timeout=90)
    node = bare.kubectl_json("get", "node", "node-2")
    ready = next(c for c in node["status"]["conditions"] if c["type"] == "Ready")
    assert "network" in ready["message"].lower(), ready
    # new pods are not started into a network that cannot carry them: one for any node
    # is not scheduled (the nodes are tainted not-ready), one bound to node-2 that tolerates
    # it (as a DaemonSet's pods do) is refused by the kubelet: no network
    before = in_node(bare, "node-2", "ip", "-o", "link", "show")
    bare.apply(_httpd_pod(bare, "after-uninstall"))
    bound = _httpd_pod(bare, "after-uninstall-on-node-2", "node-2")
    bound["spec"]["tolerations"] = [{"key": "node.kubernetes.io/not-ready", "operator": "Exists"}]
    bare.apply(bound)

    def reasons(pod: str) -> set[str]:
        events = bare.kubectl_json(
            "get", "events", "-n", WEB_NS, "--field-selector", f"involvedObject.name={pod}"
        )["items"]
        return {str(e.get("reason")) for e in events}

    eventually(
        "the kubelet reports the network not ready",
        lambda: "NetworkNotReady" in reasons("after-uninstall-on-node-2"),
        timeout=60,
    )
    eventually(
        "the pod for any node is not scheduled",
        lambda: "FailedScheduling" in reasons("after-uninstall"),
        timeout=60,
    )
    time.sleep(10)  # and they stay so
    for name in ("after-uninstall", "after-uninstall-on-node-2"):
        status = bare.kubectl_json("get", "pod", "-n", WEB_NS, name)["status"]
        assert status.get("phase") == "Pending", (name, status)
        assert not status.get("podIP"), (name, status)
    after = in_node(bare, "node-2", "ip", "-o", "link", "show")
    assert after.count(" cali") == before.count(" cali"), after  # no interface made
    print(f"[{bare.backend}] nodes NotReady {waited:.1f} s after the uninstall; new pods Pending")
