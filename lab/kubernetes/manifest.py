"""tabby installed on a Kubernetes lab the Kubernetes way, as docs/kubernetes.md "Installing on
Kubernetes" tells an operator to: the image imported into every node's containerd
(``ctr -n k8s.io images import``), ``manifests/tabby.yaml`` applied as shipped (the
Kubernetes datastore: no etcd of tabby's own) or in etcd mode (its ConfigMap's one change,
``datastore_type`` and the lab's etcd, replaced in the text as docs/kubernetes.md's ``sed``
does), the DaemonSet rolled to another image, and everything removed with ``kubectl delete
-f``.

The lab is a :class:`~lab.kubernetes.cluster.KubeLab` built with ``install_cni=False``: its
nodes have no network until the DaemonSet's init container installs one (into each node's
private /opt, /etc/cni/net.d and /var/lib). The lab's API server is not reachable at the
in-cluster service address (there is no kube-proxy), so tabby-node, its installer and
tabby-kube-controllers get its real address from the optional ConfigMap
``tabby-kubernetes-api``, as docs/kubernetes.md says for such clusters.
"""

from __future__ import annotations

import json
import os
import subprocess
import tarfile
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from lab.kubernetes import node as knode
from lab.kubernetes.cluster import API_PORT, KubeLab, processes
from tabbyctl.demo.proc import LabError

#: In the repository, or beside the modules in the frozen bundle (packaging/tabby.spec).
MANIFEST = Path(__file__).resolve().parents[2] / "manifests" / "tabby.yaml"
NAMESPACE = "tabby-system"
DAEMONSET = "tabby-node"
DEPLOYMENT = "tabby-kube-controllers"
TYPHA = "tabby-typha"
TYPHA_LABEL = "app.kubernetes.io/name=tabby-typha"
NODE_LABEL = "app.kubernetes.io/name=tabby-node"
CONTROLLERS_LABEL = "app.kubernetes.io/name=tabby-kube-controllers"
#: The manifest's defaults an operator replaces (docs/kubernetes.md "Installing on Kubernetes").
DEFAULT_ENDPOINTS = "http://127.0.0.1:2379"
DEFAULT_PREFIX = "/tabby"
DEFAULT_BACKEND = "bird"
DEFAULT_DATASTORE = "kubernetes"


def archive_reference(archive: Path) -> str:
    """The image reference an OCI archive names (what ``ctr images import`` tags it as)."""
    try:
        with tarfile.open(archive) as tar:
            member = tar.extractfile("index.json")
            if member is None:
                raise KeyError("index.json")
            index = json.loads(member.read())
        annotations = index["manifests"][0]["annotations"]
        return str(annotations["io.containerd.image.name"])
    except (OSError, KeyError, IndexError, ValueError, tarfile.TarError) as e:
        raise LabError(f"{archive} is not an image archive with a name: {e}") from None


def _replace_once(text: str, old: str, new: str) -> str:
    if text.count(old) != 1:
        raise LabError(f"manifests/tabby.yaml: expected one {old!r}, found {text.count(old)}")
    return text.replace(old, new)


