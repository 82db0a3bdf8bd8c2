"""The BIRD backend (bird) with real BIRD daemons over a real underlay.

Each test builds an underlay of its own: a bridge in one namespace and three "node"
namespaces attached to it by veth pairs (10.250.0.N/24 and fd00:250::N/64 on ``eth0``), and
runs one supervisor (and so one ``bird``) per node inside its namespace, with the run
directory in the test's tmp_path. BIRDs run with ``-P`` pidfiles and are killed by PID in
``finally`` blocks; every namespace is deleted, also on failure.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import functools
import ipaddress
import os
import secrets
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TypeVar

import pytest

from bird import (
    BirdConfig,
    BirdConfigError,
    BirdControl,
    BirdNode,
    BirdSupervisor,
    Peer,
    PeerType,
    Pool,
    read_peers,
    render,
)
from tests.privileged.netns_util import PREFIX, run, run_in_thread_netns

pytestmark = pytest.mark.privileged

T = TypeVar("T")
ROOT = Path(__file__).resolve().parents[2]
POOLS = (Pool(ipaddress.ip_network("10.244.0.0/16")), Pool(ipaddress.ip_network("fd10::/48")))


class UnderlayNode:
    def __init__(self, index: int, ns: str, run_dir: Path) -> None:
        self.index = index
        self.ns = ns
        self.path = f"/run/netns/{ns}"
        self.ipv4 = ipaddress.IPv4Address(f"10.250.0.{index}")
        self.ipv6 = ipaddress.IPv6Address(f"fd00:250::{index}")
        self.run_dir = run_dir
        self.block4 = ipaddress.ip_network(f"10.244.{index}.0/26")
        self.block6 = ipaddress.ip_network(f"fd10::{index}:0/122")

    def run(self, fn: Callable[..., T], *args: object) -> T:
        """Call ``fn`` from a thread inside this node's namespace (so what it starts, BIRD
        and the supervisor's monitor thread, lives there)."""
        return run_in_thread_netns(self.path, lambda: fn(*args))

    def routes(self, version: int = 4) -> dict[str, str]:
        """BIRD's routes in this node's main table: prefix -> "via <gw>" | "blackhole"
        (prefixes always with their length: ``ip`` prints host routes without it)."""
        out = run("ip", f"-{version}", "-n", self.ns, "route", "show", "proto", "bird").stdout
        routes = {}
        for line in out.splitlines():
            words = line.split()
            if words[0] == "blackhole":
                routes[str(ipaddress.ip_network(words[1]))] = "blackhole"
            elif len(words) > 2 and words[1] == "via":
                routes[str(ipaddress.ip_network(words[0]))] = f"via {words[2]}"
        return routes

    def pidfile_pid(self) -> int | None:
        try:
            return int((self.run_dir / "bird.pid").read_text().strip())
        except (OSError, ValueError):
            return None


