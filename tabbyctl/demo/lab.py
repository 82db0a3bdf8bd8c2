"""A throwaway tabby cluster on one machine, built from network namespaces.

Used by the cluster demo (``tabbyctl demo --nodes N``, :mod:`tabbyctl.demo.cluster`), and
beyond the product by the cluster test tier, the benches and the Kubernetes lab
(``lab.kubernetes``)::

    fabric namespace    bridge br0: the underlay every node is plugged into
    node namespaces     eth0 (veth into br0) with an IPv4 (and IPv6) underlay address,
                        forwarding on; the first 3 (1 when there are 2 nodes) run an etcd
                        member each; every node runs tabby-node (--backend bird|vxlan)
    pod namespaces      made by the installed CNI binaries, exec'd inside their node's
                        namespace exactly as a runtime on that node would, served by that
                        node's tabby-node

Everything the lab starts is recorded before it can be interrupted and stopped by PID
(etcd, tabby-node, and BIRD, which tabby-node starts in a session of its own); every
namespace is deleted and the work directory removed, also on Ctrl-C. Nothing is touched
outside the lab's namespaces and work directory.
"""

from __future__ import annotations

import contextlib
import ipaddress
import json
import os
import secrets
import shutil
import signal
import ssl
import subprocess
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from bundle.types import JSON
from tabbyctl.demo.proc import INTERRUPTS, Echo, LabError, run, stop_process

UNDERLAY_V4 = "10.{subnet}.{lab}.{host}/24"
UNDERLAY_V6 = "fd00:{subnet}:{lab}::{host}/64"
SUBNETS = (250, 251)  # the underlay subnets (the second one only with subnets=2)
V4_POOL = "10.244.0.0/16"
V6_POOL = "fd00:10:244::/48"
NETWORK = "k8s-pod-network"
CLIENT_PORT = 2379
PEER_PORT = 2380


@dataclass
class LabPod:
    node: str
    namespace: str
    name: str
    netns: str
    container_id: str
    result: JSON | None = None

    def addresses(self, version: int | None = None) -> list[str]:
        out = []
        for ip in (self.result or {}).get("ips", []):
            addr = ip["address"].split("/")[0]
            if version is None or ipaddress.ip_address(addr).version == version:
                out.append(addr)
        return out

    @property
    def label(self) -> str:
        return f"{self.namespace}/{self.name}@{self.node}"


@dataclass
class LabNode:
    name: str
    netns: str
    index: int
    ipv4: ipaddress.IPv4Interface
    ipv6: ipaddress.IPv6Interface | None
    workdir: str
    etcd: subprocess.Popen[bytes] | None = None
    agent: subprocess.Popen[bytes] | None = None

    @property
    def run_dir(self) -> str:
        return os.path.join(self.workdir, "run")

    @property
    def socket(self) -> str:
        return os.path.join(self.run_dir, "node.sock")

    @property
    def state_dir(self) -> str:
        return os.path.join(self.workdir, "state")

    @property
    def log(self) -> str:
        return os.path.join(self.workdir, "node.log")

    def bird_pid(self) -> int | None:
        try:
            with open(os.path.join(self.run_dir, "bird.pid"), encoding="ascii") as f:
                return int(f.read().strip())
        except (OSError, ValueError):
            return None


