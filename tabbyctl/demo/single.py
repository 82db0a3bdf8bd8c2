"""``tabbyctl demo``: a pod network in throwaway network namespaces, driven like a runtime.

A "node" namespace plays the host; each pod is a namespace of its own. The installed
plugin binaries are exec'd exactly as libcni does (CNI_* env, the conflist's plugin config
with name/cniVersion injected on stdin, the cached ADD result as prevResult for CHECK and
DEL), inside the node namespace. The demo uses its own network name and a temporary
store, so it never touches a real node's state, and removes everything it made, also on
Ctrl-C or SIGTERM.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import subprocess
import tempfile
import time
from dataclasses import dataclass, field

from bundle.types import JSON
from datastore import Store
from stores import open_store
from tabbyctl.demo.proc import INTERRUPTS, Echo, LabError, signals_restored
from tabbyctl.demo.proc import run as run_child

NODE_V4 = "192.168.255.1"  # the node's own address (on its lo), a source for node->pod
NODE_V6 = "fd00:255::1"
V4_POOL = "10.244.0.0/16"
V6_POOL = "fd00:10:244::/48"


@dataclass
class Pod:
    name: str
    netns: str
    container_id: str
    result: JSON | None = None
    add_ms: float = 0.0

    def addresses(self) -> list[str]:
        if not self.result:
            return []
        return [ip["address"].split("/")[0] for ip in self.result.get("ips", [])]

    def host_veth(self) -> str:
        if not self.result:
            return "-"
        for itf in self.result.get("interfaces", []):
            if not itf.get("sandbox"):
                return str(itf["name"])
        return "-"


@dataclass
class Demo:
    pods_wanted: int
    cni_bin: str
    echo: Echo
    node_socket: str | None = None
    demo_id: str = field(default_factory=lambda: secrets.token_hex(3))
    workdir: str = ""
    node_ns: str = ""
    pods: list[Pod] = field(default_factory=list)
    made_netns: list[str] = field(default_factory=list)
    node_proc: subprocess.Popen[bytes] | None = None

    @property
    def network(self) -> str:
        return f"tabby-demo-{self.demo_id}"

    def conflist(self) -> JSON:
        return {
            "cniVersion": "1.1.0",
            "name": self.network,
            "plugins": [
                {
                    "type": "tabby",
                    "mtu": 1500,
                    "nodename": "demo-node",
                    "log_level": "info",
                    "log_file_path": os.path.join(self.workdir, "cni.log"),
                    "ipam": {
                        "type": "tabby-ipam",
                        "assign_ipv4": True,
                        "assign_ipv6": True,
                        "ipv4_pools": [V4_POOL],
                        "ipv6_pools": [V6_POOL],
                        "data_dir": os.path.join(self.workdir, "ipam"),
                    },
                }
            ],
        }

    # -- namespaces ------------------------------------------------------------------

    def _ip(self, *args: str, ns: str | None = None, check: bool = True) -> str:
        cmd = ["ip", *(["-n", ns] if ns else []), *args]
        proc = run_child(cmd, capture_output=True, text=True)
        if check and proc.returncode != 0:
            raise LabError(f"`{' '.join(cmd)}` failed: {proc.stderr.strip()}")
        return str(proc.stdout)

    def _sysctl(self, ns: str, key: str, value: str) -> None:
        run_child(
            ["ip", "netns", "exec", ns, "sysctl", "-qw", f"{key}={value}"], capture_output=True
        )

    def make_netns(self, name: str) -> None:
        # Recorded first: a signal while `ip netns add` runs must not leave it unrecorded.
        self.made_netns.append(name)
        try:
            self._ip("netns", "add", name)
        except LabError:
            self.made_netns.remove(name)  # not made (it may be someone else's)
            raise
        self._ip("link", "set", "lo", "up", ns=name)

    def make_node(self) -> None:
        self.node_ns = f"{self.network}-node"
        self.make_netns(self.node_ns)
        ns = self.node_ns
        self._ip("addr", "add", f"{NODE_V4}/32", "dev", "lo", ns=ns)
        self._ip("-6", "addr", "add", f"{NODE_V6}/128", "dev", "lo", "nodad", ns=ns)
        # Proxy ARP answers for 169.254.1.1 only if the node has a unicast route to it out
        # of another interface: a real node has its default route, this one needs this.
        self._ip("route", "add", "169.254.1.1/32", "dev", "lo", ns=ns)
        self._sysctl(ns, "net.ipv4.ip_forward", "1")
        self._sysctl(ns, "net.ipv6.conf.all.forwarding", "1")

    # -- CNI calls, as libcni makes them ---------------------------------------------

    def plugin_stdin(self, pod: Pod, with_prev: bool) -> bytes:
        conflist = self.conflist()
        conf = dict(conflist["plugins"][0])
        conf["name"] = conflist["name"]
        conf["cniVersion"] = conflist["cniVersion"]
        if with_prev and pod.result is not None:
            conf["prevResult"] = pod.result
        return json.dumps(conf).encode()

    def cni(self, command: str, pod: Pod, *, with_prev: bool = True) -> tuple[int, bytes]:
        env = {
            "PATH": os.environ.get("PATH", "/usr/sbin:/usr/bin:/sbin:/bin"),
            "CNI_COMMAND": command,
            "CNI_CONTAINERID": pod.container_id,
            "CNI_NETNS": pod.netns,
            "CNI_IFNAME": "eth0",
            "CNI_PATH": self.cni_bin,
            "CNI_ARGS": f"IgnoreUnknown=1;K8S_POD_NAMESPACE=demo;K8S_POD_NAME={pod.name};"
            f"K8S_POD_INFRA_CONTAINER_ID={pod.container_id}",
        }
        if self.node_socket:
            env["TABBY_NODE_SOCKET"] = self.node_socket
        from dataplane.netns import setns

        node_fd = os.open(f"/run/netns/{self.node_ns}", os.O_RDONLY | os.O_CLOEXEC)
        try:
            proc = run_child(
                [os.path.join(self.cni_bin, "tabby")],
                input=self.plugin_stdin(pod, with_prev),
                env=env,
                capture_output=True,
                preexec_fn=lambda: setns(node_fd),
                pass_fds=(node_fd,),
            )
        finally:
            os.close(node_fd)
        if proc.returncode != 0:
            return proc.returncode, proc.stdout
        return 0, proc.stdout

    # -- the job ---------------------------------------------------------------------

    def add_pods(self) -> None:
        for n in range(1, self.pods_wanted + 1):
            name = f"pod{n}"
            netns_name = f"{self.network}-{name}"
            self.make_netns(netns_name)
            pod = Pod(
                name=name, netns=f"/run/netns/{netns_name}", container_id=f"{self.network}-{name}"
            )
            self.pods.append(pod)
            t0 = time.perf_counter()
            rc, out = self.cni("ADD", pod, with_prev=False)
            pod.add_ms = (time.perf_counter() - t0) * 1000
            if rc != 0:
                raise LabError(f"ADD {name} failed: {out.decode(errors='replace').strip()}")
            try:
                result = json.loads(out)
                Pod(name, pod.netns, pod.container_id, result).addresses()
            except (ValueError, TypeError, KeyError, AttributeError):
                text = out.decode(errors="replace").strip()[:200]
                raise LabError(f"ADD {name} printed no CNI result: {text!r}") from None
            pod.result = result
            self.echo(
                f"  [{n}/{self.pods_wanted}] {name:<6} {' '.join(pod.addresses()):<40} "
                f"host veth {pod.host_veth()}  ADD {pod.add_ms:.0f} ms"
            )

    def check_pods(self) -> None:
        for pod in self.pods:
            rc, out = self.cni("CHECK", pod)
            if rc != 0:
                raise LabError(f"CHECK {pod.name} failed: {out.decode(errors='replace')}")
        self.echo(f"  CHECK passed for {len(self.pods)} pods")

    def ping(self, ns: str, address: str) -> bool:
        proc = run_child(
            ["ip", "netns", "exec", ns, "ping", "-c1", "-W2", "-q", address], capture_output=True
        )
        return proc.returncode == 0

    def reachability(self) -> bool:
        ok = True
        rows: list[str] = []
        for src in self.pods:
            src_ns = os.path.basename(src.netns)
            for dst in self.pods:
                if dst is src:
                    continue
                for addr in dst.addresses():
                    good = self.ping(src_ns, addr)
                    ok &= good
                    rows.append(
                        f"  {src.name} -> {dst.name} {addr:<28} {'ok' if good else 'UNREACHABLE'}"
                    )
        for dst in self.pods:
            for addr in dst.addresses():
                good = self.ping(self.node_ns, addr)
                ok &= good
                rows.append(f"  node -> {dst.name} {addr:<30} {'ok' if good else 'UNREACHABLE'}")
        for r in rows:
            self.echo(r)
        return ok

    def ipam_view(self) -> None:
        from tabbyctl import views

        data_dir = self.conflist()["plugins"][0]["ipam"]["data_dir"]
        for line in views.render_ipam_summary(_store(data_dir), show_blocks=True):
            self.echo("  " + line)

    def delete_pods(self) -> list[str]:
        problems = []
        for pod in self.pods:
            if pod.result is None:
                # a failed ADD is still followed by a DEL, as the spec says
                self.cni("DEL", pod, with_prev=False)
                continue
            rc, out = self.cni("DEL", pod)
            if rc != 0:
                problems.append(f"DEL {pod.name}: {out.decode(errors='replace').strip()}")
            else:
                pod.result = None
        return problems

    def leftovers(self) -> list[str]:
        found = []
        if self.node_ns in self.made_netns:
            links = self._ip("-o", "link", "show", ns=self.node_ns, check=False)
            for line in links.splitlines():
                name = line.split(":")[1].strip().split("@")[0] if ":" in line else ""
                if name.startswith("cali"):
                    found.append(f"host veth {name}")
            for fam in ("-4", "-6"):
                routes = self._ip(fam, "route", "show", ns=self.node_ns, check=False)
                for line in routes.splitlines():
                    if "dev cali" in line:
                        found.append(f"route {line.strip()}")
        from tabbyctl import views

        data_dir = self.conflist()["plugins"][0]["ipam"]["data_dir"]
        if os.path.isdir(data_dir):
            found += [f"allocation {a}" for a in views.allocated_addresses(_store(data_dir))]
        return found

    def cleanup(self) -> None:
        for name in reversed(self.made_netns):
            run_child(["ip", "netns", "del", name], capture_output=True)
        self.made_netns.clear()
        if self.workdir:
            shutil.rmtree(self.workdir, ignore_errors=True)


def _start_node(demo: Demo) -> None:
    """tabby-node on the demo's own socket, so the demo shows the fast path a node uses.

    The process is recorded in ``demo.node_proc`` before any interrupt can be raised, so
    the cleanup always stops it.
    """
    binary = shutil.which("tabby-node")
    if binary is None:
        demo.echo("tabby-node not found: the plugins do the work in-process")
        return
    run_dir = os.path.join(demo.workdir, "run")
    sock = os.path.join(run_dir, "node.sock")
    # In the demo's node namespace, on the demo's own store: its nftables table (policy),
    # state files and datastore are the demo's, never the machine's.
    argv = [
        *("ip", "netns", "exec", demo.node_ns, binary),
        *("--nodename", "demo-node", "--backend", "none", "--socket", sock),
        *("--run-dir", run_dir, "--state-dir", os.path.join(demo.workdir, "state")),
        *("--data-dir", os.path.join(demo.workdir, "ipam")),
        *("--metrics-port", "0", "--health-port", "0"),
        *("--log-file", os.path.join(demo.workdir, "node.log")),
    ]
    with INTERRUPTS.deferred(), open(os.path.join(demo.workdir, "node.err"), "wb") as log:
        demo.node_proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=log)
    proc = demo.node_proc
    deadline = time.monotonic() + 15
    while not os.path.exists(sock):
        if proc.poll() is not None or time.monotonic() > deadline:
            _stop_node(proc)
            demo.node_proc = None
            demo.echo("tabby-node did not start: the plugins do the work in-process")
            return
        time.sleep(0.05)
    demo.node_socket = sock
    demo.echo(f"tabby-node (pid {proc.pid}) serves the calls on {sock}")


def _stop_node(proc: subprocess.Popen[bytes] | None) -> None:
    """By PID: SIGTERM, then SIGKILL if it does not finish in time."""
    if proc is None or proc.poll() is not None:
        return
    proc.terminate()
    try:
        proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def run(
    pods: int,
    keep: bool,
    cni_bin: str,
    echo: Echo,
    node_socket: str | None = None,
    use_node: bool = True,
) -> int:
    _check_machine(cni_bin)
    demo = Demo(pods_wanted=pods, cni_bin=cni_bin, echo=echo, node_socket=node_socket)
    demo.workdir = tempfile.mkdtemp(prefix=f"{demo.network}-")
    os.chmod(demo.workdir, 0o700)
    ok = False
    interrupted = False
    with signals_restored():
        try:
            with INTERRUPTS.installed():
                ok = _show(demo, use_node)
                if keep:
                    _stop_node(demo.node_proc)
                    echo(
                        f"--keep: namespaces {', '.join(demo.made_netns)} and {demo.workdir} "
                        "are left in place; remove them with `ip netns del NAME` and `rm -r`."
                    )
                    return 0 if ok else 1
        except KeyboardInterrupt:
            interrupted = True
            echo("interrupted: cleaning up")
        except LabError as e:
            echo(f"demo failed: {e}")
            ok = False
        finally:
            if not keep or interrupted or not ok:
                ok = _tear_down(demo, interrupted) and ok
    if interrupted:
        return 130
    echo("demo passed" if ok else "demo FAILED")
    return 0 if ok else 1


def _check_machine(cni_bin: str) -> None:
    """Root, the installed plugins and the tools the demo runs (a LabError if not)."""
    if os.geteuid() != 0:
        raise LabError("the demo creates network namespaces: run it as root")
    for binary in ("tabby", "tabby-ipam"):
        path = os.path.join(cni_bin, binary)
        if not os.access(path, os.X_OK):
            raise LabError(f"{path} not found or not executable: run ./build.sh first")
    for tool in ("ip", "ping"):
        if shutil.which(tool) is None:
            raise LabError(f"`{tool}` is missing: apt-get install iproute2 iputils-ping")


def _show(demo: Demo, use_node: bool) -> bool:
    """The demo's steps: the node, tabby-node (unless ``use_node`` is off or a socket was
    given), ADD and CHECK of every pod, reachability, the IPAM view. Whether every pod
    reached every other."""
    echo = demo.echo
    echo(
        f"tabby demo {demo.network}: node namespace + {demo.pods_wanted} pods, "
        f"pools {V4_POOL} and {V6_POOL}"
    )
    demo.make_node()
    if use_node and demo.node_socket is None:
        _start_node(demo)
    elif demo.node_socket is None:
        demo.node_socket = "off"
    echo(f"ADD (the installed {demo.cni_bin}/tabby, exec'd as a runtime does):")
    demo.add_pods()
    demo.check_pods()
    echo("reachability (ping):")
    reach = demo.reachability()
    echo("IPAM:")
    demo.ipam_view()
    return reach


def _tear_down(demo: Demo, interrupted: bool) -> bool:
    """DEL of every pod, tabby-node stopped, every namespace and file removed; False when
    something was left behind (each one said)."""
    problems = demo.delete_pods()
    left = demo.leftovers()
    _stop_node(demo.node_proc)
    demo.cleanup()
    for p in problems + left:
        demo.echo(f"  left behind: {p}")
    if problems or left:
        return False
    if not interrupted:
        demo.echo("DEL: every pod removed; no namespace, veth, route or allocation left")
    return True


def _store(data_dir: str) -> Store:
    """The demo's own file store (never a real node's)."""
    from cni_config.common import DatastoreSettings

    return open_store(DatastoreSettings(data_dir=data_dir, lock_timeout_seconds=5))
