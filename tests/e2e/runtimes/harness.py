"""Plumbing for the runtime e2e tier: a throwaway node, the plugin flavour, and small probes.

The node
--------
Every runtime (our libcni driver, podman, containerd) runs inside a *node*: a network namespace
plus a private mount namespace, held open by one `sleep` process that the session starts and
kills by PID. Inside the node:

- `/run/netns`, `/var/lib/cni`, `/run/containerd`, `/run/tabby` and `/var/lib/containers`
  are private tmpfs mounts, so pod namespaces, libcni result caches, shim sockets and podman's
  blob cache made by any runtime never show up on the machine and die with the node, and a
  tabby-node running on the machine is not reachable from the node's plugins;
- `lo` is up and an `uplink0` veth with a global address leads to a *sink* namespace that
  forwards nothing; the node's default route points there. So the node looks like a real one
  (a default route makes proxy ARP for 169.254.1.1 work, MASQUERADE finds a source address),
  while every packet stays inside namespaces this session made;
- IPv4 and IPv6 forwarding are on, as on any Kubernetes node.

iptables rules (portmap's chains) and routes the plugins add live in the node's network
namespace, not the machine's. Tests still remove what they created and the per-test guard in
conftest.py checks that nothing is left behind.
"""

from __future__ import annotations

import contextlib
import ipaddress
import json
import os
import re
import secrets
import shlex
import signal
import subprocess
import sys
import time
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[3]
TOOLS_BIN = REPO / "tests" / "e2e" / "tools" / "bin"
EXAMPLES = REPO / "conf-examples"

# Where tabby and tabby-ipam are installed; TABBY_E2E_BIN_DIR points elsewhere (a build's
# output) without installing.
TABBY_BIN_DIR = Path(os.environ.get("TABBY_E2E_BIN_DIR", "/opt/cni/bin"))
DEBIAN_CNI_DIR = Path("/usr/lib/cni")

POOL_V4 = ipaddress.ip_network("10.244.0.0/16")
POOL_V6 = ipaddress.ip_network("fd00:10:244::/48")
# A pool small enough to exhaust with a handful of pods (tests fill it until ADD fails).
TINY_V4 = ipaddress.ip_network("10.244.255.0/30")

NODE_NAME = "e2e-node"
# Directories the node overlays with its own tmpfs: pod netns mounts, libcni result caches,
# containerd shim sockets, and tabby-node's socket dir (a tabby-node running on the machine
# must not serve the node's plugin calls: it would work in the machine's namespaces).
PRIVATE_DIRS = (
    Path("/run/netns"),
    Path("/var/lib/cni"),
    Path("/run/containerd"),
    Path("/run/tabby"),
    Path("/var/lib/containers"),
)
UPLINK_NODE = "198.18.0.1/30"  # on uplink0 in the node
UPLINK_SINK = "198.18.0.2/30"  # on uplink1 in the sink namespace


def unique(prefix: str) -> str:
    return f"{prefix}{secrets.token_hex(4)}"


def run(
    args: Sequence[str],
    *,
    check: bool = True,
    timeout: float = 60,
    env: dict[str, str] | None = None,
    input: str | None = None,
) -> subprocess.CompletedProcess[str]:
    proc = subprocess.run(
        list(args),
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env,
        input=input,
        stdin=None if input is not None else subprocess.DEVNULL,
    )
    if check and proc.returncode != 0:
        raise AssertionError(
            f"command failed ({proc.returncode}): {' '.join(args)}\n"
            f"stdout: {proc.stdout.strip()}\nstderr: {proc.stderr.strip()}"
        )
    return proc


def wait_for(what: str, probe: Any, timeout: float = 10.0, interval: float = 0.1) -> Any:
    """Call probe() until it returns something truthy; fail after timeout."""
    deadline = time.monotonic() + timeout
    last: Any = None
    while True:
        try:
            last = probe()
        except (AssertionError, OSError, subprocess.SubprocessError) as exc:
            last = exc
        else:
            if last:
                return last
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}: {last!r}")
        time.sleep(interval)


def stop_pid(proc: subprocess.Popen[Any] | None, *, grace: float = 10.0) -> None:
    """SIGTERM one process we started, then SIGKILL it if it does not go."""
    if proc is None or proc.poll() is not None:
        return
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(grace)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(5)


def kill_pid(pid: int, *, grace: float = 5.0) -> None:
    """SIGTERM then SIGKILL a process (by PID) that is not our child, e.g. a shim or conmon."""
    try:
        os.kill(pid, signal.SIGTERM)
    except ProcessLookupError:
        return
    deadline = time.monotonic() + grace
    while time.monotonic() < deadline:
        if not Path(f"/proc/{pid}").exists():
            return
        time.sleep(0.05)
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGKILL)