def render(
    text: str,
    *,
    endpoints: list[str],
    prefix: str,
    backend: str,
    datastore: str = DEFAULT_DATASTORE,
    image: str | None = None,
    api_server: tuple[str, int] | None = None,
    policy_v1: bool = True,
) -> str:
    """The manifest with the lab's settings: the backend; in etcd mode (``datastore``
    ``etcdv3``) the ConfigMap's datastore_type and the lab's etcd endpoints and prefix (as
    shipped, the Kubernetes datastore, they stay the manifest's defaults: unused); the image
    of every container (``image``), and the ConfigMap ``tabby-kubernetes-api``
    (``api_server``: host, port) appended; on an API server without ``policy/v1``
    (Kubernetes 1.20: ``policy_v1`` false) the PodDisruptionBudget as ``policy/v1beta1``,
    as docs/kubernetes.md tells such a cluster's operator."""
    if datastore != DEFAULT_DATASTORE:
        text = _replace_once(
            text,
            f'  datastore_type: "{DEFAULT_DATASTORE}"',
            f'  datastore_type: "{datastore}"',
        )
        text = _replace_once(
            text,
            f'  etcd_endpoints: "{DEFAULT_ENDPOINTS}"',
            f'  etcd_endpoints: "{",".join(endpoints)}"',
        )
        text = _replace_once(
            text, f'  etcd_prefix: "{DEFAULT_PREFIX}"', f'  etcd_prefix: "{prefix}"'
        )
    text = _replace_once(text, f'  backend: "{DEFAULT_BACKEND}"', f'  backend: "{backend}"')
    if image is not None:
        images = {
            line.split("image:", 1)[1].strip()
            for line in text.splitlines()
            if line.strip().startswith("image:")
        }
        if len(images) != 1:
            raise LabError(f"manifests/tabby.yaml: expected one image, found {sorted(images)}")
        text = text.replace(f"image: {images.pop()}", f"image: {image}")
    if not policy_v1:
        text = _replace_once(
            text,
            "apiVersion: policy/v1\nkind: PodDisruptionBudget",
            "apiVersion: policy/v1beta1\nkind: PodDisruptionBudget",
        )
    if api_server is not None:
        host, port = api_server
        text += (
            "---\napiVersion: v1\nkind: ConfigMap\n"
            f"metadata:\n  name: tabby-kubernetes-api\n  namespace: {NAMESPACE}\n"
            f'data:\n  KUBERNETES_SERVICE_HOST: "{host}"\n  KUBERNETES_SERVICE_PORT: "{port}"\n'
        )
    return text