def _bird_alive(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


def _kill_bird(node: UnderlayNode, pid: int | None) -> None:
    """SIGKILL ``pid`` if it is still this node's BIRD (checked against its command line)."""
    if pid is None or not _bird_alive(pid):
        return
    try:
        args = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    except OSError:
        return
    if str(node.run_dir / "bird.ctl").encode() in args:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


@pytest.fixture
def underlay(tmp_path: Path) -> Iterator[list[UnderlayNode]]:
    tag = f"{PREFIX}{os.getpid()}-{secrets.token_hex(3)}"
    bridge = f"{tag}-ul"
    made: list[str] = []
    nodes: list[UnderlayNode] = []
    try:
        run("ip", "netns", "add", bridge)
        made.append(bridge)
        run("ip", "-n", bridge, "link", "add", "br0", "type", "bridge")
        run("ip", "-n", bridge, "link", "set", "br0", "up")
        for i in (1, 2, 3):
            node = UnderlayNode(i, f"{tag}-n{i}", tmp_path / f"n{i}")
            run("ip", "netns", "add", node.ns)
            made.append(node.ns)
            veth = ("type", "veth", "peer", "name", "eth0", "netns", node.ns)
            run("ip", "-n", bridge, "link", "add", f"p{i}", *veth)
            run("ip", "-n", bridge, "link", "set", f"p{i}", "master", "br0", "up")
            run("ip", "-n", node.ns, "addr", "add", f"{node.ipv4}/24", "dev", "eth0")
            run("ip", "-n", node.ns, "addr", "add", f"{node.ipv6}/64", "dev", "eth0", "nodad")
            run("ip", "-n", node.ns, "link", "set", "eth0", "up")
            run("ip", "-n", node.ns, "link", "set", "lo", "up")
            nodes.append(node)
        yield nodes
    finally:
        for node in nodes:
            _kill_bird(node, node.pidfile_pid())
        for ns in reversed(made):
            run("ip", "netns", "del", ns, check=False)


@pytest.fixture
def supervisors() -> Iterator[list[BirdSupervisor]]:
    """Supervisors a test started: stopped at the end (the underlay's finally kills any
    BIRD that survives that by PID)."""
    started: list[BirdSupervisor] = []
    try:
        yield started
    finally:
        for sup in started:
            with contextlib.suppress(Exception):
                sup.stop()


def wait_for(
    what: str,
    check: Callable[[], bool],
    timeout: float = 20.0,
    detail: Callable[[], object] | None = None,
) -> float:
    """Poll ``check`` until true; seconds it took. Generous timeout (guards hangs only);
    ``detail()`` goes into the failure message."""
    start = time.monotonic()
    while not check():
        if time.monotonic() - start > timeout:
            extra = f"\n{detail()}" if detail is not None else ""
            raise AssertionError(f"timed out after {timeout} s waiting for: {what}{extra}")
        time.sleep(0.1)
    return time.monotonic() - start


def mesh_config(
    node: UnderlayNode,
    nodes: list[UnderlayNode],
    *,
    dual_stack: bool = False,
    extra_blocks: tuple[ipaddress.IPv4Network, ...] = (),
    borrowed: tuple[ipaddress.IPv4Address, ...] = (),
) -> BirdConfig:
    peers = [Peer(o.ipv4, PeerType.MESH, name=o.ns) for o in nodes if o is not node]
    blocks: list[ipaddress.IPv4Network | ipaddress.IPv6Network] = [node.block4, *extra_blocks]
    if dual_stack:
        peers += [Peer(o.ipv6, PeerType.MESH) for o in nodes if o is not node]
        blocks.append(node.block6)
    return BirdConfig(
        node=BirdNode(node.ns, node.ipv4, node.ipv6 if dual_stack else None),
        peers=tuple(peers),
        pools=POOLS,
        blocks=tuple(blocks),
        borrowed=borrowed,
    )


def start(node: UnderlayNode, config: BirdConfig | str) -> BirdSupervisor:
    sup = BirdSupervisor(str(node.run_dir), backoff_initial=0.2)
    node.run(sup.start, config)
    return sup


def all_established(sup: BirdSupervisor, count: int) -> bool:
    peers = sup.peers()
    return len(peers) == count and all(p.established for p in peers)


def wait_established(sup: BirdSupervisor, count: int, timeout: float = 20.0) -> None:
    wait_for(
        f"{sup.paths.run_dir}: {count} sessions Established",
        functools.partial(all_established, sup, count),
        timeout=timeout,
        detail=sup.peers,
    )


def _route_is(node: UnderlayNode, prefix: str, want: str | None) -> bool:
    return node.routes(ipaddress.ip_network(prefix).version).get(prefix) == want


def wait_route(node: UnderlayNode, prefix: str, want: str | None) -> None:
    """Wait until BIRD's route for ``prefix`` in ``node`` is ``want`` (None: absent)."""
    version = ipaddress.ip_network(prefix).version
    wait_for(
        f"{node.ns}: {prefix} -> {want}",
        functools.partial(_route_is, node, prefix, want),
        detail=functools.partial(node.routes, version),
    )


def wait_converged(nodes: list[UnderlayNode], version: int = 4) -> None:
    """Every node: its own block a blackhole, every other node's via that node."""
    for node in nodes:
        for other in nodes:
            block = other.block4 if version == 4 else other.block6
            via = other.ipv4 if version == 4 else other.ipv6
            wait_route(node, str(block), "blackhole" if other is node else f"via {via}")


def sessions_since(ctl: Path) -> dict[str, dt.datetime | None]:
    """BIRD's raw "since" (microseconds) of every BGP session."""
    with BirdControl(str(ctl)) as bird:
        return {p.name: p.since for p in bird.show_protocols() if p.kind == "BGP"}


def assert_no_reset(before: dict[str, dt.datetime | None], ctl: Path) -> None:
    """Same sessions, each last changed when it did before (BIRD's value jitters by
    microseconds; a reset moves it by seconds)."""
    after = sessions_since(ctl)
    assert after.keys() == before.keys()
    for name, then in before.items():
        now = after[name]
        assert then is not None
        assert now is not None
        assert abs((now - then).total_seconds()) < 0.5, f"{name} was reset: {then} -> {now}"


def test_full_mesh_dual_stack_converges(
    underlay: list[UnderlayNode], supervisors: list[BirdSupervisor]
) -> None:
    """Every node learns every other node's IPv4 and IPv6 block via that node's underlay
    address, keeps a blackhole for its own, and shows four Established mesh sessions."""
    for node in underlay:
        supervisors.append(start(node, mesh_config(node, underlay, dual_stack=True)))
    for sup in supervisors:
        wait_established(sup, 4)
    wait_converged(underlay, 4)
    wait_converged(underlay, 6)

    peers = supervisors[0].peers()
    assert [(p.type, str(p.address)) for p in peers] == [
        (PeerType.MESH, "10.250.0.2"),
        (PeerType.MESH, "10.250.0.3"),
        (PeerType.MESH, "fd00:250::2"),
        (PeerType.MESH, "fd00:250::3"),
    ]
    assert all(p.since.endswith("Z") for p in peers)
    assert all(p.neighbor_as == 64512 for p in peers)
    assert peers[0].description == underlay[1].ns
    # tabbyctl's path: a fresh client on the socket, no supervisor object.
    assert [p.address for p in read_peers(str(underlay[1].run_dir / "bird.ctl"))] == [
        underlay[0].ipv4,
        underlay[2].ipv4,
        underlay[0].ipv6,
        underlay[2].ipv6,
    ]
    # Shortly after start every peer is Established, so every node is ready.
    for sup in supervisors:
        assert sup.readiness() == []


def test_route_reflector_without_mesh(
    underlay: list[UnderlayNode], supervisors: list[BirdSupervisor]
) -> None:
    """Node 1 reflects (cluster id 10.250.0.1) for nodes 2 and 3, which peer with it only:
    2 and 3 still learn each other's block, via each other's address (next hop kept)."""
    rr, c2, c3 = underlay
    cluster = ipaddress.IPv4Address("10.250.0.1")
    rr_config = BirdConfig(
        node=BirdNode(rr.ns, rr.ipv4, rr_cluster_id=cluster),
        peers=tuple(Peer(c.ipv4, PeerType.RR, rr_client=True) for c in (c2, c3)),
        pools=POOLS,
        blocks=(rr.block4,),
    )
    supervisors.append(start(rr, rr_config))
    for client in (c2, c3):
        config = BirdConfig(
            node=BirdNode(client.ns, client.ipv4),
            peers=(Peer(rr.ipv4, PeerType.RR),),
            pools=POOLS,
            blocks=(client.block4,),
        )
        assert "Mesh_" not in render(config)
        supervisors.append(start(client, config))

    wait_established(supervisors[0], 2)
    for sup in supervisors[1:]:
        wait_established(sup, 1)
    wait_converged(underlay)
    assert [(p.type, p.address) for p in supervisors[0].peers()] == [
        (PeerType.RR, c2.ipv4),
        (PeerType.RR, c3.ipv4),
    ]
    assert [(p.type, p.address) for p in supervisors[1].peers()] == [(PeerType.RR, rr.ipv4)]


def test_borrowed_and_block_changes_reload_without_session_reset(
    underlay: list[UnderlayNode], supervisors: list[BirdSupervisor]
) -> None:
    """Node 1 borrows 10.244.2.5 from node 2's block and gains a block: nodes 2 and 3 route
    both to node 1, node 1's BIRD installs no route for the borrowed address; withdrawing
    the block removes it everywhere. No session is ever reset."""
    n1, n2, n3 = underlay
    for node in underlay:
        supervisors.append(start(node, mesh_config(node, underlay)))
    for sup in supervisors:
        wait_established(sup, 2)
    wait_converged(underlay)
    before = [sessions_since(n.run_dir / "bird.ctl") for n in underlay]
    shown = [sup.peers() for sup in supervisors]

    borrowed = ipaddress.IPv4Address("10.244.2.5")
    extra = ipaddress.IPv4Network("10.244.101.0/26")
    grown = mesh_config(n1, underlay, extra_blocks=(extra,), borrowed=(borrowed,))
    assert supervisors[0].apply(grown) is True
    assert supervisors[0].apply(grown) is False  # same text: nothing to do
    for other in (n2, n3):
        wait_route(other, "10.244.2.5/32", f"via {n1.ipv4}")
        wait_route(other, str(extra), f"via {n1.ipv4}")
    assert n2.routes()[str(n2.block4)] == "blackhole"  # the owner keeps its aggregate
    assert "10.244.2.5/32" not in n1.routes()  # never installed by BIRD where it lives
    assert n1.routes()[str(extra)] == "blackhole"

    assert supervisors[0].apply(mesh_config(n1, underlay, borrowed=(borrowed,))) is True
    for other in (n2, n3):
        wait_route(other, str(extra), None)
    assert n2.routes()["10.244.2.5/32"] == f"via {n1.ipv4}"

    # A text BIRD rejects is reported with BIRD's words and never loaded.
    running = (n1.run_dir / "bird.conf").read_text()
    with pytest.raises(BirdConfigError, match="syntax error"):
        supervisors[0].apply(running + "protocol nonsense {\n")
    assert (n1.run_dir / "bird.conf").read_text() == running

    for node, then in zip(underlay, before, strict=True):
        assert_no_reset(then, node.run_dir / "bird.ctl")
    assert [sup.peers() for sup in supervisors] == shown  # node status: same "since"


def test_killed_bird_is_restarted_with_routes_kept(
    underlay: list[UnderlayNode], supervisors: list[BirdSupervisor]
) -> None:
    """SIGKILL of node 3's BIRD: the supervisor starts a new one in graceful restart; the
    routes stay in place on both sides meanwhile, and the sessions come back. detach()
    then leaves that BIRD running for a successor."""
    n1, _n2, n3 = underlay
    for node in underlay:
        supervisors.append(start(node, mesh_config(node, underlay)))
    for sup in supervisors:
        wait_established(sup, 2)
    wait_converged(underlay)

    sup3 = supervisors[2]
    old = sup3.pid
    assert old is not None
    assert old == n3.pidfile_pid()
    os.kill(old, signal.SIGKILL)
    wait_for("a new BIRD on node 3", functools.partial(_restarted, sup3, old))
    assert sup3.restarts == 1
    assert n1.routes()[str(n3.block4)] == f"via {n3.ipv4}"  # peers keep node 3's routes
    assert n3.routes()[str(n1.block4)] == f"via {n1.ipv4}"  # and node 3 its own
    wait_established(sup3, 2, timeout=30)
    wait_for("node 3 ready (recovery done)", lambda: sup3.readiness() == [], detail=sup3.status)
    wait_converged(underlay)

    # detach() hands BIRD over: it keeps running and the next supervisor adopts it.
    running = sup3.pid
    sup3.detach()
    assert running is not None
    assert _bird_alive(running)
    successor = start(n3, mesh_config(n3, underlay))
    supervisors.append(successor)
    assert successor.adopted
    assert successor.pid == running


def test_graceful_stop_keeps_every_route_until_the_next_bird(
    underlay: list[UnderlayNode], supervisors: list[BirdSupervisor]
) -> None:
    """tabby-node's SIGTERM (an upgrade replaces its pod): stop(graceful=True) makes node 3's
    BIRD close its sessions without a notification and exit. Its peers keep its block (stale,
    graceful restart) and node 3 keeps its kernel routes, every moment until a new BIRD
    (started with -R in the same run directory) has re-established the sessions and the
    routes are fresh again. A plain stop() (SIGTERM) withdraws them at once: the contrast."""
    n1, n2, n3 = underlay
    for node in underlay:
        supervisors.append(start(node, mesh_config(node, underlay)))
    for sup in supervisors:
        wait_established(sup, 2)
    wait_converged(underlay)
    held = {
        n1: {str(n3.block4): f"via {n3.ipv4}"},
        n2: {str(n3.block4): f"via {n3.ipv4}"},
        n3: {
            str(n3.block4): "blackhole",
            str(n1.block4): f"via {n1.ipv4}",
            str(n2.block4): f"via {n2.ipv4}",
        },
    }

    def missing() -> list[str]:
        out = []
        for node, wanted in held.items():
            routes = node.routes()
            out += [f"{node.ns}: {p}" for p, w in wanted.items() if routes.get(p) != w]
        return out

    old = supervisors[2]
    old_pid = old.pid
    assert old_pid is not None
    old.stop(graceful=True)
    assert not _bird_alive(old_pid)
    gaps: list[str] = []
    deadline = time.monotonic() + 3  # BIRD's peers would keep the routes 120 s
    while time.monotonic() < deadline:
        gaps += missing()
        time.sleep(0.05)
    successor = start(n3, mesh_config(n3, underlay))
    supervisors.append(successor)
    assert not successor.adopted
    with BirdControl(str(n3.run_dir / "bird.ctl")) as bird:
        assert "Graceful restart recovery in progress" in str(bird.command("show status"))
    while not all_established(successor, 2):
        gaps += missing()
        time.sleep(0.05)
    wait_for("node 3 ready (recovery done)", lambda: successor.readiness() == [])
    gaps += missing()
    assert gaps == []
    wait_converged(underlay)

    successor.stop()  # SIGTERM: a notification, the peers withdraw node 3's block
    for other in (n1, n2):
        wait_route(other, str(n3.block4), None)


def _restarted(sup: BirdSupervisor, old: int) -> bool:
    return sup.pid not in (None, old) and sup.running()


ADOPT_SCRIPT = """
import sys, time
from bird import BirdSupervisor
sup = BirdSupervisor(sys.argv[1])
sup.start(open(sys.argv[2]).read())
print(sup.pid, flush=True)
time.sleep(600)
"""


def test_sigkilled_agent_leaves_bird_running_and_the_next_one_adopts_it(
    underlay: list[UnderlayNode], supervisors: list[BirdSupervisor], tmp_path: Path
) -> None:
    """Node 1's supervisor lives in a process that is SIGKILLed (a crashed tabby-node):
    BIRD keeps running; a new supervisor adopts that same BIRD, reloads it with a new block
    and no session reset; stop() then stops it."""
    n1, n2, _n3 = underlay
    text_file = tmp_path / "n1.conf.txt"
    text_file.write_text(render(mesh_config(n1, underlay)))
    argv = [str(n1.run_dir), str(text_file)]
    agent = subprocess.Popen(
        ["ip", "netns", "exec", n1.ns, sys.executable, "-c", ADOPT_SCRIPT, *argv],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert agent.stdout is not None
        bird_pid = int(agent.stdout.readline())
        for node in underlay[1:]:
            supervisors.append(start(node, mesh_config(node, underlay)))
        for sup in supervisors:
            wait_established(sup, 2)
        ctl = n1.run_dir / "bird.ctl"
        wait_for("node 1 Established", functools.partial(_all_up, ctl))
        before = sessions_since(ctl)
        before_n2 = sessions_since(n2.run_dir / "bird.ctl")

        agent.kill()
        agent.wait(timeout=10)
        assert _bird_alive(bird_pid)

        extra = ipaddress.IPv4Network("10.244.101.0/26")
        sup1 = BirdSupervisor(str(n1.run_dir))
        supervisors.append(sup1)
        n1.run(sup1.start, mesh_config(n1, underlay, extra_blocks=(extra,)))
        assert sup1.adopted
        assert sup1.pid == bird_pid
        wait_route(n2, str(extra), f"via {n1.ipv4}")
        assert_no_reset(before, ctl)
        assert_no_reset(before_n2, n2.run_dir / "bird.ctl")

        sup1.stop()
        assert not _bird_alive(bird_pid)
        assert not ctl.exists()
        wait_for("node 2 sees node 1 gone", lambda: not supervisors[0].peers()[0].established)
    finally:
        if agent.poll() is None:
            agent.kill()
            agent.wait(timeout=10)
        if agent.stdout is not None:
            agent.stdout.close()


def _all_up(ctl: Path) -> bool:
    return all(p.established for p in read_peers(str(ctl)))