def pids_with_cmdline(needle: str) -> list[int]:
    """PIDs whose command line contains needle (a unique temp path: never a broad name)."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if needle in cmdline:
            found.append(int(entry.name))
    return found


def mounts_under(path: Path) -> list[str]:
    prefix = str(path).rstrip("/") + "/"
    out = []
    for line in Path("/proc/self/mountinfo").read_text().splitlines():
        mnt = line.split()[4].replace("\\040", " ")
        if mnt == str(path) or mnt.startswith(prefix):
            out.append(mnt)
    return out


def unmount_under(path: Path) -> list[str]:
    """Lazily unmount everything at or below path (deepest first); return what was there."""
    found = mounts_under(path)
    for mnt in sorted(found, key=len, reverse=True):
        subprocess.run(["umount", "-l", mnt], capture_output=True, check=False)
    return found


# --------------------------------------------------------------------------------------------
# The node
# --------------------------------------------------------------------------------------------


class Node:
    """A throwaway node (network + mount namespace) held by one sleeper process."""

    def __init__(self) -> None:
        self.holder: subprocess.Popen[bytes] | None = None
        self.sink = unique("tbe2e-sink-")
        self._made_dirs: list[Path] = []

    @property
    def pid(self) -> int:
        assert self.holder is not None
        return self.holder.pid

    def start(self) -> None:
        for d in PRIVATE_DIRS:
            if not d.exists():
                d.mkdir(parents=True)
                self._made_dirs.append(d)
        self.holder = subprocess.Popen(
            ["unshare", "--mount", "--net", "--propagation", "private", "--", "sleep", "infinity"],
            stdin=subprocess.DEVNULL,
        )
        own_net = os.readlink("/proc/self/ns/net")

        def ready() -> bool:
            assert self.holder is not None
            assert self.holder.poll() is None, "node holder died"
            comm = Path(f"/proc/{self.pid}/comm").read_text().strip()
            return comm == "sleep" and os.readlink(f"/proc/{self.pid}/ns/net") != own_net

        wait_for("node namespaces", ready, timeout=5)
        self.sh(f"""
            set -e
            mount -t tmpfs -o mode=0755 tabby-e2e-netns /run/netns
            mount -t tmpfs -o mode=0700 tabby-e2e-cni /var/lib/cni
            mount -t tmpfs -o mode=0711 tabby-e2e-containerd /run/containerd
            mount -t tmpfs -o mode=0755 tabby-e2e-tabby /run/tabby
            mount -t tmpfs -o mode=0700 tabby-e2e-containers /var/lib/containers
            ip link set lo up
            ip netns add {self.sink}
            ip -n {self.sink} link set lo up
            ip link add uplink0 type veth peer name uplink1 netns {self.sink}
            ip addr add {UPLINK_NODE} dev uplink0
            ip link set uplink0 up
            ip -n {self.sink} addr add {UPLINK_SINK} dev uplink1
            ip -n {self.sink} link set uplink1 up
            ip route add default via {UPLINK_SINK.split("/")[0]}
            sysctl -qw net.ipv4.ip_forward=1 net.ipv6.conf.all.forwarding=1
            """)

    def stop(self) -> None:
        if self.holder is not None:
            with contextlib.suppress(AssertionError):
                self.sh(f"ip netns del {self.sink}", check=False)
            stop_pid(self.holder, grace=5)
            self.holder = None
        for d in reversed(self._made_dirs):
            with contextlib.suppress(OSError):
                d.rmdir()

    # ---- running things inside the node ----

    def cmd(self, args: Sequence[str]) -> list[str]:
        return ["nsenter", "-t", str(self.pid), "-m", "-n", "--", *args]

    def run(self, args: Sequence[str], **kw: Any) -> subprocess.CompletedProcess[str]:
        return run(self.cmd(args), **kw)

    def sh(self, script: str, **kw: Any) -> subprocess.CompletedProcess[str]:
        return self.run(["sh", "-c", script], **kw)

    def popen(self, args: Sequence[str], **kw: Any) -> subprocess.Popen[Any]:
        return subprocess.Popen(self.cmd(args), **kw)

    def in_pod(self, netns: str, args: Sequence[str]) -> list[str]:
        """Command line that runs args inside pod namespace netns (a name or a path)."""
        name = netns.rsplit("/", 1)[-1]
        return self.cmd(["ip", "netns", "exec", name, *args])

    def run_in_pod(
        self,
        netns: str,
        args: Sequence[str],
        **kw: Any,
    ) -> subprocess.CompletedProcess[str]:
        return run(self.in_pod(netns, args), **kw)

    # ---- pod namespaces (for the libcni driver; runtimes make their own) ----

    def netns_add(self, name: str) -> str:
        self.run(["ip", "netns", "add", name])
        self.run(["ip", "-n", name, "link", "set", "lo", "up"])
        return f"/run/netns/{name}"

    def netns_del(self, name: str) -> None:
        self.run(["ip", "netns", "del", name], check=False)

    def netns_list(self) -> list[str]:
        out = self.run(["ip", "-j", "netns", "list"]).stdout.strip()
        names = [n["name"] for n in json.loads(out)] if out else []
        return sorted(n for n in names if n != self.sink)

    # ---- state probes ----

    def links(self) -> list[str]:
        out = self.run(["ip", "-j", "link", "show"]).stdout
        return sorted(link["ifname"] for link in json.loads(out))

    def extra_links(self) -> list[str]:
        return [name for name in self.links() if name not in ("lo", "uplink0")]

    def routes(self, family: str = "-4") -> list[dict[str, Any]]:
        out = self.run(["ip", "-j", family, "route", "show", "table", "all"]).stdout
        return list(json.loads(out)) if out.strip() else []

    def pod_routes(self) -> list[str]:
        """Routes into the pod pools left in the node. Blackhole/unreachable routes are not
        counted: a Calico-style node may keep one per affine block after its pods are gone."""
        found = []
        for family in ("-4", "-6"):
            for r in self.routes(family):
                if r.get("type") in ("blackhole", "unreachable", "prohibit"):
                    continue
                dst = r.get("dst", "")
                if dst in ("default", "") or ("/" not in dst and ":" not in dst and "." not in dst):
                    continue
                with contextlib.suppress(ValueError):
                    net = ipaddress.ip_network(dst, strict=False)
                    pool = POOL_V4 if net.version == 4 else POOL_V6
                    if net.subnet_of(pool):  # type: ignore[arg-type]
                        found.append(f"{dst} {r.get('type', '')} {r.get('dev', '')}".strip())
        return found

    def iptables_save(self) -> str:
        v4 = self.run(["iptables-save"]).stdout
        v6 = self.run(["ip6tables-save"]).stdout
        return v4 + v6

    def cni_chains(self) -> list[str]:
        return sorted({m.group(1) for m in re.finditer(r"^:(CNI-\S+)", self.iptables_save(), re.M)})

    def remove_cni_chains(self) -> None:
        """Remove portmap's chains (the per-pod ones DEL leaves nothing of, and the shared
        CNI-HOSTPORT-* ones portmap never deletes) from the node's nat/filter/mangle tables."""
        for tool in ("iptables", "ip6tables"):
            for table in ("nat", "filter", "mangle"):
                rules = self.run([tool, "-t", table, "-S"], check=False).stdout.splitlines()
                chains = [r.split()[1] for r in rules if r.startswith("-N CNI-")]
                if not chains:
                    continue
                for rule in rules:
                    parts = shlex.split(rule)
                    if (
                        parts[:1] == ["-A"]
                        and parts[1] not in chains
                        and any(p.startswith("CNI-") for p in parts[2:])
                    ):
                        self.run([tool, "-t", table, "-D", *parts[1:]], check=False)
                for chain in chains:
                    self.run([tool, "-t", table, "-F", chain], check=False)
                for chain in chains:
                    self.run([tool, "-t", table, "-X", chain], check=False)

    def leftovers(self) -> list[str]:
        problems = []
        if ns := self.netns_list():
            problems.append(f"network namespaces: {ns}")
        if links := self.extra_links():
            problems.append(f"links: {links}")
        if routes := self.pod_routes():
            problems.append(f"routes into the pod pools: {routes}")
        if chains := self.cni_chains():
            problems.append(f"iptables chains: {chains}")
        return problems

    def ping(self, addr: str, *, from_pod: str | None = None, tries: int = 5) -> None:
        """One echo reply from addr (from the node, or from inside pod netns from_pod)."""
        ip = ipaddress.ip_address(addr.split("/")[0])
        args = ["ping", "-6" if ip.version == 6 else "-4", "-c", "1", "-W", "1", "-n", str(ip)]
        cmd = self.in_pod(from_pod, args) if from_pod else self.cmd(args)
        last = None
        for _ in range(tries):
            last = run(cmd, check=False, timeout=10)
            if last.returncode == 0:
                return
            time.sleep(0.2)
        assert last is not None
        where = f"pod {from_pod}" if from_pod else "the node"
        raise AssertionError(f"no echo reply from {ip} to {where}:\n{last.stdout}{last.stderr}")

    def tcp_get(
        self, host: str, port: int, payload: bytes = b"", timeout: float = 5.0
    ) -> subprocess.CompletedProcess[str]:
        """Connect from the node to host:port, send payload, return what the server answered."""
        script = (
            "import socket,sys\n"
            f"s=socket.create_connection(({host!r},{port}),timeout={timeout})\n"
            f"s.sendall({payload!r})\n"
            "s.shutdown(socket.SHUT_WR)\n"
            "data=b''\n"
            "while True:\n"
            "    chunk=s.recv(4096)\n"
            "    if not chunk: break\n"
            "    data+=chunk\n"
            "sys.stdout.write(data.decode(errors='replace'))\n"
        )
        return self.run([PYTHON, "-S", "-c", script], check=False, timeout=timeout + 5)


