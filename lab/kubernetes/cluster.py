"""KubeLab: a real Kubernetes 1.20 on the demos' namespace lab, with tabby as its network.

::

    fabric + node-1..N    tabbyctl.demo.lab.Lab: the underlay bridge, one network namespace
                          per node, a 3-member etcd on the nodes (tabby's prefix, and
                          Kubernetes' /registry on the same members)
    every node            a holder (lab.kubernetes.node): a private mount namespace in the
                          node's network namespace; inside it tabby-node (cluster mode, the
                          conflist in /etc/cni/net.d, --backend bird|vxlan), containerd (CRI)
                          and kubelet (system:node:<node>, cgroupfs, its own cgroupRoot)
    node-1                the control plane: kube-apiserver (Node,RBAC) at node-1's underlay
                          address, kube-controller-manager (service account tokens, garbage
                          collection), kube-scheduler

Kubernetes and tabby share the etcd members: that is how a Calico cluster in etcd mode is
often run, it costs no extra processes (etcd is ~30 MB per member), and the API server's
compaction of the shared keyspace exercises tabby-node's resync of a compacted watch. Both
live under prefixes of their own (``/registry``, ``/tabby-lab-<id>``).

Everything is recorded before it can be interrupted and stopped by PID: the kubelets and
the control plane (SIGTERM, then SIGKILL after a short grace: kube-apiserver may take a
minute to exit on SIGTERM), the pods' processes (through their cgroups), containerd,
tabby-node, whatever else runs in a node's mount namespace (shims, BIRD), the holders and
etcd; then the cgroup roots are removed in every hierarchy (cgroup2 included), the
namespaces deleted and the work directory removed, also on failure and Ctrl-C.
:meth:`KubeLab.leftovers` checks the machine afterwards.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import ssl
import subprocess
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

from lab.kubernetes import build, images, kdd, pki
from lab.kubernetes import node as knode
from lab.kubernetes.node import KubeNode
from tabbyctl.demo.lab import Lab, LabNode, http_get
from tabbyctl.demo.proc import Echo, LabError, run

API_PORT = 6443
SERVICE_CIDR = "10.96.0.0/12"
#: Programs every node needs on the machine (and the Debian package that has each).
TOOLS = {
    "containerd": "containerd",
    "ctr": "containerd",
    "runc": "runc",
    "nsenter": "util-linux",
    "unshare": "util-linux",
    "openssl": "openssl",
    "etcd": "etcd-server",
    "bird": "bird2",
    "nft": "nftables",
    "gcc": "gcc",
}
#: The busybox image's sleeper and web server: sh as PID 1 exits on SIGTERM (sleep or httpd
#: there would ignore it).
SLEEPER = ["/bin/sh", "-c", "trap 'exit 0' TERM; sleep 1000000 & wait"]
HTTPD = ["/bin/sh", "-c", "trap 'exit 0' TERM; httpd -f -p 80 -h /www & wait"]
STOP_GRACE = 3.0  # seconds between SIGTERM and SIGKILL for Kubernetes' daemons

T = TypeVar("T")


class Broken(LabError):
    """A part of the lab died: waiting longer would not help."""


@dataclass
class KubePod:
    """A pod as ``kubectl get pods -o json`` shows it."""

    namespace: str
    name: str
    node: str
    ips: list[str]
    phase: str
    ready: bool
    labels: dict[str, str]
    uid: str

    @property
    def ip(self) -> str:
        return self.ips[0] if self.ips else ""

    @property
    def label(self) -> str:
        return f"{self.namespace}/{self.name}@{self.node}"

    @classmethod
    def from_json(cls, item: dict[str, Any]) -> KubePod:
        meta, spec, status = item["metadata"], item.get("spec", {}), item.get("status", {})
        ips = [p["ip"] for p in status.get("podIPs") or [] if p.get("ip")]
        if not ips and status.get("podIP"):
            ips = [status["podIP"]]
        ready = any(
            c.get("type") == "Ready" and c.get("status") == "True"
            for c in status.get("conditions") or []
        )
        return cls(
            namespace=meta["namespace"],
            name=meta["name"],
            node=spec.get("nodeName", ""),
            ips=ips,
            phase=status.get("phase", ""),
            ready=ready,
            labels=dict(meta.get("labels") or {}),
            uid=meta.get("uid", ""),
        )


@dataclass
class KubeLab(Lab):
    """tabbyctl.demo.lab.Lab with Kubernetes on it (module docstring). ``build()`` returns when
    every node is Ready, tabby-node is ready on every node and the default service account
    has its token; ``teardown()`` removes everything and returns what it could not."""

    nodes_wanted: int = 3
    ipv6: bool = False  # Kubernetes 1.20's dual stack is alpha: pods are IPv4
    #: False: the lab installs no network (no conflist, no tabby binaries, no tabby-node; a
    #: private /opt in every node): the nodes stay NotReady until something installs one,
    #: as manifests/tabby.yaml does (lab.kubernetes.manifest). build() returns when every
    #: node has registered.
    install_cni: bool = True
    #: tabby's datastore: "etcdv3" (the lab's etcd, beside Kubernetes' own) or "kubernetes"
    #: (the API server, set up from manifests/tabby.yaml: lab.kubernetes.kdd; nothing of
    #: tabby in etcd)
    datastore: str = "etcdv3"
    #: the kubeconfig tabby-node runs with on the Kubernetes datastore (its account's token)
    node_kubeconfig: Path | None = None
    kube_bin: Path | None = None  # the Kubernetes binaries (default: lab.kubernetes.build's)
    image_cache: str = build.DEFAULT_ROOT
    progress: Echo | None = None  # bring-up and teardown steps, with their times
    containerd_log_level: str = "warn"  # "info": every CRI call, timed (kube_bench)
    kube: dict[str, KubeNode] = field(default_factory=dict)
    control_plane: list[subprocess.Popen[bytes]] = field(default_factory=list)
    apiserver: subprocess.Popen[bytes] | None = None
    extra: list[subprocess.Popen[bytes]] = field(default_factory=list)
    pause: images.Image | None = None
    busybox: images.Image | None = None
    timings: dict[str, float] = field(default_factory=dict)
    _pki: pki.Pki | None = None
    _netns_inodes: set[int] = field(default_factory=set)
    #: Open descriptors of the lab's network and mount namespaces, closed after
    #: :meth:`leftovers`: a freed namespace's inode number is soon another's (the kernel
    #: hands out the lowest free one), and another lab's process in it would look like ours.
    _ns_pins: list[int] = field(default_factory=list)
    _host_before: dict[str, set[str]] = field(default_factory=dict)

    # -- names, addresses, files --------------------------------------------------------------

    @property
    def api_server(self) -> str:
        """The API server's URL (node-1's underlay address)."""
        return f"https://{self.nodes[0].ipv4.ip}:{API_PORT}"

    @property
    def pki(self) -> pki.Pki:
        if self._pki is None:
            raise LabError("the lab has no PKI yet (build() makes it)")
        return self._pki

    @property
    def ca_file(self) -> Path:
        """The cluster CA (it signed the API server's and the kubelets' certificates)."""
        return self.pki.ca.cert

    @property
    def kube_dir(self) -> Path:
        return Path(self.workdir) / "kubernetes"

    @property
    def admin_kubeconfig(self) -> Path:
        return self.kube_dir / "admin.conf"

    def binary(self, name: str) -> Path:
        if self.kube_bin is None:
            found = build.find_binaries()
            if found is None:
                raise LabError(
                    "Kubernetes is not built: python3 -m lab.kubernetes.build (once, ~7 min)"
                )
            self.kube_bin = found
        return self.kube_bin / name

    def kube_node(self, which: LabNode | str) -> KubeNode:
        name = which if isinstance(which, str) else which.name
        try:
            return self.kube[name]
        except KeyError:
            raise LabError(f"no Kubernetes node {name}") from None

    def _log(self, message: str) -> None:
        if self.progress is not None:
            self.progress(message)

    # -- running things ---------------------------------------------------------------------------

    def make_netns(self, name: str) -> None:
        super().make_netns(name)
        self._pin(f"/run/netns/{name}")
        with contextlib.suppress(OSError):
            self._netns_inodes.add(os.stat(f"/run/netns/{name}").st_ino)

    def _pin(self, ns_path: str) -> None:
        with contextlib.suppress(OSError):
            self._ns_pins.append(os.open(ns_path, os.O_RDONLY | os.O_CLOEXEC))

    def spawn_on(
        self, which: LabNode | str, argv: list[str], log_name: str, *, mount: bool = True
    ) -> subprocess.Popen[bytes]:
        """A daemon on a node (its network namespace, and its mount namespace unless
        ``mount`` is false), logging to ``<node workdir>/<log_name>``, stopped by PID at
        teardown."""
        kn = self.kube_node(which)
        proc = self.spawn(
            [*kn.enter(mount), *argv],
            os.path.join(kn.node.workdir, log_name),
            env=knode.frozen_env(),
        )
        self.extra.append(proc)
        return proc

    def run_on(
        self,
        which: LabNode | str,
        argv: list[str],
        *,
        mount: bool = True,
        timeout: float = 60,
        input: str | None = None,
    ) -> subprocess.CompletedProcess[str]:
        """A command on a node, to its end (captured text output)."""
        kn = self.kube_node(which)
        return run(
            [*kn.enter(mount), *argv],
            capture_output=True,
            text=True,
            timeout=timeout,
            input=input,
            env=knode.frozen_env(),
        )

    def kubectl_argv(self, kubeconfig: Path | None = None) -> list[str]:
        return [
            str(self.binary("kubectl")),
            f"--kubeconfig={kubeconfig or self.admin_kubeconfig}",
            f"--cache-dir={self.kube_dir / 'kubectl-cache'}",
        ]

    def kubectl(
        self,
        *args: str,
        node: LabNode | str | None = None,
        input: str | None = None,
        timeout: float = 60,
        check: bool = True,
        kubeconfig: Path | None = None,
    ) -> subprocess.CompletedProcess[str]:
        """The cache's kubectl (the server's version) with the admin kubeconfig (or
        ``kubeconfig``), run in a node's network namespace (node-1 by default)."""
        netns = self._netns_of(node)
        argv = ["nsenter", f"--net=/run/netns/{netns}", "--", *self.kubectl_argv(kubeconfig)]
        try:
            proc = run(
                [*argv, *args],
                capture_output=True,
                text=True,
                timeout=timeout,
                input=input,
                env=knode.frozen_env(),
            )
        except subprocess.TimeoutExpired:
            raise LabError(f"kubectl {' '.join(args[:3])} took more than {timeout:.0f} s") from None
        if check and proc.returncode != 0:
            raise LabError(f"kubectl {' '.join(args[:3])} failed: {proc.stderr.strip()[-800:]}")
        return proc

    def _netns_of(self, which: LabNode | str | None) -> str:
        if which is None:
            return self.nodes[0].netns
        return self.node(which).netns if isinstance(which, str) else which.netns

    def kubectl_json(self, *args: str, **kwargs: Any) -> Any:
        return json.loads(self.kubectl(*args, "-o", "json", **kwargs).stdout)

    def apply(self, docs: dict[str, Any] | list[dict[str, Any]] | str, **kwargs: Any) -> str:
        """``kubectl apply -f -`` of a document, a list of them, or manifest text."""
        if isinstance(docs, str):
            text = docs
        else:
            items = docs if isinstance(docs, list) else [docs]
            text = json.dumps({"apiVersion": "v1", "kind": "List", "items": items})
        return str(self.kubectl("apply", "-f", "-", input=text, **kwargs).stdout)

    def get_pods(
        self, namespace: str | None = "default", selector: str | None = None
    ) -> list[KubePod]:
        """Pods with their node and addresses (``namespace`` None: every namespace)."""
        args = ["get", "pods", "-A"] if namespace is None else ["get", "pods", "-n", namespace]
        if selector:
            args += ["-l", selector]
        return [KubePod.from_json(i) for i in self.kubectl_json(*args)["items"]]

    def wait_for(
        self, what: str, probe: Callable[[], T | None], timeout: float = 120, interval: float = 0.5
    ) -> T:
        """Call ``probe`` until it returns something truthy; LabError after ``timeout``."""
        deadline = time.monotonic() + timeout
        last: Any = None
        while True:
            try:
                value = probe()
            except Broken:
                raise
            except LabError as e:
                value, last = None, e
            if value:
                return value
            if time.monotonic() > deadline:
                raise LabError(f"timed out after {timeout:.0f} s waiting for {what}: {last or ''}")
            time.sleep(interval)

    def wait_pods(
        self, namespace: str, selector: str, count: int, timeout: float = 120
    ) -> list[KubePod]:
        """Until exactly ``count`` pods match, all Running and Ready with an address."""

        def ready() -> list[KubePod] | None:
            pods = self.get_pods(namespace, selector)
            done = [p for p in pods if p.phase == "Running" and p.ready and p.ips]
            return pods if len(pods) == count and len(done) == count else None

        return self.wait_for(f"{count} ready pods {selector} in {namespace}", ready, timeout)

    def exec(
        self, pod: KubePod, command: list[str], timeout: float = 60
    ) -> subprocess.CompletedProcess[str]:
        """``kubectl exec`` in a pod (its output; no check)."""
        return self.kubectl(
            "exec",
            "-n",
            pod.namespace,
            pod.name,
            "--",
            *command,
            timeout=timeout,
            check=False,
        )

    # -- workloads -----------------------------------------------------------------------------

    def sleeper_pod(
        self, name: str, namespace: str, labels: dict[str, str], **spec: Any
    ) -> dict[str, Any]:
        """A busybox pod that sleeps and stops at once on SIGTERM (container ``c``, a named
        port ``web`` 8080 for policies to name); ``spec`` adds to its spec, except
        ``annotations``, which go to its metadata."""
        if self.busybox is None:
            raise LabError("the lab has no images yet (build() makes them)")
        meta: dict[str, Any] = {"name": name, "namespace": namespace, "labels": labels}
        if "annotations" in spec:
            meta["annotations"] = spec.pop("annotations")
        container = {
            "name": "c",
            "image": self.busybox.ref,
            "imagePullPolicy": "Never",
            "command": SLEEPER,
            "ports": [{"name": "web", "containerPort": 8080}],
        }
        return {
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": meta,
            "spec": {"terminationGracePeriodSeconds": 1, "containers": [container], **spec},
        }

    def sleeper_deployment(
        self, name: str, namespace: str, replicas: int, node: str
    ) -> dict[str, Any]:
        """A Deployment of ``replicas`` sleeper pods (:meth:`sleeper_pod`, label
        app=<name>) bound to ``node`` (no scheduler between)."""
        labels = {"app": name}
        template = self.sleeper_pod(name, namespace, labels, nodeName=node)
        return {
            "apiVersion": "apps/v1",
            "kind": "Deployment",
            "metadata": {"name": name, "namespace": namespace},
            "spec": {
                "replicas": replicas,
                "selector": {"matchLabels": labels},
                "template": {"metadata": {"labels": labels}, "spec": template["spec"]},
            },
        }

    def web_deployment(
        self, name: str = "web", namespace: str = "default", replicas: int = 6
    ) -> dict[str, Any]:
        """A Deployment of busybox httpd pods (port 80, label app=<name>) spread evenly over
        the nodes; they stop at once on SIGTERM (httpd as PID 1 would ignore it)."""
        if self.busybox is None:
            raise LabError("the lab has no images yet (build() makes them)")
        labels = {"app": name}
        return {
            "apiVersion": "apps/v1",
            "kind": "Deployment",
            "metadata": {"name": name, "namespace": namespace},
            "spec": {
                "replicas": replicas,
                "selector": {"matchLabels": labels},
                "template": {
                    "metadata": {"labels": labels},
                    "spec": {
                        "terminationGracePeriodSeconds": 5,
                        "topologySpreadConstraints": [
                            {
                                "maxSkew": 1,
                                "topologyKey": "kubernetes.io/hostname",
                                "whenUnsatisfiable": "DoNotSchedule",
                                "labelSelector": {"matchLabels": labels},
                            }
                        ],
                        "containers": [
                            {
                                "name": "httpd",
                                "image": self.busybox.ref,
                                "imagePullPolicy": "Never",  # no registry: the node has it
                                "command": HTTPD,
                                "ports": [{"name": "http", "containerPort": 80}],
                            }
                        ],
                    },
                },
            },
        }

    def probe_http(self, src: KubePod, addresses: list[str], timeout: int = 3) -> dict[str, bool]:
        """From inside pod ``src`` (one ``kubectl exec``), an HTTP GET of each address on
        port 80: address -> answered."""
        script = (
            f"for ip in {' '.join(addresses)}; do "
            # busybox 1.35's own wget -T segfaults: its timeout applet bounds it instead
            f"if timeout {timeout} wget -q -O /dev/null http://$ip/; "
            'then echo "ok $ip"; else echo "no $ip"; fi; done'
        )
        proc = self.exec(src, ["sh", "-c", script], timeout=30 + timeout * len(addresses))
        words = [line.split() for line in proc.stdout.splitlines()]
        seen = {w[1]: w[0] for w in words if len(w) == 2}
        return {a: seen.get(a) == "ok" for a in addresses}

    def http_matrix(self, pods: list[KubePod], timeout: float = 30) -> list[str]:
        """Every pod GETs every other pod (one exec per source pod, in parallel), retried
        while routes converge; the paths that never answered ("src -> dst (ip)")."""
        pending = {(s.label, d.ip): (s, d) for s in pods for d in pods if s is not d}
        deadline = time.monotonic() + timeout
        while pending:
            jobs: dict[str, tuple[KubePod, list[str]]] = {}
            for src, dst in pending.values():
                jobs.setdefault(src.label, (src, []))[1].append(dst.ip)
            with ThreadPoolExecutor(max_workers=len(jobs)) as pool:
                results = pool.map(lambda job: (job[0], self.probe_http(*job)), jobs.values())
                for src, answers in results:
                    for ip, ok in answers.items():
                        if ok:
                            pending.pop((src.label, ip), None)
            if not pending or time.monotonic() > deadline:
                break
            time.sleep(1)
        return [f"{s.label} -> {d.label} ({d.ip})" for s, d in pending.values()]

    # -- credentials for other programs ---------------------------------------------------------

    def kubeconfig_for_user(self, user: str, groups: tuple[str, ...] = ()) -> Path:
        """A kubeconfig authenticating as ``user`` (in ``groups``) by a client certificate
        the cluster CA signed."""
        stem = "user-" + "".join(c if c.isalnum() or c in "-_." else "_" for c in user)
        pair = self.pki.issue(stem, user, groups=groups)
        return pki.write_kubeconfig(
            self.kube_dir / f"{stem}.conf", self.api_server, self.ca_file, user, client=pair
        )

    def kubeconfig_for_service_account(
        self, namespace: str, name: str, timeout: float = 60
    ) -> Path:
        """A kubeconfig with the token of service account ``namespace/name`` (waits for the
        token controller to make its secret)."""
        import base64

        def token() -> str | None:
            sa = self.kubectl_json("get", "serviceaccount", "-n", namespace, name)
            for ref in sa.get("secrets") or []:
                secret = self.kubectl_json("get", "secret", "-n", namespace, ref["name"])
                data = secret.get("data") or {}
                if secret.get("type") == "kubernetes.io/service-account-token" and data.get(
                    "token"
                ):
                    return base64.b64decode(data["token"]).decode()
            return None

        value = self.wait_for(f"the token of service account {namespace}/{name}", token, timeout)
        return pki.write_kubeconfig(
            self.kube_dir / f"sa-{namespace}-{name}.conf",
            self.api_server,
            self.ca_file,
            f"system:serviceaccount:{namespace}:{name}",
            token=value,
        )

    # -- building ----------------------------------------------------------------------------------

    def check_tools(self) -> None:
        """What the lab runs, before anything is made (one line naming what is missing)."""
        if os.geteuid() != 0:
            raise LabError("the Kubernetes lab needs root (namespaces, mounts, cgroups)")
        missing = sorted({pkg for tool, pkg in TOOLS.items() if shutil.which(tool) is None})
        if not os.access(knode.DEBIAN_LOOPBACK, os.X_OK):
            missing.append("containernetworking-plugins")
        if missing:
            raise LabError(f"missing on this machine: apt-get install {' '.join(missing)}")
        for name in build.BINARIES:
            if not os.access(self.binary(name), os.X_OK):
                raise LabError(f"{self.binary(name)} is missing: python3 -m lab.kubernetes.build")
        if self.install_cni:
            knode.cni_binaries(self.cni_bin)

    def _timed(self, name: str, started: float) -> None:
        self.timings[name] = round(time.monotonic() - started, 2)

    def build(self) -> None:
        t0 = time.monotonic()
        self.check_tools()
        self._host_before = host_state()
        try:
            self.pause = images.pause_image(self.image_cache)
            self.busybox = images.busybox_image(self.image_cache)
        except images.ImageError as e:
            raise LabError(str(e)) from None
        self._log("underlay bridge, node namespaces, etcd (3 members)")
        self.build_underlay()
        self._timed("underlay+etcd", t0)
        self._make_pki()
        if self.install_cni:
            binaries = knode.cni_binaries(self.cni_bin)
            conflist: dict[str, Any] | None = knode.conflist(self.ipam_settings())
        else:
            binaries, conflist = knode.loopback_binary(), None
        self._log("node holders: a private mount namespace in every node")
        for n in self.nodes:
            kn = KubeNode(n, cgroup_root=f"/{self.prefix}-{n.name}")
            self.kube[n.name] = kn  # recorded first: teardown removes its cgroups
            knode.make_cgroup_root(kn.cgroup_root)
            kn.holder = self.spawn(
                knode.holder_argv(n.netns), os.path.join(n.workdir, "holder.log")
            )
            knode.wait_holder(kn)
            self._pin(f"/proc/{kn.pid}/ns/mnt")
            knode.prepare(kn, Path(n.workdir), conflist, binaries)
        self._timed("holders", t0)
        self._log(f"control plane on {self.nodes[0].name}: kube-apiserver at {self.api_server}")
        self._start_apiserver()
        if self.install_cni and self.datastore != "kubernetes":
            self._log(f"tabby-node ({self.backend}) and containerd on every node")
            self.start_agents()
        elif self.install_cni:
            self._log("containerd on every node (tabby-node once its datastore, the API, is up)")
        else:
            self._log("containerd on every node (no network: nothing installs one yet)")
        for kn in self.kube.values():
            kn.containerd = self.spawn(
                [*kn.enter(), "containerd", "--config", str(self._containerd_config(kn))],
                os.path.join(kn.node.workdir, "containerd.log"),
                env=knode.frozen_env(),
            )
        self._import_images()
        self._timed("containerd+images", t0)
        self._wait_apiserver()
        self._timed("apiserver ready", t0)
        self._start_controllers()
        if self.install_cni and self.datastore == "kubernetes":
            self._log("tabby's CRDs and accounts from the manifest; tabby-node on every node")
            self.install_kdd()
            self.start_agents()
            self._timed("tabby on the API", t0)
        self._log("kubelet on every node")
        for kn in self.kube.values():
            self._start_kubelet(kn)
        if self.install_cni:
            self.wait_ready(90)  # tabby-node on every node
            self.wait_for("every node Ready", self._nodes_ready, timeout=120)
            self._timed("nodes Ready", t0)
        else:
            self.wait_for("every node registered", self.nodes_registered, timeout=120)
            self._timed("nodes registered", t0)
        self.wait_for(
            "the default service account's token",
            lambda: self._default_token_ready(),
            timeout=60,
        )
        self._timed("ready", t0)
        self._log(f"cluster ready in {time.monotonic() - t0:.1f} s")

    def ipam_settings(self) -> dict[str, Any]:
        """The conflist's datastore settings (``datastore``)."""
        if self.datastore == "kubernetes":
            return dict(kdd.IPAM_SETTINGS)
        return {
            "datastore_type": "etcdv3",
            "etcd_endpoints": self.endpoints(),
            "etcd_prefix": self.etcd_prefix,
        }

    def datastore_flags(self) -> list[str]:
        """tabbyctl's datastore flags, as an operator's: on the Kubernetes datastore, the
        admin's kubeconfig."""
        if self.datastore != "kubernetes":
            return super().datastore_flags()
        return ["--datastore-type", "kubernetes", "--kubeconfig", str(self.admin_kubeconfig)]

    def install_kdd(self) -> None:
        """The manifest's CRDs, accounts, roles and the plugins' token Secret applied; the
        plugins' kubeconfig (the ``tabby-cni`` token) written into every node as the
        manifest's installer writes it; tabby-node's (its account's) kept for agent_argv.
        (On a lab still on etcd: what a migration to the Kubernetes datastore needs first.)"""
        self.apply(kdd.manifest_documents(kdd.SETUP_KINDS))
        for crd in kdd.manifest_documents({"CustomResourceDefinition"}):
            name = crd["metadata"]["name"]
            self.kubectl("wait", "--for=condition=Established", "--timeout=60s", f"crd/{name}")

        def cni_token() -> str | None:
            import base64

            secret = self.kubectl_json("get", "secret", "-n", kdd.NAMESPACE, kdd.CNI_SECRET)
            token = (secret.get("data") or {}).get("token")
            return base64.b64decode(token).decode() if token else None

        token = self.wait_for("the plugins' token (Secret tabby-cni-token)", cni_token, 60)
        plugins = kdd.cni_kubeconfig(self.api_server, self.ca_file.read_bytes(), token)
        for kn in self.kube.values():
            fd = os.open(kn.path(kdd.CNI_KUBECONFIG), os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            with os.fdopen(fd, "w", encoding="utf-8") as f:
                json.dump(plugins, f)
        self.node_kubeconfig = self.kubeconfig_for_service_account(kdd.NAMESPACE, kdd.NODE_ACCOUNT)

    def switch_to_kdd(self, n: LabNode) -> None:
        """One node of a lab on etcd moved to the Kubernetes datastore, as a rolling restart
        of the DaemonSet does it (after ``install_kdd`` and ``tabbyctl datastore migrate``):
        the conflist replaced atomically (the installer's), tabby-node stopped (SIGTERM) and
        started again with its account's kubeconfig; returns when it is ready."""
        kn = self.kube_node(n)
        final = kn.path(knode.CONFLIST)
        tmp = final.with_name(final.name + ".new")
        tmp.write_text(json.dumps(knode.conflist(dict(kdd.IPAM_SETTINGS)), indent=2) + "\n")
        os.replace(tmp, final)
        self.stop_agent(n)
        self.start_agent(n)
        self.wait_agent(n)
        deadline = time.monotonic() + 90
        while self.health(n)[0] != 200:
            if time.monotonic() > deadline:
                raise LabError(f"tabby-node on {n.name} not ready on the Kubernetes datastore")
            time.sleep(0.2)

    def _make_pki(self) -> None:
        self.kube_dir.mkdir(mode=0o700)
        self._pki = pki.Pki(self.kube_dir / "pki", self.prefix)
        first = str(self.nodes[0].ipv4.ip)
        self.pki.issue(
            "apiserver",
            "kube-apiserver",
            sans=(
                *pki.ip_sans(first, "127.0.0.1", _service_ip(SERVICE_CIDR)),
                "DNS:localhost",
                "DNS:kubernetes",
                "DNS:kubernetes.default",
                "DNS:kubernetes.default.svc",
                "DNS:kubernetes.default.svc.cluster.local",
            ),
            server=True,
        )
        self.pki.issue(
            "apiserver-kubelet-client",
            "kube-apiserver-kubelet-client",
            groups=("system:masters",),
        )
        self.pki.service_account_keys()
        clients = {
            "admin": ("tabby-lab-admin", ("system:masters",)),
            "controller-manager": ("system:kube-controller-manager", ()),
            "scheduler": ("system:kube-scheduler", ()),
        }
        for stem, (user, groups) in clients.items():
            pair = self.pki.issue(stem, user, groups=groups)
            pki.write_kubeconfig(
                self.kube_dir / f"{stem}.conf", self.api_server, self.ca_file, user, client=pair
            )
        for n in self.nodes:
            user = f"system:node:{n.name}"
            pair = self.pki.issue(f"kubelet-{n.name}", user, groups=("system:nodes",))
            pki.write_kubeconfig(
                self.kube_dir / f"kubelet-{n.name}.conf",
                self.api_server,
                self.ca_file,
                user,
                client=pair,
            )
            self.pki.issue(
                f"kubelet-{n.name}-serving",
                n.name,
                sans=(*pki.ip_sans(str(n.ipv4.ip)), f"DNS:{n.name}"),
                server=True,
            )

    def _start_apiserver(self) -> None:
        d, first = self.pki.dir, self.nodes[0]
        argv = [
            str(self.binary("kube-apiserver")),
            f"--advertise-address={first.ipv4.ip}",
            f"--secure-port={API_PORT}",
            "--insecure-port=0",
            f"--etcd-servers={','.join(self.endpoints())}",
            f"--tls-cert-file={d / 'apiserver.crt'}",
            f"--tls-private-key-file={d / 'apiserver.key'}",
            f"--client-ca-file={self.ca_file}",
            f"--kubelet-client-certificate={d / 'apiserver-kubelet-client.crt'}",
            f"--kubelet-client-key={d / 'apiserver-kubelet-client.key'}",
            f"--kubelet-certificate-authority={self.ca_file}",
            "--kubelet-preferred-address-types=InternalIP",
            f"--service-account-key-file={d / 'sa.pub'}",
            f"--service-account-signing-key-file={d / 'sa.key'}",
            f"--service-account-issuer={pki.SERVICE_ACCOUNT_ISSUER}",
            f"--service-cluster-ip-range={SERVICE_CIDR}",
            "--authorization-mode=Node,RBAC",
            "--enable-admission-plugins=NodeRestriction",
            "--allow-privileged=true",
            "--profiling=false",
            f"--cert-dir={self.kube_dir / 'apiserver'}",
        ]
        self.apiserver = self._control(argv, "kube-apiserver.log")

    def _control(self, argv: list[str], log: str) -> subprocess.Popen[bytes]:
        kn = self.kube[self.nodes[0].name]
        proc = self.spawn([*kn.enter(), *argv], str(self.kube_dir / log), env=knode.frozen_env())
        self.control_plane.append(proc)
        return proc

    def pod_netns(self, namespace: str, name: str) -> str:
        """A pod's sandbox network namespace as a path the host can open (through its
        node's mount namespace; the netns its IPAM allocation recorded)."""
        report = json.loads(self.tabbyctl("ipam", "show", "-o", "json").stdout)
        for a in report["allocations"]:
            if a["pod"] == f"{namespace}/{name}" and a.get("netns"):
                inside = str(a["netns"])
                # /var/run is a symlink to /run: resolved inside the node, not on the host
                if inside.startswith("/var/run/"):
                    inside = inside.removeprefix("/var")
                return str(self.kube_node(a["node"]).path(inside))
        raise LabError(f"no allocation of {namespace}/{name} records its namespace")

    # -- faults, for the tier ---------------------------------------------------------------------

    def restart_apiserver(self) -> None:
        """Stop kube-apiserver (every watch on it breaks) and start it again; ready when
        this returns."""
        self.stop_apiserver()
        self.start_apiserver()

    def stop_apiserver(self) -> None:
        """Stop kube-apiserver (by its PID): nothing answers on its port until
        :meth:`start_apiserver`."""
        old = self.apiserver
        if old is not None:
            stop_all([old], STOP_GRACE)
            self.control_plane.remove(old)
            self.apiserver = None

    def start_apiserver(self) -> None:
        """Start kube-apiserver again; ready when this returns."""
        self._start_apiserver()
        self._wait_apiserver()

    def etcd_keys(self) -> list[str]:
        """Every key in the lab's etcd (Kubernetes' ``/registry/...`` and, on etcd, tabby's
        prefix)."""
        import base64

        netns, url = self.nodes[0].netns, self.endpoints()[0]
        request = {"key": base64.b64encode(b"\0").decode(), "range_end": "AA==", "keys_only": True}
        code, body = http_get(netns, f"{url}/v3/kv/range", body=json.dumps(request).encode())
        if code != 200:
            raise LabError(f"etcd range: {code} {body[:200]!r}")
        kvs = json.loads(body).get("kvs") or []
        return [base64.b64decode(kv["key"]).decode(errors="replace") for kv in kvs]

    def stop_kubelet(self, which: LabNode | str) -> None:
        """Stop a node's kubelet (its pods keep running, nobody tears them down)."""
        kn = self.kube_node(which)
        if kn.kubelet is not None:
            stop_all([kn.kubelet], STOP_GRACE)
            kn.kubelet = None

    def start_kubelet(self, which: LabNode | str) -> None:
        kn = self.kube_node(which)
        if kn.kubelet is None or kn.kubelet.poll() is not None:
            self._start_kubelet(kn)

    def compact_etcd(self) -> int:
        """Compact etcd's history up to now (a watch from an older resourceVersion gets
        410 Gone from then on); the revision compacted."""
        import base64

        netns, url = self.nodes[0].netns, self.endpoints()[0]
        key = base64.b64encode(b"/registry").decode()
        code, body = http_get(netns, f"{url}/v3/kv/range", body=json.dumps({"key": key}).encode())
        if code != 200:
            raise LabError(f"etcd range: {code} {body[:200]!r}")
        revision = int(json.loads(body)["header"]["revision"])
        request = json.dumps({"revision": revision, "physical": True}).encode()
        code, body = http_get(netns, f"{url}/v3/kv/compaction", body=request, timeout=10)
        if code != 200:
            raise LabError(f"etcd compaction: {code} {body[:200]!r}")
        return revision

    def _start_controllers(self) -> None:
        d = self.pki.dir
        cm = self.kube_dir / "controller-manager.conf"
        self._control(
            [
                str(self.binary("kube-controller-manager")),
                f"--kubeconfig={cm}",
                "--port=0",  # no health endpoints (insecure or secure): nothing asks them
                "--secure-port=0",
                "--leader-elect=false",
                "--use-service-account-credentials=true",
                "--controllers=*,-cloud-node-lifecycle",
                f"--root-ca-file={self.ca_file}",
                f"--service-account-private-key-file={d / 'sa.key'}",
                f"--cluster-signing-cert-file={self.ca_file}",
                f"--cluster-signing-key-file={self.pki.ca.key}",
                f"--flex-volume-plugin-dir={self.kube_dir / 'flexvolume'}",
                f"--cluster-name={self.prefix}",
                "--profiling=false",
            ],
            "kube-controller-manager.log",
        )
        sched = self.kube_dir / "scheduler.conf"
        self._control(
            [
                str(self.binary("kube-scheduler")),
                f"--kubeconfig={sched}",
                "--port=0",
                "--secure-port=0",
                "--leader-elect=false",
                "--profiling=false",
            ],
            "kube-scheduler.log",
        )

    def _wait_apiserver(self, timeout: float = 60) -> None:
        context = ssl.create_default_context(cafile=str(self.ca_file))
        netns = self.nodes[0].netns
        url = f"{self.api_server}/readyz"

        def ready() -> bool:
            for proc in self.control_plane:
                if proc.poll() is not None:
                    raise Broken(
                        f"kube-apiserver exited: {_tail(self.kube_dir / 'kube-apiserver.log')}"
                    )
            return http_get(netns, url, timeout=2, context=context)[0] == 200

        self.wait_for("kube-apiserver /readyz", ready, timeout, interval=0.2)

    def _containerd_config(self, kn: KubeNode) -> Path:
        assert self.pause is not None
        path = Path(kn.node.workdir) / "containerd.toml"
        path.write_text(knode.containerd_config(self.pause.ref, self.containerd_log_level))
        return path

    def _import_images(self) -> None:
        assert self.pause is not None
        assert self.busybox is not None
        socket_up = {kn.name: False for kn in self.kube.values()}

        def up() -> bool:
            for kn in self.kube.values():
                assert kn.containerd is not None
                if kn.containerd.poll() is not None:
                    log = _tail(Path(kn.node.workdir) / "containerd.log")
                    raise Broken(f"containerd on {kn.name} exited: {log}")
                socket_up[kn.name] = socket_up[kn.name] or kn.path(knode.CONTAINERD_SOCKET).exists()
            return all(socket_up.values())

        self.wait_for("containerd's socket on every node", up, timeout=30, interval=0.1)

        def load(kn: KubeNode) -> None:
            for image in (self.pause, self.busybox):
                assert image is not None
                proc = self.run_on(
                    kn.name,
                    [
                        *("ctr", "--address", knode.CONTAINERD_SOCKET, "-n", "k8s.io"),
                        *("images", "import", "--snapshotter", "overlayfs", str(image.archive)),
                    ],
                    timeout=120,
                )
                if proc.returncode != 0:
                    raise LabError(f"ctr images import on {kn.name}: {proc.stderr.strip()}")

        _parallel(load, list(self.kube.values()))

    def _start_kubelet(self, kn: KubeNode) -> None:
        assert self.pause is not None
        d = self.pki.dir
        config = Path(kn.node.workdir) / "kubelet.json"
        config.write_text(
            json.dumps(
                knode.kubelet_config(
                    kn,
                    self.ca_file,
                    d / f"kubelet-{kn.name}-serving.crt",
                    d / f"kubelet-{kn.name}-serving.key",
                ),
                indent=2,
            )
        )
        kn.kubelet = self.spawn(
            knode.kubelet_argv(
                kn,
                self.binary("kubelet"),
                config,
                self.kube_dir / f"kubelet-{kn.name}.conf",
                self.pause.ref,
            ),
            os.path.join(kn.node.workdir, "kubelet.log"),
            env=knode.frozen_env(),
        )

    def _nodes_ready(self) -> bool:
        for kn in self.kube.values():
            if kn.kubelet is not None and kn.kubelet.poll() is not None:
                log = _tail(Path(kn.node.workdir) / "kubelet.log")
                raise Broken(f"kubelet on {kn.name} exited: {log}")
        items = self.kubectl_json("get", "nodes")["items"]
        ready = {
            i["metadata"]["name"]
            for i in items
            if any(
                c["type"] == "Ready" and c["status"] == "True"
                for c in i.get("status", {}).get("conditions", [])
            )
        }
        return ready == set(self.kube)

    def node_conditions(self) -> dict[str, dict[str, str]]:
        """Every registered node's conditions: name -> {type: status}."""
        items = self.kubectl_json("get", "nodes")["items"]
        return {
            i["metadata"]["name"]: {
                c["type"]: c["status"] for c in i.get("status", {}).get("conditions", [])
            }
            for i in items
        }

    def nodes_registered(self) -> bool:
        """Every node's kubelet has registered its Node (Ready or not)."""
        for kn in self.kube.values():
            if kn.kubelet is not None and kn.kubelet.poll() is not None:
                log = _tail(Path(kn.node.workdir) / "kubelet.log")
                raise Broken(f"kubelet on {kn.name} exited: {log}")
        return set(self.node_conditions()) == set(self.kube)

    def nodes_ready(self) -> bool:
        """Every node Ready (the public name of what build() waits for)."""
        return self._nodes_ready()

    def _default_token_ready(self) -> bool:
        sa = self.kubectl("get", "serviceaccount", "default", "-o", "json", check=False)
        return sa.returncode == 0 and bool(json.loads(sa.stdout).get("secrets"))

    # -- tabby-node inside the node's namespaces -------------------------------------------------

    def agent_argv(self, n: LabNode) -> list[str]:
        """tabby-node as docs/node.md tells an operator to run it: its defaults (socket
        /run/tabby/node.sock, state /var/lib/tabby, the node name from
        /var/lib/tabby/nodename), the datastore from the conflist."""
        kn = self.kube_node(n)
        kubeconfig = self.node_kubeconfig
        return [
            *kn.enter(),
            *self.tabby_node,
            *("--backend", self.backend, "--conf", knode.CONFLIST),
            *(("--kubeconfig", str(kubeconfig)) if kubeconfig is not None else ()),
            *self.node_args,
        ]

    def start_agent(self, n: LabNode) -> None:
        n.agent = self.spawn(
            self.agent_argv(n), os.path.join(n.workdir, "node.err"), env=knode.frozen_env()
        )

    def wait_agent(self, n: LabNode, timeout: float = 60) -> None:
        kn = self.kube_node(n)
        self.wait_for(
            f"tabby-node's socket on {n.name}",
            lambda: self._agent_up(kn),
            timeout,
            interval=0.05,
        )

    def _agent_up(self, kn: KubeNode) -> bool:
        agent = kn.node.agent
        if agent is None or agent.poll() is not None:
            raise Broken(f"tabby-node on {kn.name} exited: {self._tail(kn.node, 'node.err')}")
        return kn.path("/run/tabby/node.sock").exists()

    # -- tearing down ------------------------------------------------------------------------------

    def teardown(self) -> list[str]:
        try:
            return self._teardown()
        finally:
            while self._ns_pins:
                os.close(self._ns_pins.pop())

    def _teardown(self) -> list[str]:
        t0 = time.monotonic()
        problems: list[str] = []
        self._log("stopping kubelets and the control plane")
        kubelets = [kn.kubelet for kn in self.kube.values() if kn.kubelet is not None]
        stop_all([*self.extra, *kubelets, *self.control_plane], STOP_GRACE)
        for kn in self.kube.values():
            stuck = knode.kill_cgroup(kn.cgroup_root)
            problems += [f"pod process {pid} on {kn.name} would not die" for pid in stuck]
        self._log("stopping containerd and tabby-node")
        stop_all(
            [
                p
                for kn in self.kube.values()
                for p in (kn.containerd, kn.node.agent)
                if p is not None
            ],
            10,
        )
        for kn in self.kube.values():
            if kn.mnt_ns:
                kill_namespace(kn.mnt_ns, keep=kn.holder.pid if kn.holder else None)
        stop_all([kn.holder for kn in self.kube.values() if kn.holder is not None], 2)
        self._log("stopping etcd, deleting namespaces and files")
        problems += super().teardown()
        for kn in self.kube.values():
            left = knode.remove_cgroup_root(kn.cgroup_root)
            problems += [f"cgroup {c}" for c in left]
        problems += self.leftovers()
        self.timings["teardown"] = round(time.monotonic() - t0, 2)
        self._log(f"torn down in {self.timings['teardown']:.1f} s")
        return problems

    def leftovers(self) -> list[str]:
        """Anything of this lab still on the machine: processes (in its namespaces, or
        naming its work directory or prefix), mounts, cgroups, network namespaces, and
        tabby's links or nftables tables in the machine's own network namespace."""
        found: list[str] = []
        mnt = {kn.mnt_ns for kn in self.kube.values() if kn.mnt_ns}
        net = {f"net:[{i}]" for i in self._netns_inodes}
        markers = [m for m in (self.workdir, self.prefix) if m]
        for pid, argv in processes():
            try:
                in_ns = os.readlink(f"/proc/{pid}/ns/mnt") in mnt or (
                    os.readlink(f"/proc/{pid}/ns/net") in net
                )
            except OSError:
                continue
            if in_ns or any(m in argv for m in markers):
                found.append(f"process {pid}: {argv[:160]}")
        for point, fstype, source, root in knode.mounts():
            if any(m in point or m in source for m in markers) or (
                fstype == "nsfs" and root in net
            ):
                found.append(f"mount {point} ({fstype} {source})")
        for kn in self.kube.values():
            found += [
                f"cgroup {h + kn.cgroup_root}"
                for h in knode.hierarchies()
                if os.path.isdir(h + kn.cgroup_root)
            ]
        if os.path.isdir("/run/netns"):
            found += [
                f"namespace {n}" for n in os.listdir("/run/netns") if n.startswith(self.prefix)
            ]
        after = host_state() if self._host_before else {}  # (none when build() never began)
        for kind, names in after.items():
            for name in sorted(names - self._host_before.get(kind, set())):
                if _looks_like_tabby(name, self.prefix):
                    found.append(f"{kind} {name} in the machine's network namespace")
        return found


# -- helpers ---------------------------------------------------------------------------------------


def _service_ip(cidr: str) -> str:
    import ipaddress

    return str(next(ipaddress.ip_network(cidr).hosts()))


def _tail(path: Path, limit: int = 1500) -> str:
    try:
        return path.read_text(errors="replace")[-limit:]
    except OSError:
        return ""


def _parallel(fn: Callable[[Any], None], items: list[Any]) -> None:
    with ThreadPoolExecutor(max_workers=max(1, len(items))) as pool:
        for f in [pool.submit(fn, i) for i in items]:
            f.result()


def stop_all(procs: list[subprocess.Popen[bytes]], grace: float) -> None:
    """SIGTERM every live process of ``procs`` (ours: stopped by PID) at once, SIGKILL what
    is still there after ``grace`` seconds."""
    live = [p for p in procs if p.poll() is None]
    for p in live:
        with contextlib.suppress(ProcessLookupError):
            p.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + grace
    for p in live:
        try:
            p.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()


def processes() -> Iterator[tuple[int, str]]:
    me = os.getpid()
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == me:
            continue
        try:
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                argv = f.read().replace(b"\0", b" ").decode(errors="replace").strip()
        except OSError:
            continue
        yield int(entry), argv


def kill_namespace(mnt_ns: str, keep: int | None = None, timeout: float = 5) -> None:
    """SIGKILL, by PID, every process in mount namespace ``mnt_ns`` (a node's: containerd's
    shims, BIRD, anything a test started there) but ``keep`` (the holder)."""
    deadline = time.monotonic() + timeout
    while True:
        pids = []
        for pid, _ in processes():
            with contextlib.suppress(OSError):
                if pid != keep and os.readlink(f"/proc/{pid}/ns/mnt") == mnt_ns:
                    pids.append(pid)
        if not pids or time.monotonic() > deadline:
            return
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        time.sleep(0.05)


def host_state() -> dict[str, set[str]]:
    """Links and nftables tables of the machine's own network namespace."""
    state: dict[str, set[str]] = {"link": set(), "nft table": set()}
    proc = run(["ip", "-j", "link", "show"], capture_output=True, text=True)
    with contextlib.suppress(ValueError):
        state["link"] = {str(i.get("ifname")) for i in json.loads(proc.stdout or "[]")}
    proc = run(["nft", "-j", "list", "tables"], capture_output=True, text=True)
    with contextlib.suppress(ValueError):
        for item in json.loads(proc.stdout or "{}").get("nftables", []):
            if "table" in item:
                state["nft table"].add(f"{item['table']['family']} {item['table']['name']}")
    return state


def _looks_like_tabby(name: str, prefix: str) -> bool:
    short = prefix[-6:]
    return name.startswith(("cali", "tunl", "vxlan", short)) or "tabby" in name or prefix in name


@contextlib.contextmanager
def kube_lab(**kwargs: Any) -> Iterator[KubeLab]:
    """A built KubeLab, torn down afterwards whatever happens (Ctrl-C included when the
    caller installed tabbyctl.demo.proc.INTERRUPTS)."""
    lab = KubeLab(**kwargs)
    try:
        lab.build()
        yield lab
    except BaseException:
        lab.teardown()
        raise
    problems = lab.teardown()
    if problems:
        raise LabError(f"the teardown left: {problems}")