@dataclass
class Lab:
    nodes_wanted: int
    backend: str = "bird"
    ipv6: bool = True
    echo: Echo = print
    cni_bin: str = "/opt/cni/bin"
    tabby_node: list[str] = field(default_factory=lambda: [_which("tabby-node")])
    tabbyctl_bin: list[str] = field(default_factory=lambda: [_which("tabbyctl")])
    etcd_members: int | None = None
    subnets: int = 1
    lab_id: str = field(default_factory=lambda: secrets.token_hex(3))
    workdir: str = ""
    nodes: list[LabNode] = field(default_factory=list)
    pods: list[LabPod] = field(default_factory=list)
    made_netns: list[str] = field(default_factory=list)
    processes: list[subprocess.Popen[bytes]] = field(default_factory=list)
    node_args: list[str] = field(default_factory=list)
    #: more tabby-node flags for one node (e.g. its own metrics certificate)
    node_args_for: Callable[[LabNode], list[str]] | None = None

    # -- names and addresses ------------------------------------------------------------

    @property
    def prefix(self) -> str:
        return f"tbylab{self.lab_id}"

    @property
    def fabric(self) -> str:
        return f"{self.prefix}-fab"

    @property
    def etcd_prefix(self) -> str:
        return f"/tabby-lab-{self.lab_id}"

    def _subnet_byte(self) -> int:
        return int(self.lab_id, 16) % 200 + 20

    def endpoints(self) -> list[str]:
        return [f"http://{n.ipv4.ip}:{CLIENT_PORT}" for n in self.nodes[: self.members()]]

    def members(self) -> int:
        if self.etcd_members is not None:
            return self.etcd_members
        return 1 if self.nodes_wanted <= 2 else 3

    def datastore_flags(self) -> list[str]:
        return [
            "--datastore-type",
            "etcdv3",
            "--etcd-endpoints",
            ",".join(self.endpoints()),
            "--etcd-prefix",
            self.etcd_prefix,
        ]

    # -- commands -------------------------------------------------------------------------

    def _ip(self, *args: str, ns: str | None = None, check: bool = True) -> str:
        cmd = ["ip", *(["-n", ns] if ns else []), *args]
        proc = run(cmd, capture_output=True, text=True)
        if check and proc.returncode != 0:
            raise LabError(f"`{' '.join(cmd)}` failed: {proc.stderr.strip()}")
        return str(proc.stdout)

    def in_ns(self, ns: str, *cmd: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
        return run(
            ["ip", "netns", "exec", ns, *cmd], capture_output=True, text=True, timeout=timeout
        )

    def _sysctl(self, ns: str, key: str, value: str) -> None:
        self.in_ns(ns, "sysctl", "-qw", f"{key}={value}")

    def make_netns(self, name: str) -> None:
        self.made_netns.append(name)  # recorded first: an interrupt must not lose it
        try:
            self._ip("netns", "add", name)
        except LabError:
            self.made_netns.remove(name)
            raise
        self._ip("link", "set", "lo", "up", ns=name)

    def spawn(
        self, argv: list[str], log_path: str, env: dict[str, str] | None = None
    ) -> subprocess.Popen[bytes]:
        """A daemon, recorded before an interrupt can be raised (stopped by PID)."""
        with INTERRUPTS.deferred(), open(log_path, "ab") as log:
            # A session of its own: a Ctrl-C at the terminal reaches the demo (which tears the
            # lab down in order), not etcd and tabby-node behind its back.
            proc = subprocess.Popen(
                argv,
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                start_new_session=True,
                env=env,
            )
            self.processes.append(proc)
        return proc

    # -- building ---------------------------------------------------------------------------

    def build(self) -> None:
        """Underlay, nodes, etcd; then tabby-node on every node (ready when this returns)."""
        self.build_underlay()
        self.start_agents()

    def build_underlay(self) -> None:
        """The fabric bridge, the node namespaces plugged into it, etcd on the first nodes."""
        self._locks_before = _lock_files()
        if not self.workdir:
            self.workdir = tempfile.mkdtemp(prefix=f"{self.prefix}-")
            os.chmod(self.workdir, 0o700)
        self.make_netns(self.fabric)
        self._ip("link", "add", "br0", "type", "bridge", ns=self.fabric)
        self._ip("link", "set", "br0", "up", ns=self.fabric)
        lab = self._subnet_byte()
        if self.subnets > 1:
            # The fabric routes between the underlay subnets (a router between two racks).
            for subnet in SUBNETS[: self.subnets]:
                gw4 = UNDERLAY_V4.format(subnet=subnet, lab=lab, host=1)
                gw6 = UNDERLAY_V6.format(subnet=subnet, lab=lab, host=1)
                self._ip("addr", "add", gw4, "dev", "br0", ns=self.fabric)
                self._ip("-6", "addr", "add", gw6, "dev", "br0", "nodad", ns=self.fabric)
            self._sysctl(self.fabric, "net.ipv4.ip_forward", "1")
            self._sysctl(self.fabric, "net.ipv6.conf.all.forwarding", "1")
        for i in range(self.nodes_wanted):
            name = f"node-{i + 1}"
            ns = f"{self.prefix}-n{i + 1}"
            subnet = self.subnet_of(i)
            node = LabNode(
                name=name,
                netns=ns,
                index=i,
                ipv4=ipaddress.IPv4Interface(
                    UNDERLAY_V4.format(subnet=subnet, lab=lab, host=10 + i)
                ),
                ipv6=ipaddress.IPv6Interface(
                    UNDERLAY_V6.format(subnet=subnet, lab=lab, host=10 + i)
                )
                if self.ipv6
                else None,
                workdir=os.path.join(self.workdir, name),
            )
            os.makedirs(node.workdir, mode=0o700)
            self.make_netns(ns)
            self.nodes.append(node)
            self._plug(node)
        self.start_etcd()

    def start_agents(self) -> None:
        """tabby-node on every node; returns when each serves its socket."""
        for node in self.nodes:
            self.start_agent(node)
        for node in self.nodes:
            self.wait_agent(node)

    def subnet_of(self, index: int) -> int:
        """The underlay subnet of node ``index``: with two subnets, the last node is alone
        in the second one."""
        if self.subnets > 1 and index == self.nodes_wanted - 1:
            return SUBNETS[1]
        return SUBNETS[0]

    def _plug(self, node: LabNode) -> None:
        fab_end = f"{self.prefix[-6:]}f{node.index + 1}"
        self._ip(
            "link",
            "add",
            "eth0",
            "netns",
            node.netns,
            "type",
            "veth",
            "peer",
            "name",
            fab_end,
            "netns",
            self.fabric,
        )
        self._ip("link", "set", fab_end, "master", "br0", "up", ns=self.fabric)
        self._ip("addr", "add", str(node.ipv4), "dev", "eth0", ns=node.netns)
        if node.ipv6 is not None:
            self._ip("-6", "addr", "add", str(node.ipv6), "dev", "eth0", "nodad", ns=node.netns)
        self._ip("link", "set", "eth0", "up", ns=node.netns)
        if self.subnets > 1:
            lab, subnet = self._subnet_byte(), self.subnet_of(node.index)
            gw4 = UNDERLAY_V4.format(subnet=subnet, lab=lab, host=1).split("/")[0]
            self._ip("route", "add", "default", "via", gw4, ns=node.netns)
            if node.ipv6 is not None:
                gw6 = UNDERLAY_V6.format(subnet=subnet, lab=lab, host=1).split("/")[0]
                self._ip("-6", "route", "add", "default", "via", gw6, ns=node.netns)
        # Proxy ARP answers for the pods' gateway 169.254.1.1 only with a unicast route to it
        # out of another interface (a real node has its default route).
        self._ip("route", "add", "169.254.1.1/32", "dev", "lo", ns=node.netns)
        self._sysctl(node.netns, "net.ipv4.ip_forward", "1")
        self._sysctl(node.netns, "net.ipv6.conf.all.forwarding", "1")

    def start_etcd(self) -> None:
        if shutil.which("etcd") is None:
            raise LabError("etcd is missing: apt-get install etcd-server")
        members = self.nodes[: self.members()]
        cluster = ",".join(f"m{n.index + 1}=http://{n.ipv4.ip}:{PEER_PORT}" for n in members)
        for node in members:
            data = os.path.join(node.workdir, "etcd")
            os.makedirs(data, mode=0o700)
            argv = [
                *("ip", "netns", "exec", node.netns, "etcd"),
                *("--name", f"m{node.index + 1}", "--data-dir", data),
                "--listen-client-urls",
                f"http://{node.ipv4.ip}:{CLIENT_PORT},http://127.0.0.1:{CLIENT_PORT}",
                *("--advertise-client-urls", f"http://{node.ipv4.ip}:{CLIENT_PORT}"),
                *("--listen-peer-urls", f"http://{node.ipv4.ip}:{PEER_PORT}"),
                *("--initial-advertise-peer-urls", f"http://{node.ipv4.ip}:{PEER_PORT}"),
                *("--initial-cluster", cluster, "--initial-cluster-state", "new"),
                *("--initial-cluster-token", self.prefix),
                *("--heartbeat-interval", "100", "--election-timeout", "1000"),
                "--logger=zap",
                "--log-level=warn",
            ]
            node.etcd = self.spawn(argv, os.path.join(node.workdir, "etcd.log"))
        deadline = time.monotonic() + 30
        for node in members:
            while not self._etcd_healthy(node):
                assert node.etcd is not None
                if node.etcd.poll() is not None or time.monotonic() > deadline:
                    raise LabError(
                        f"etcd on {node.name} is not healthy: {self._tail(node, 'etcd.log')}"
                    )
                time.sleep(0.1)

    def _etcd_healthy(self, node: LabNode) -> bool:
        code, body = http_get(node.netns, f"http://127.0.0.1:{CLIENT_PORT}/health", 1)
        return code == 200 and b'"health":"true"' in body.replace(b" ", b"")

    def agent_argv(self, node: LabNode) -> list[str]:
        argv = [
            *("ip", "netns", "exec", node.netns, *self.tabby_node),
            *("--nodename", node.name, "--node-ip", str(node.ipv4)),
            *(("--node-ip6", str(node.ipv6)) if node.ipv6 is not None else ()),
            *("--backend", self.backend),
            *("--state-dir", node.state_dir, "--run-dir", node.run_dir),
            *("--log-file", node.log, "--log-level", "info"),
            *("--ipv4-pool", V4_POOL),
            *(("--ipv6-pool", V6_POOL) if self.ipv6 else ()),
            *("--node-ttl", "30"),
            *self.datastore_flags(),
            *self.node_args,
            *(self.node_args_for(node) if self.node_args_for is not None else ()),
        ]
        return argv

    def start_agent(self, node: LabNode) -> None:
        os.makedirs(node.run_dir, mode=0o700, exist_ok=True)
        node.agent = self.spawn(self.agent_argv(node), os.path.join(node.workdir, "node.err"))

    def wait_agent(self, node: LabNode, timeout: float = 60) -> None:
        deadline = time.monotonic() + timeout
        while not os.path.exists(node.socket):
            assert node.agent is not None
            if node.agent.poll() is not None or time.monotonic() > deadline:
                raise LabError(
                    f"tabby-node on {node.name} did not start: {self._tail(node, 'node.err')}"
                )
            time.sleep(0.05)

    def health(self, node: LabNode, which: str = "readiness") -> tuple[int, JSON]:
        code, body = http_get(node.netns, f"http://127.0.0.1:9099/{which}")
        try:
            return code, json.loads(body or b"{}")
        except ValueError:
            return 0, {}

    def wait_ready(self, timeout: float = 60) -> None:
        deadline = time.monotonic() + timeout
        pending = list(self.nodes)
        while pending:
            pending = [n for n in pending if self.health(n)[0] != 200]
            if not pending:
                return
            if time.monotonic() > deadline:
                reasons = {n.name: self.health(n)[1].get("reasons") for n in pending}
                raise LabError(f"not ready: {reasons}")
            time.sleep(0.2)

    def _tail(self, node: LabNode, name: str, limit: int = 1500) -> str:
        try:
            with open(os.path.join(node.workdir, name), encoding="utf-8", errors="replace") as f:
                return f.read()[-limit:]
        except OSError:
            return ""

    # -- pods, as a runtime on the node makes them ----------------------------------------------

    def conf(self, node: LabNode) -> JSON:
        return {
            "cniVersion": "1.0.0",
            "name": NETWORK,
            "type": "tabby",
            "nodename": node.name,
            "mtu": 0,
            "log_file_path": os.path.join(node.workdir, "cni.log"),
            "ipam": {
                "type": "tabby-ipam",
                "assign_ipv4": True,
                "assign_ipv6": self.ipv6,
                "ipv4_pools": [V4_POOL],
                "ipv6_pools": [V6_POOL],
                "datastore_type": "etcdv3",
                "etcd_endpoints": self.endpoints(),
                "etcd_prefix": self.etcd_prefix,
                "lock_timeout_seconds": 10,
            },
        }

    def cni(
        self,
        node: LabNode,
        command: str,
        pod: LabPod,
        prev: JSON | None = None,
        *,
        socket: str | None = None,
        extra_args: str = "",
    ) -> tuple[int, JSON | None]:
        conf = self.conf(node)
        if prev is not None:
            conf["prevResult"] = prev
        env = {
            "PATH": os.environ.get("PATH", "/usr/sbin:/usr/bin:/sbin:/bin"),
            "CNI_COMMAND": command,
            "CNI_CONTAINERID": pod.container_id,
            "CNI_NETNS": f"/run/netns/{pod.netns}",
            "CNI_IFNAME": "eth0",
            "CNI_PATH": self.cni_bin,
            "CNI_ARGS": f"K8S_POD_NAMESPACE={pod.namespace};K8S_POD_NAME={pod.name}"
            + (f";{extra_args}" if extra_args else ""),
            "TABBY_NODE_SOCKET": socket or node.socket,
        }
        proc = run(
            ["ip", "netns", "exec", node.netns, os.path.join(self.cni_bin, "tabby")],
            input=json.dumps(conf).encode(),
            capture_output=True,
            env=env,
            timeout=120,
        )
        out = proc.stdout.decode().strip()
        try:
            parsed = json.loads(out) if out else None
        except ValueError:
            parsed = {"code": -1, "msg": out[:500]}
        return proc.returncode, parsed

    def new_pod(self, node: LabNode, namespace: str, name: str) -> LabPod:
        """A pod's namespace on ``node``, recorded in the lab (its teardown DELs and deletes
        it); no ADD yet."""
        pod = LabPod(
            node=node.name,
            namespace=namespace,
            name=name,
            netns=f"{self.prefix}-{node.name}-{namespace}-{name}"[:60],
            container_id=secrets.token_hex(16),
        )
        self.make_netns(pod.netns)
        self.pods.append(pod)
        return pod

    def add_pod(self, node: LabNode, namespace: str, name: str, ip: str | None = None) -> LabPod:
        """A pod on ``node`` (``ip``: ask for that address, as CNI_ARGS IP= does)."""
        pod = self.new_pod(node, namespace, name)
        rc, out = self.cni(node, "ADD", pod, extra_args=f"IP={ip}" if ip else "")
        if rc != 0 or out is None:
            raise LabError(f"ADD of {pod.label} failed: {out}")
        pod.result = out
        return pod

    def del_pod(self, pod: LabPod) -> None:
        node = self.node(pod.node)
        rc, out = self.cni(node, "DEL", pod, pod.result)
        if rc != 0:
            raise LabError(f"DEL of {pod.label} failed: {out}")
        pod.result = None
        self._ip("netns", "delete", pod.netns, check=False)
        if pod.netns in self.made_netns:
            self.made_netns.remove(pod.netns)
        self.pods.remove(pod)

    def node(self, name: str) -> LabNode:
        for n in self.nodes:
            if n.name == name:
                return n
        raise LabError(f"no node {name}")

    # -- checks -------------------------------------------------------------------------------

    def ping(self, src_netns: str, address: str, count: int = 1, wait: float = 1.0) -> bool:
        version = ipaddress.ip_address(address).version
        proc = self.in_ns(
            src_netns,
            "ping",
            f"-{version}",
            "-c",
            str(count),
            "-W",
            str(wait),
            "-i",
            "0.2",
            "-q",
            address,
        )
        return proc.returncode == 0

    def ping_until(self, src_netns: str, address: str, timeout: float = 15) -> float | None:
        """Seconds until the first answer, None if none within ``timeout``."""
        start = time.monotonic()
        while time.monotonic() - start < timeout:
            if self.ping(src_netns, address, wait=0.5):
                return time.monotonic() - start
        return None

    def matrix(self, families: tuple[int, ...] = (4, 6)) -> list[str]:
        """Every pod pings every other pod (and itself is skipped), in parallel; the
        failures ("a -> b (ip)")."""
        from concurrent.futures import ThreadPoolExecutor

        jobs = [
            (src, dst, addr)
            for src in self.pods
            for dst in self.pods
            if src is not dst
            for addr in dst.addresses()
            if ipaddress.ip_address(addr).version in families
        ]

        def one(job: tuple[LabPod, LabPod, str]) -> str | None:
            src, dst, addr = job
            if self.ping(src.netns, addr, count=1, wait=2) or self.ping(
                src.netns, addr, count=2, wait=2
            ):
                return None
            return f"{src.label} -> {dst.label} ({addr})"

        with ThreadPoolExecutor(max_workers=16) as pool:
            return [r for r in pool.map(one, jobs) if r]

    def tabbyctl(self, *args: str, node: LabNode | None = None) -> subprocess.CompletedProcess[str]:
        node = node or self.nodes[0]
        return self.in_ns(node.netns, *self.tabbyctl_bin, *self.datastore_flags(), *args)

    def routes(self, node: LabNode, family: int = 4) -> str:
        return self._ip(f"-{family}", "route", "show", ns=node.netns, check=False)

    # -- tearing down -----------------------------------------------------------------------------

    def stop_agent(self, node: LabNode, sig: int = signal.SIGTERM) -> None:
        if node.agent is not None:
            stop_process(node.agent, sig)

    def kill_bird(self, node: LabNode) -> None:
        pid = node.bird_pid()
        if pid is not None and _is_bird(pid, node.run_dir):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
            _wait_gone(pid)

    def teardown(self) -> list[str]:
        """Remove every pod (DEL through the binaries), stop every process by PID, delete
        every namespace and the work directory; what could not be removed."""
        problems: list[str] = []
        for pod in list(self.pods):
            try:
                self.del_pod(pod)  # also after a failed ADD, as runtimes do
            except Exception as e:
                problems.append(f"pod {pod.label}: {e}")
        for node in self.nodes:
            self.stop_agent(node)
        for node in self.nodes:
            self.kill_bird(node)
        for proc in reversed(self.processes):
            if proc.poll() is None:
                proc.terminate()
                try:
                    proc.wait(timeout=15)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()
        for ns in reversed(self.made_netns):
            run(["ip", "netns", "delete", ns], capture_output=True)
        left = [ns for ns in self.made_netns if os.path.exists(f"/run/netns/{ns}")]
        problems += [f"namespace {ns}" for ns in left]
        self.made_netns.clear()
        if self.workdir:
            shutil.rmtree(self.workdir, ignore_errors=True)
        _remove_lock_files(_lock_files() - getattr(self, "_locks_before", set()))
        return problems


#: Where the etcd store's node-local lock files are (datastore/etcd.py's default).
LOCK_DIR = "/run/tabby/locks"


def _lock_files() -> set[str]:
    try:
        return {n for n in os.listdir(LOCK_DIR) if n.startswith("etcd-")}
    except OSError:
        return set()


def _remove_lock_files(names: set[str]) -> None:
    """The lock files of the lab's own datastore (its prefix is its own: nobody else uses
    them), each removed only when nobody holds it."""
    import fcntl

    for name in names:
        path = os.path.join(LOCK_DIR, name)
        try:
            fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC)
        except OSError:
            continue
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            os.unlink(path)
        except OSError:
            pass
        finally:
            os.close(fd)