# Interpreter for the little client/server snippets run inside the node and the pods.
PYTHON = os.path.realpath(sys.executable)


# --------------------------------------------------------------------------------------------
# Plugin flavours
# --------------------------------------------------------------------------------------------


def load_example(filename: str) -> dict[str, Any]:
    return dict(json.loads((EXAMPLES / filename).read_text()))


EXAMPLE_FILES = {
    "ipv4": "10-tabby.conflist",
    "dualstack": "10-tabby-dualstack.conflist",
    "chained": "10-tabby-chained.conflist",
}


def _vkey(version: str) -> tuple[int, ...]:
    return tuple(int(part) for part in version.split("."))


def _as_bool(value: Any) -> bool:
    return value is True or str(value).lower() == "true"


@dataclass
class Flavor:
    """Which plugins play the pod network: tabby itself, or Debian's ptp + host-local in the
    same shape (to prove the harness without tabby)."""

    name: str
    plugin_dirs: list[str] = field(default_factory=list)

    @property
    def main_type(self) -> str:
        return "tabby" if self.name == "tabby" else "ptp"

    @property
    def ipam_type(self) -> str:
        return "tabby-ipam" if self.name == "tabby" else "host-local"

    def binaries(self) -> list[Path]:
        if self.name == "tabby":
            return [TABBY_BIN_DIR / "tabby", TABBY_BIN_DIR / "tabby-ipam"]
        return [DEBIAN_CNI_DIR / "ptp", DEBIAN_CNI_DIR / "host-local"]

    def conflist(
        self,
        example: str,
        *,
        data_dir: Path,
        log_dir: Path,
        tiny: bool = False,
        name: str | None = None,
    ) -> dict[str, Any]:
        """The example `example` (ipv4|dualstack|chained), rewritten for one test: private
        IPAM state dir, node name and log file; optionally a pool of a few addresses."""
        conf = load_example(EXAMPLE_FILES[example])
        if name:
            conf["name"] = name
        first = conf["plugins"][0]
        assert first["type"] == "tabby", "conf-examples must start with tabby"
        if self.name == "tabby":
            first["nodename"] = NODE_NAME
            first["log_file_path"] = str(log_dir / "cni.log")
            first["log_level"] = "debug"
            first["ipam"]["data_dir"] = str(data_dir)
            if tiny:
                first["ipam"].update(
                    {
                        "assign_ipv6": False,
                        "ipv4_pools": [str(TINY_V4)],
                        "block_size_ipv4": TINY_V4.prefixlen,
                        "reserved": [],
                    }
                )
            return conf
        conf["plugins"][0] = self._reference_plugin(first, data_dir, tiny)
        # Debian's reference plugins speak CNI up to 1.0.0.
        if _vkey(conf["cniVersion"]) > _vkey("1.0.0"):
            conf["cniVersion"] = "1.0.0"
        if "cniVersions" in conf:
            conf["cniVersions"] = [v for v in conf["cniVersions"] if _vkey(v) <= _vkey("1.0.0")]
        return conf

    @staticmethod
    def _reference_plugin(tabby: dict[str, Any], data_dir: Path, tiny: bool) -> dict[str, Any]:
        ipam = tabby["ipam"]
        ranges: list[list[dict[str, str]]] = []
        routes: list[dict[str, str]] = []
        if tiny:
            first = TINY_V4.network_address
            ranges.append(
                [
                    {
                        "subnet": str(ipaddress.ip_network(f"{first}/29")),
                        "rangeStart": str(first + 2),
                        "rangeEnd": str(first + 3),
                    }
                ]
            )
            routes.append({"dst": "0.0.0.0/0"})
        else:
            if _as_bool(ipam.get("assign_ipv4", True)):
                ranges.append([{"subnet": p} for p in ipam.get("ipv4_pools", [str(POOL_V4)])])
                routes.append({"dst": "0.0.0.0/0"})
            if _as_bool(ipam.get("assign_ipv6", False)):
                ranges.append([{"subnet": p} for p in ipam.get("ipv6_pools", [str(POOL_V6)])])
                routes.append({"dst": "::/0"})
        return {
            "type": "ptp",
            "mtu": tabby.get("mtu", 1500),
            "ipMasq": False,
            "ipam": {
                "type": "host-local",
                "ranges": ranges,
                "routes": routes,
                "dataDir": str(data_dir),
            },
        }

    def store_mentions(self, data_dir: Path, needles: Iterable[str]) -> list[str]:
        """Files of the IPAM store under data_dir that mention any of needles (a container ID,
        a pod name): evidence that an allocation for that attachment is still recorded.

        host-local keeps one file per address holding "<container id>\\r\\n<ifname>"; tabby's
        file store records the pod name and attachment with every allocation."""
        wanted = [n.encode() for n in needles if n]
        hits: list[str] = []
        if not data_dir.exists():
            return hits
        for path in sorted(data_dir.rglob("*")):
            if not path.is_file() or path.name in ("lock",) or path.suffix == ".lock":
                continue
            try:
                data = path.read_bytes()
            except OSError:
                continue
            hits.extend(f"{path}: {n.decode()}" for n in wanted if n in data)
        return hits