@dataclass
class ManifestInstall:
    """tabby by manifests/tabby.yaml on ``kube`` (module docstring); ``timings`` in
    seconds, for the tier's report."""

    kube: KubeLab
    backend: str = "bird"
    datastore: str = DEFAULT_DATASTORE
    manifest: Path = MANIFEST
    timings: dict[str, float] = field(default_factory=dict)
    applied: str = ""  # the text last applied

    # -- the image ---------------------------------------------------------------------------

    def import_image(self, archive: Path) -> str:
        """``ctr -n k8s.io images import`` of ``archive`` on every node at once; its
        reference."""
        ref = archive_reference(archive)
        started = time.monotonic()

        def load(name: str) -> None:
            proc = self.kube.run_on(
                name,
                [
                    *("ctr", "--address", knode.CONTAINERD_SOCKET, "-n", "k8s.io"),
                    *("images", "import", "--snapshotter", "overlayfs", str(archive)),
                ],
                timeout=300,
            )
            if proc.returncode != 0:
                raise LabError(f"ctr images import on {name}: {proc.stderr.strip()[-500:]}")

        with ThreadPoolExecutor(max_workers=len(self.kube.kube)) as pool:
            for f in [pool.submit(load, name) for name in self.kube.kube]:
                f.result()
        self.timings[f"import {ref}"] = round(time.monotonic() - started, 2)
        return ref

    # -- applying -----------------------------------------------------------------------------

    def policy_v1(self) -> bool:
        """Whether the API server serves ``policy/v1`` (1.21 and later)."""
        versions = self.kube.kubectl("api-versions").stdout.split()
        return "policy/v1" in versions

    def text(self, image: str | None = None) -> str:
        return render(
            self.manifest.read_text(),
            endpoints=self.kube.endpoints(),
            prefix=self.kube.etcd_prefix,
            backend=self.backend,
            datastore=self.datastore,
            image=image,
            api_server=(str(self.kube.nodes[0].ipv4.ip), API_PORT),
            policy_v1=self.policy_v1(),
        )

    def dry_run(self, image: str | None = None) -> str:
        """``kubectl apply --dry-run=server``: the API server (RBAC on) validates and
        admits every object without keeping any; its output."""
        proc = self.kube.kubectl("apply", "--dry-run=server", "-f", "-", input=self.text(image))
        return str(proc.stdout)

    def apply(self, image: str | None = None) -> str:
        self.applied = self.text(image)
        return self.kube.apply(self.applied)

    def delete(self, timeout: float = 180) -> None:
        """``kubectl delete -f --ignore-not-found`` of what was applied (as docs/kubernetes.md
        "Uninstall" says: the plugins' token Secret may go with its ServiceAccount first);
        returns when the DaemonSet and the Deployment are gone and no tabby process
        (tabby-node, BIRD, the controllers) runs on any node. (The namespace itself goes
        when the kubelets have reported every pod gone: kubelet 1.20 may take a minute
        more.)"""
        started = time.monotonic()
        self.kube.kubectl(
            "delete", "-f", "-", "--wait=false", "--ignore-not-found", input=self.applied
        )

        def gone() -> bool:
            workloads = (
                ("daemonset", DAEMONSET),
                ("deployment", DEPLOYMENT),
                ("deployment", TYPHA),
            )
            for kind, name in workloads:
                proc = self.kube.kubectl("get", kind, "-n", NAMESPACE, name, check=False)
                if proc.returncode == 0:
                    return False
            return not self.processes()

        self.kube.wait_for("tabby gone from the API and the nodes", gone, timeout, interval=0.5)
        self.timings["uninstall"] = round(time.monotonic() - started, 2)

    def processes(self) -> list[str]:
        """tabby's processes on the nodes: ``node: argv`` of each tabby-node, BIRD and
        tabby-kube-controllers in a node's network namespace."""
        netns = {
            os.readlink(f"/proc/{kn.pid}/ns/net"): name
            for name, kn in self.kube.kube.items()
            if kn.holder is not None
        }
        found = []
        for pid, argv in processes():
            words = argv.split()
            if not words:
                continue
            program = os.path.basename(words[0])
            if program not in (
                "tabby-node",
                "tabby-kube-controllers",
                "tabby-typha",
                "bird",
                "tabby",
            ):
                continue
            try:
                node = netns.get(os.readlink(f"/proc/{pid}/ns/net"))
            except OSError:
                continue
            if node is not None:
                found.append(f"{node}: {argv[:120]}")
        return found

    def tabbyctl(self, *args: str) -> subprocess.CompletedProcess[str]:
        """tabbyctl on node-1 on the datastore the manifest was applied with (the Kubernetes
        API with the lab's admin kubeconfig, or the lab's etcd)."""
        if self.datastore != "kubernetes":
            return self.kube.tabbyctl(*args)
        flags = ["--datastore-type", "kubernetes", "--kubeconfig", str(self.kube.admin_kubeconfig)]
        return self.kube.in_ns(self.kube.nodes[0].netns, *self.kube.tabbyctl_bin, *flags, *args)

    # -- what runs ----------------------------------------------------------------------------

    def pods(self, selector: str = NODE_LABEL) -> list[dict[str, Any]]:
        items = self.kube.kubectl_json("get", "pods", "-n", NAMESPACE, "-l", selector)["items"]
        return list(items)

    def node_pods(self) -> dict[str, dict[str, Any]]:
        """tabby-node's pods by node (the ones not being deleted)."""
        return {
            p["spec"]["nodeName"]: p
            for p in self.pods()
            if p.get("spec", {}).get("nodeName") and not p["metadata"].get("deletionTimestamp")
        }

    def daemonset(self) -> dict[str, Any]:
        return dict(self.kube.kubectl_json("get", "daemonset", "-n", NAMESPACE, DAEMONSET))

    def rolled_out(self, image: str | None = None) -> bool:
        """The DaemonSet's every pod current, available and ready (running ``image``)."""
        ds = self.daemonset()
        status, want = ds.get("status", {}), len(self.kube.kube)
        if ds["metadata"].get("generation") != status.get("observedGeneration"):
            return False
        counts = (
            status.get("desiredNumberScheduled"),
            status.get("updatedNumberScheduled"),
            status.get("numberAvailable"),
            status.get("numberReady"),
        )
        if counts != (want, want, want, want):
            return False
        pods = self.node_pods()
        if len(pods) != want:
            return False
        for pod in pods.values():
            spec = pod["spec"]
            if image is not None and any(c["image"] != image for c in spec["containers"]):
                return False
            ready = {
                c["type"]: c["status"] for c in pod.get("status", {}).get("conditions", [])
            }.get("Ready")
            if ready != "True":
                return False
        return True

    def controllers_available(self) -> bool:
        dep = self.kube.kubectl_json("get", "deployment", "-n", NAMESPACE, DEPLOYMENT)
        return bool(dep.get("status", {}).get("availableReplicas") == 2)

    def typha_available(self) -> bool:
        """Every typha replica a node can hold available (2, or 1 on a one-node lab: the
        replicas keep off each other's nodes)."""
        dep = self.kube.kubectl_json("get", "deployment", "-n", NAMESPACE, TYPHA)
        want = min(int(dep.get("spec", {}).get("replicas", 0)), len(self.kube.kube))
        return bool(dep.get("status", {}).get("availableReplicas") == want)

    def lease_holder(self) -> str:
        lease = self.kube.kubectl_json(
            "get", "lease", "-n", NAMESPACE, "tabby-kube-controllers", check=False
        )
        return str(lease.get("spec", {}).get("holderIdentity") or "")

    def wait_installed(self, timeout: float = 240) -> None:
        """Until every node is Ready, the DaemonSet is rolled out, both controllers are
        available with a Lease holder and typha's replicas are available; the failing
        pods' state on timeout."""
        started = time.monotonic()
        self._wait("every node Ready", self.kube.nodes_ready, timeout)
        self.timings["apply -> nodes Ready"] = round(time.monotonic() - started, 2)
        self._wait("the DaemonSet ready on every node", self.rolled_out, timeout)
        self.timings["apply -> tabby-node ready everywhere"] = round(time.monotonic() - started, 2)
        self._wait("2 controllers available", self.controllers_available, timeout)
        self._wait("typha available", self.typha_available, timeout)
        self._wait("a Lease holder", self.lease_holder, timeout)
        self.timings["apply -> controllers leading"] = round(time.monotonic() - started, 2)

    def set_image(self, image: str) -> None:
        """What docs/kubernetes.md's upgrade says: ``kubectl set image`` of both workloads."""
        self.kube.kubectl(
            "set",
            "image",
            "-n",
            NAMESPACE,
            f"daemonset/{DAEMONSET}",
            f"install-cni={image}",
            f"tabby-node={image}",
        )
        for deployment in (DEPLOYMENT, TYPHA):
            self.kube.kubectl(
                "set", "image", "-n", NAMESPACE, f"deployment/{deployment}", f"{deployment}={image}"
            )

    def _wait(self, what: str, probe: Callable[[], object], timeout: float) -> None:
        try:
            self.kube.wait_for(what, probe, timeout, interval=1.0)
        except LabError as e:
            raise LabError(f"{e}; tabby's pods: {self.describe()}") from None

    def describe(self) -> str:
        """One line per tabby pod: node, phase, each container's state (for failures)."""
        out = []
        for pod in [*self.pods(), *self.pods(CONTROLLERS_LABEL)]:
            status = pod.get("status", {})
            states = []
            for c in [
                *status.get("initContainerStatuses", []),
                *status.get("containerStatuses", []),
            ]:
                state = next(iter(c.get("state", {})), "?")
                detail = c.get("state", {}).get(state, {})
                why = detail.get("reason") or detail.get("message") or ""
                states.append(f"{c['name']}={state}{f'({why})' if why else ''}")
            out.append(
                f"{pod['metadata']['name']}@{pod['spec'].get('nodeName', '?')} "
                f"{status.get('phase', '?')} {' '.join(states)}"
            )
        return "; ".join(out)

    def logs(self, pod: str, container: str, previous: bool = False) -> str:
        args = ["logs", "-n", NAMESPACE, pod, "-c", container, "--tail", "60"]
        if previous:
            args.append("--previous")
        proc = self.kube.kubectl(*args, check=False)
        return str(proc.stdout or proc.stderr)
