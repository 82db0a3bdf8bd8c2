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
import shlex
import subprocess
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from .harness_base import (
    POOL_V4,
    POOL_V6,
    PRIVATE_DIRS,
    PYTHON,
    UPLINK_NODE,
    UPLINK_SINK,
    run,
    stop_pid,
    unique,
    wait_for,
)


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