def pod_ips(result: dict[str, Any]) -> list[str]:
    """Bare addresses of a CNI result's ips (any version >= 0.3.0)."""
    return [str(ipaddress.ip_interface(ip["address"]).ip) for ip in result.get("ips", [])]


def in_pools(addr: str) -> bool:
    ip = ipaddress.ip_address(addr)
    return ip in (POOL_V4 if ip.version == 4 else POOL_V6)


# --------------------------------------------------------------------------------------------
# The libcni driver
# --------------------------------------------------------------------------------------------


@dataclass
class CniReply:
    verb: str
    returncode: int
    stdout: str
    stderr: str

    @property
    def ok(self) -> bool:
        return self.returncode == 0

    def json(self) -> dict[str, Any]:
        return dict(json.loads(self.stdout))

    def expect_ok(self) -> CniReply:
        assert self.ok, f"cnitool {self.verb} failed ({self.returncode}): {self.stderr.strip()}"
        return self

    def error(self) -> dict[str, Any]:
        """The plugin's CNI error (code, msg, details) of a failed call."""
        assert not self.ok, f"cnitool {self.verb} unexpectedly succeeded: {self.stdout}"
        assert self.stdout.strip(), f"no CNI error JSON from cnitool {self.verb}: {self.stderr}"
        return self.json()