def _which(name: str) -> str:
    path = shutil.which(name)
    return path or f"/usr/local/bin/{name}"


def _is_bird(pid: int, run_dir: str) -> bool:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            argv = f.read().split(b"\0")
    except OSError:
        return False
    return (
        bool(argv) and os.path.basename(argv[0]) == b"bird" and run_dir.encode() in b" ".join(argv)
    )


def _wait_gone(pid: int, timeout: float = 5) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return
        time.sleep(0.05)


def http_get(
    netns: str,
    url: str,
    timeout: float = 3,
    body: bytes | None = None,
    context: ssl.SSLContext | None = None,
) -> tuple[int, bytes]:
    """GET ``url`` (POST ``body`` when given) from inside namespace ``netns`` (a thread that
    entered it and ends): (HTTP status, body), status 0 when nothing answered. ``context``:
    the TLS context of an https URL."""
    import threading
    import urllib.error
    import urllib.request

    result: list[tuple[int, bytes]] = []

    def work() -> None:
        from dataplane.netns import setns

        fd = os.open(f"/run/netns/{netns}", os.O_RDONLY | os.O_CLOEXEC)
        try:
            setns(fd)
        finally:
            os.close(fd)
        try:
            request = urllib.request.Request(url, data=body)  # noqa: S310 (the lab's URL)
            with urllib.request.urlopen(request, timeout=timeout, context=context) as r:  # noqa: S310
                result.append((int(r.status), bytes(r.read())))
        except urllib.error.HTTPError as e:
            result.append((int(e.code), bytes(e.read())))
        except (OSError, ValueError) as e:
            result.append((0, str(e).encode()))

    thread = threading.Thread(target=work, daemon=True)
    thread.start()
    thread.join(timeout + 2)
    return result[0] if result else (0, b"timed out")