@dataclass
class CniTool:
    """cnitool bound to one node, conflist dir, plugin path and cache dir."""

    node: Node
    conf_dir: Path
    cache_dir: Path
    plugin_dirs: list[str]
    binary: Path = TOOLS_BIN / "cnitool"
    # Attachments added and not yet deleted:
    # (network, container id, ifname) -> (netns, CNI_ARGS/CAP_ARGS env, conflist dir).
    attached: dict[tuple[str, str, str], tuple[str, dict[str, str], Path]] = field(
        default_factory=dict
    )

    def install(self, conf: dict[str, Any], filename: str = "10-tabby.conflist") -> Path:
        self.conf_dir.mkdir(parents=True, exist_ok=True)
        path = self.conf_dir / filename
        path.write_text(json.dumps(conf, indent=2) + "\n")
        return path

    def __call__(
        self,
        verb: str,
        network: str,
        netns: str,
        *,
        container_id: str,
        ifname: str = "eth0",
        cni_args: dict[str, str] | None = None,
        cap_args: dict[str, Any] | None = None,
    ) -> CniReply:
        env = dict(os.environ)
        env.pop("CNI_ARGS", None)
        env.pop("CAP_ARGS", None)
        if cni_args:
            env["CNI_ARGS"] = ";".join(f"{k}={v}" for k, v in cni_args.items())
        if cap_args:
            env["CAP_ARGS"] = json.dumps(cap_args)
        args = [
            str(self.binary),
            "--conf-dir",
            str(self.conf_dir),
            "--path",
            ":".join(self.plugin_dirs),
            "--cache-dir",
            str(self.cache_dir),
            "--ifname",
            ifname,
            "--container-id",
            container_id,
            verb,
            network,
            netns,
        ]
        proc = self.node.run(args, check=False, env=env, timeout=120)
        key = (network, container_id, ifname)
        if verb == "add":
            # Like a runtime: whatever it tried to add, it deletes (a failed ADD too).
            self.attached[key] = (
                netns,
                {k: env[k] for k in ("CNI_ARGS", "CAP_ARGS") if k in env},
                self.conf_dir,
            )
        elif verb == "del" and proc.returncode == 0:
            self.attached.pop(key, None)
        return CniReply(verb, proc.returncode, proc.stdout, proc.stderr)

    def cleanup(self) -> list[str]:
        """DEL every attachment a test left behind (after a failure); return the failures."""
        failures = []
        for (network, cid, ifname), (netns, extra, conf_dir) in list(self.attached.items()):
            env = dict(os.environ)
            env.pop("CNI_ARGS", None)
            env.pop("CAP_ARGS", None)
            env.update(extra)
            args = [
                str(self.binary),
                "--conf-dir",
                str(conf_dir),
                "--path",
                ":".join(self.plugin_dirs),
                "--cache-dir",
                str(self.cache_dir),
                "--ifname",
                ifname,
                "--container-id",
                cid,
                "del",
                network,
                netns,
            ]
            proc = self.node.run(args, check=False, env=env, timeout=120)
            if proc.returncode != 0:
                failures.append(f"DEL {network}/{cid}/{ifname}: {proc.stderr.strip()}")
            self.attached.pop((network, cid, ifname), None)
        return failures

    def validate(self, network: str) -> CniReply:
        args = [
            str(self.binary),
            "--conf-dir",
            str(self.conf_dir),
            "--path",
            ":".join(self.plugin_dirs),
            "validate",
            network,
        ]
        proc = self.node.run(args, check=False)
        return CniReply("validate", proc.returncode, proc.stdout, proc.stderr)

    def cache_file(self, network: str, container_id: str, ifname: str = "eth0") -> Path:
        return self.cache_dir / "results" / f"{network}-{container_id}-{ifname}"


@contextlib.contextmanager
def serving(
    cmd: Sequence[str], *, ready: str = "ready", timeout: float = 10.0
) -> Iterator[subprocess.Popen[str]]:
    """Run a server command (e.g. Node.in_pod(...)) until the block ends; it must print the
    line `ready` once it listens. Stopped by its PID, pipes closed."""
    with subprocess.Popen(
        list(cmd),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        stdin=subprocess.DEVNULL,
        text=True,
    ) as proc:
        try:
            assert proc.stdout is not None
            line = proc.stdout.readline().strip()
            if line != ready:
                stop_pid(proc, grace=1)
                err = proc.stderr.read() if proc.stderr else ""
                raise AssertionError(f"server did not start: {line!r} {err!r}")
            yield proc
        finally:
            stop_pid(proc, grace=3)


# --------------------------------------------------------------------------------------------
# podman (CNI backend) with a private configuration, storage and state
# --------------------------------------------------------------------------------------------


class Podman:
    """podman inside the node, configured only by files under base: containers.conf (CNI
    backend, plugin dirs, cgroupfs, runc, file events, ulimits root may set), storage.conf (vfs
    under base), its own --root/--runroot/--tmpdir and network config dir. The machine's
    /etc/containers is never read for these settings nor written."""

    IMAGE = "localhost/tabby-e2e/busybox:1"

    def __init__(self, node: Node, base: Path, plugin_dirs: list[str]) -> None:
        self.node = node
        self.base = base
        self.root = base / "root"
        self.runroot = base / "run"
        self.tmpdir = base / "tmp"
        self.net_dir = base / "net.d"
        for d in (self.root, self.runroot, self.tmpdir, self.net_dir):
            d.mkdir(parents=True, exist_ok=True)
        dirs = ", ".join(json.dumps(d) for d in plugin_dirs)
        self.containers_conf = base / "containers.conf"
        self.containers_conf.write_text(f"""\
[containers]
default_ulimits = ["nofile=20000:20000", "nproc=32768:32768"]
log_driver = "k8s-file"

[engine]
cgroup_manager = "cgroupfs"
events_logger = "file"
events_logfile_path = {json.dumps(str(base / "events.log"))}
runtime = "runc"
tmp_dir = {json.dumps(str(self.tmpdir))}

[network]
network_backend = "cni"
cni_plugin_dirs = [{dirs}]
network_config_dir = {json.dumps(str(self.net_dir))}
""")
        self.storage_conf = base / "storage.conf"
        self.storage_conf.write_text(f"""\
[storage]
driver = "vfs"
graphroot = {json.dumps(str(self.root))}
runroot = {json.dumps(str(self.runroot))}
""")
        self.registries_conf = base / "registries.conf"
        self.registries_conf.write_text("unqualified-search-registries = []\n")

    def env(self) -> dict[str, str]:
        env = dict(os.environ)
        env.update(
            CONTAINERS_CONF=str(self.containers_conf),
            CONTAINERS_STORAGE_CONF=str(self.storage_conf),
            CONTAINERS_REGISTRIES_CONF=str(self.registries_conf),
        )
        return env

    def cmd(self, args: Sequence[str]) -> list[str]:
        return self.node.cmd(
            [
                "podman",
                "--root",
                str(self.root),
                "--runroot",
                str(self.runroot),
                "--tmpdir",
                str(self.tmpdir),
                "--storage-driver",
                "vfs",
                "--network-config-dir",
                str(self.net_dir),
                "--cgroup-manager",
                "cgroupfs",
                "--events-backend",
                "file",
                "--runtime",
                "runc",
                *args,
            ]
        )

    def __call__(
        self,
        *args: str,
        check: bool = True,
        timeout: float = 120,
    ) -> subprocess.CompletedProcess[str]:
        return run(self.cmd(args), check=check, timeout=timeout, env=self.env())

    def import_image(self, rootfs_tar: Path) -> None:
        self(
            "import",
            "--change",
            "ENTRYPOINT []",
            "--change",
            'CMD ["/pause"]',
            str(rootfs_tar),
            self.IMAGE,
        )

    def install_network(self, conf: dict[str, Any], filename: str = "10-tabby.conflist") -> None:
        (self.net_dir / filename).write_text(json.dumps(conf, indent=2) + "\n")

    def inspect(self, name: str) -> dict[str, Any]:
        return dict(json.loads(self("container", "inspect", name).stdout)[0])

    def ip_of(self, name: str, network: str) -> str:
        nets = self.inspect(name)["NetworkSettings"]["Networks"]
        assert network in nets, nets
        return str(nets[network]["IPAddress"])

    def container_ids(self) -> list[str]:
        out = self("ps", "-a", "--format", "{{.ID}}", "--no-trunc").stdout
        return out.split()

    def remove_all(self) -> None:
        if self.container_ids():
            self("rm", "--all", "--force", "--time", "0", check=False)

    def leftover_processes(self) -> list[int]:
        """conmon and container processes still tied to this podman's private dirs."""
        return pids_with_cmdline(str(self.base))


# --------------------------------------------------------------------------------------------
# containerd 1.6 with its CRI plugin, private root/state/sockets, and a CRI client
# --------------------------------------------------------------------------------------------


def cri_modules() -> tuple[Any, Any]:
    """The CRI v1 client generated by tests/e2e/tools/build.sh (pb2, pb2_grpc)."""
    path = str(TOOLS_BIN / "cri")
    if path not in sys.path:
        sys.path.insert(0, path)
    import cri_v1_pb2  # type: ignore[import-not-found, unused-ignore]
    import cri_v1_pb2_grpc  # type: ignore[import-not-found, unused-ignore]

    return cri_v1_pb2, cri_v1_pb2_grpc


# Logs each call containerd makes to the main plugin, then execs the installed plugin.
WRAPPER = """#!/bin/sh
printf '%s|%s|%s|%s|%s\\n' "$CNI_COMMAND" "$CNI_CONTAINERID" "$CNI_IFNAME" "$CNI_NETNS" \\
    "$CNI_ARGS" >> {log}
exec {real} "$@"
"""


@dataclass
class CniCall:
    command: str
    container_id: str
    ifname: str
    netns: str
    args: str


class Containerd:
    """containerd (CRI plugin on) inside the node, on its own root, state, sockets and CNI
    dirs under base; started with start(), stopped by PID with stop()."""

    def __init__(self, node: Node, base: Path, flavor: Flavor, image_ref: str) -> None:
        self.node = node
        self.base = base
        self.flavor = flavor
        self.image_ref = image_ref
        self.socket = base / "containerd.sock"
        self.conf_dir = base / "net.d"
        self.bin_dir = base / "cni-bin"
        self.calls_log = base / "cni-calls.log"
        self.proc: subprocess.Popen[bytes] | None = None
        self._log: Any = None
        self._channel: Any = None
        self.pb: Any = None
        self.rt: Any = None
        for d in (
            self.conf_dir,
            self.bin_dir,
            base / "root",
            base / "state",
            base / "opt",
            base / "pod-logs",
        ):
            d.mkdir(parents=True, exist_ok=True)
        self._make_bin_dir()
        self.config = base / "config.toml"
        self.config.write_text(self._config_toml())

    def _make_bin_dir(self) -> None:
        """containerd 1.6 takes one CNI bin_dir and needs `loopback` in it: link the plugins
        under test and Debian's loopback into a private dir; the main plugin is reached
        through a wrapper that logs each call."""
        main, ipam = self.flavor.binaries()
        wrapper = self.bin_dir / main.name
        wrapper.write_text(
            WRAPPER.format(log=shlex.quote(str(self.calls_log)), real=shlex.quote(str(main)))
        )
        wrapper.chmod(0o755)
        (self.bin_dir / ipam.name).symlink_to(ipam)
        (self.bin_dir / "loopback").symlink_to(DEBIAN_CNI_DIR / "loopback")

    def _config_toml(self) -> str:
        q = json.dumps
        b = self.base
        return f"""\
version = 2
root = {q(str(b / "root"))}
state = {q(str(b / "state"))}
disabled_plugins = [
  "io.containerd.snapshotter.v1.aufs", "io.containerd.snapshotter.v1.btrfs",
  "io.containerd.snapshotter.v1.devmapper", "io.containerd.snapshotter.v1.zfs",
  "io.containerd.tracing.processor.v1.otlp", "io.containerd.internal.v1.tracing",
]

[grpc]
  address = {q(str(self.socket))}

[ttrpc]
  address = {q(str(self.socket) + ".ttrpc")}

[debug]
  address = ""
  level = "info"

[metrics]
  address = ""

[plugins."io.containerd.internal.v1.opt"]
  path = {q(str(b / "opt"))}

[plugins."io.containerd.grpc.v1.cri"]
  sandbox_image = {q(self.image_ref)}
  stream_server_address = "127.0.0.1"
  stream_server_port = "0"
  enable_selinux = false
  # root here lacks CAP_SYS_RESOURCE: the sandbox's oom_score_adj (-998) may not go below ours.
  restrict_oom_score_adj = true
  [plugins."io.containerd.grpc.v1.cri".containerd]
    snapshotter = "native"
    default_runtime_name = "runc"
    [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc]
      runtime_type = "io.containerd.runc.v2"
      [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc.options]
        SystemdCgroup = false
  [plugins."io.containerd.grpc.v1.cri".cni]
    bin_dir = {q(str(self.bin_dir))}
    conf_dir = {q(str(self.conf_dir))}
    max_conf_num = 1
"""

    # ---- lifecycle ----

    def start(self) -> None:
        import grpc  # deferred: only this tier needs grpc

        self._log = open(self.base / "containerd.log", "wb")  # noqa: SIM115
        self.proc = self.node.popen(
            ["containerd", "--config", str(self.config)],
            stdout=self._log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
        )
        self.pb, pb_grpc = cri_modules()
        wait_for("containerd's socket", lambda: self._alive() and self.socket.exists(), timeout=30)
        self._channel = grpc.insecure_channel(f"unix://{self.socket}")
        self.rt = pb_grpc.RuntimeServiceStub(self._channel)
        wait_for("the CRI service", self._cri_ready, timeout=30)
        self.ctr(
            "images",
            "import",
            "--snapshotter",
            "native",
            "--no-unpack=false",
            str(TOOLS_BIN / "pause-oci.tar"),
        )
        refs = self.ctr("images", "ls", "-q").stdout.split()
        assert self.image_ref in refs, f"pause image not imported: {refs}"

    def _alive(self) -> bool:
        assert self.proc is not None
        assert self.proc.poll() is None, f"containerd exited:\n{self.log_tail()}"
        return True

    def _cri_ready(self) -> bool:
        self._alive()
        try:
            v = self.rt.Version(self.pb.VersionRequest(version="v1"), timeout=2)
        except Exception as exc:  # grpc.RpcError while the plugin comes up
            raise AssertionError(str(exc)) from exc
        return bool(v.runtime_name)

    def ctr(self, *args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
        return self.node.run(
            ["ctr", "--address", str(self.socket), "--namespace", "k8s.io", *args], check=check
        )

    def log_tail(self, lines: int = 40) -> str:
        path = self.base / "containerd.log"
        text = path.read_text(errors="replace") if path.exists() else ""
        return "\n".join(text.splitlines()[-lines:])

    def stop(self) -> list[str]:
        """Remove every pod, stop containerd by its PID, end shims it left (by PID, matched on
        this instance's socket path), unmount what is left under base. Returns problems."""
        problems: list[str] = []
        if self.rt is not None and self.proc is not None and self.proc.poll() is None:
            try:
                for pod in self.list_pods():
                    problems.append(f"pod left running: {pod.metadata.name}")
                    self.rt.StopPodSandbox(
                        self.pb.StopPodSandboxRequest(pod_sandbox_id=pod.id), timeout=60
                    )
                    self.rt.RemovePodSandbox(
                        self.pb.RemovePodSandboxRequest(pod_sandbox_id=pod.id), timeout=60
                    )
            except Exception as exc:
                problems.append(f"pod cleanup failed: {exc}")
        if self._channel is not None:
            self._channel.close()
            self._channel = None
        stop_pid(self.proc, grace=15)
        if self._log is not None:
            self._log.close()
            self._log = None
        for pid in pids_with_cmdline(str(self.socket)):
            problems.append(f"shim {pid} outlived containerd")
            kill_pid(pid)
        if mounts := unmount_under(self.base):
            problems.append(f"mounts: {mounts}")
        return problems

    # ---- CRI ----

    def install_network(self, conf: dict[str, Any]) -> None:
        """Put conf in place as the only conflist and wait until the CRI plugin loaded it."""
        for old in self.conf_dir.glob("*"):
            old.unlink()
        text = json.dumps(conf, indent=2) + "\n"
        tmp = self.conf_dir / ".10-tabby.conflist.tmp"
        tmp.write_text(text)
        tmp.rename(self.conf_dir / "10-tabby.conflist")
        marker = json.dumps(conf["plugins"][0]["ipam"], sort_keys=True)

        def loaded() -> bool:
            info = self.rt.Status(self.pb.StatusRequest(verbose=True), timeout=5).info
            cfg = json.loads(info.get("cniconfig", "{}"))
            for net in cfg.get("Networks") or []:
                for plugin in (net.get("Config") or {}).get("Plugins") or []:
                    src = json.loads(plugin.get("Source") or "{}")
                    if json.dumps(src.get("ipam"), sort_keys=True) == marker:
                        return True
            return False

        wait_for("containerd to load the new conflist", loaded, timeout=20, interval=0.2)

    def run_pod(self, name: str, uid: str | None = None) -> str:
        pb = self.pb
        config = pb.PodSandboxConfig(
            metadata=pb.PodSandboxMetadata(
                name=name, uid=uid or unique("uid-"), namespace="e2e", attempt=0
            ),
            hostname=name,
            log_directory=str(self.base / "pod-logs" / name),
            labels={"tabby-e2e": "1"},
            linux=pb.LinuxPodSandboxConfig(
                security_context=pb.LinuxSandboxSecurityContext(
                    namespace_options=pb.NamespaceOption(
                        network=pb.POD, pid=pb.CONTAINER, ipc=pb.POD
                    )
                )
            ),
        )
        reply = self.rt.RunPodSandbox(pb.RunPodSandboxRequest(config=config), timeout=120)
        return str(reply.pod_sandbox_id)

    def pod_status(self, pod_id: str) -> tuple[Any, dict[str, Any]]:
        reply = self.rt.PodSandboxStatus(
            self.pb.PodSandboxStatusRequest(pod_sandbox_id=pod_id, verbose=True), timeout=30
        )
        info = json.loads(reply.info.get("info", "{}"))
        return reply.status, info

    def pod_ips(self, pod_id: str) -> list[str]:
        status, _ = self.pod_status(pod_id)
        ips = [status.network.ip] + [a.ip for a in status.network.additional_ips]
        return [ip for ip in ips if ip]

    def pod_netns(self, pod_id: str) -> str:
        _, info = self.pod_status(pod_id)
        for ns in info["runtimeSpec"]["linux"]["namespaces"]:
            if ns["type"] == "network":
                return str(ns["path"])
        raise AssertionError(f"pod {pod_id} has no network namespace path")

    def stop_pod(self, pod_id: str) -> None:
        self.rt.StopPodSandbox(self.pb.StopPodSandboxRequest(pod_sandbox_id=pod_id), timeout=60)

    def remove_pod(self, pod_id: str) -> None:
        self.rt.RemovePodSandbox(self.pb.RemovePodSandboxRequest(pod_sandbox_id=pod_id), timeout=60)

    def list_pods(self) -> list[Any]:
        return list(self.rt.ListPodSandbox(self.pb.ListPodSandboxRequest(), timeout=30).items)

    def cni_calls(self, container_id: str | None = None) -> list[CniCall]:
        if not self.calls_log.exists():
            return []
        calls = [CniCall(*line.split("|", 4)) for line in self.calls_log.read_text().splitlines()]
        return [c for c in calls if container_id is None or c.container_id == container_id]
