"""``tabbyctl policy trace SRC DST [--port P[/PROTO]]``: a real probe, traced through
tabby's table, beside what ``policy explain`` predicts.

The probe leaves from SRC's network namespace: a TCP SYN or a UDP datagram to the port
(``--port 80``, ``80/UDP``, or a container-port name of DST), an ICMP echo request without
``--port``. SRC is a pod on this node (``NS/NAME``, or its address; its namespace is the one
its IPAM allocation records) or an address of this node itself. DST is a pod anywhere in
the cluster, or any address.

The kernel's verdict is read, not predicted (``dataplane.nfttrace``): before the probe is
sent, a rule matching only it sets ``meta nftrace set 1`` here (in a table of its own,
deleted afterwards, also on errors, Ctrl-C and SIGTERM), and every rule the probe meets in
tabby's table is reported. The egress of SRC is decided on this node. When DST is a pod on
another node, its ingress is decided there: that node's tabby-node is asked through the
datastore (``resources.trace``) to trace the same probe in its kernel, and answers with
what its table did. Both are printed with the chain, the rule (its ``nft -a`` handle, its
text and comment) and the chains on the way, next to ``policy explain``'s answer for the
same connection; a disagreement is said as such, and the exit status is 3.
"""

from __future__ import annotations

import contextlib
import dataclasses
import ipaddress
import os
import secrets
import socket
import time
from collections.abc import Callable, Iterator, Sequence
from typing import TYPE_CHECKING

import click

from bundle.types import JSON
from datastore.base import leases
from tabbyctl.common import Ctx, output_option
from tabbyctl.policy import (
    ExplainError,
    PolicyCluster,
    _named_port,
    _pod_of,
    parse_port,
    parse_target,
    policy_group,
    predict,
    read_cluster,
)

if TYPE_CHECKING:
    from dataplane.nfttrace import Probe, ProbeProtocol, ProbeSocket
    from datastore.base import Store
    from policy.engine import ClusterState, DirectionVerdict, Endpoint, Explanation, Target
    from policy.trace import Decision, Foreign
    from resources.trace import TraceAnswer

#: How long the probe waits for its answer, and the remote node traces.
ANSWER_SECONDS = 1.0
REMOTE_SECONDS = 6.0
ARM_WAIT_SECONDS = 5.0
REQUEST_TTL = 30.0
DISAGREE_EXIT = 3


class TraceError(ExplainError):
    """A trace that cannot be made (SRC elsewhere, no namespace, a bad port): one line."""


@dataclasses.dataclass(frozen=True)
class Plan:
    """What to send from where, and whom to ask."""

    src: Target
    dst: Target
    family: int
    src_addr: str
    dst_addr: str
    protocol: ProbeProtocol
    port: int | None
    port_name: str | None
    netns: str | None  # SRC's namespace (None: this one, SRC is this node)
    src_node: str | None
    dst_node: str | None
    dst_remote: bool
    prediction: Explanation

    @property
    def label(self) -> str:
        what = self.protocol + (f"/{self.port}" if self.port is not None else "")
        return f"{_label(self.src)} -> {_label(self.dst)} {what}"


def _label(t: Target) -> str:
    return f"{t[0]}/{t[1]}" if isinstance(t, tuple) else t


def _local(iface: str) -> bool:
    try:
        socket.if_nametoindex(iface)
    except OSError:
        return False
    return True


def _endpoints(cluster: PolicyCluster, pod: tuple[str, str]) -> list[Endpoint]:
    return sorted(
        (e for e in cluster.state.endpoints if (e.namespace, e.pod) == pod and e.addresses),
        key=lambda e: e.key,
    )


def plan(
    cluster: PolicyCluster,
    src_text: str,
    dst_text: str,
    port_text: str | None,
    netns_of: Callable[[str], str | None],
    local: Callable[[str], bool] = _local,
) -> Plan:
    """Resolve the words into a probe. ``netns_of(address)`` is the network namespace path
    the address's IPAM allocation records; ``local(iface)`` says whether a host interface
    is on this node."""
    src, dst = parse_target(src_text, "SRC"), parse_target(dst_text, "DST")
    for t, what in ((src, "SRC"), (dst, "DST")):
        if isinstance(t, str) and ipaddress.ip_interface(t).network.prefixlen not in (32, 128):
            raise TraceError(f"{what} {t!r}: give an address, not a network")
    state = cluster.state
    src_pod, dst_pod = _pod_of(state, src), _pod_of(state, dst)
    family, src_addr, dst_addr = _family(cluster, src, src_pod, dst, dst_pod)
    src_node, netns = _source(cluster, src_text, src_pod, src_addr, netns_of, local)
    dst_node, dst_remote = _destination(cluster, dst_pod, dst_addr, local)
    protocol, number, port_name = _what_to_send(state, dst, port_text)
    src_t: Target = src if src_pod is None else src_pod
    dst_t: Target = dst if dst_pod is None else dst_pod
    prediction = predict(cluster, src_t, dst_t, protocol, number)
    return Plan(
        src_t,
        dst_t,
        family,
        src_addr,
        dst_addr,
        protocol,
        number,
        port_name,
        netns,
        src_node,
        dst_node,
        dst_remote,
        prediction,
    )


def _family(
    cluster: PolicyCluster,
    src: Target,
    src_pod: tuple[str, str] | None,
    dst: Target,
    dst_pod: tuple[str, str] | None,
) -> tuple[int, str, str]:
    """The address family of the probe and SRC's and DST's addresses in it: the family of
    the addresses given, else IPv4 if both pods have one, else IPv6."""
    families = [ipaddress.ip_interface(t).version for t in (src, dst) if isinstance(t, str)]
    if len(set(families)) > 1:
        raise TraceError("SRC and DST are of different address families")
    for fam in families[:1] or [4, 6]:
        src_addr = _address_of(cluster, src, src_pod, fam)
        dst_addr = _address_of(cluster, dst, dst_pod, fam)
        if src_addr and dst_addr:
            return fam, src_addr, dst_addr
    raise TraceError(f"{_label(src)} and {_label(dst)} have no address family in common")


def _address_of(
    cluster: PolicyCluster, t: Target, pod: tuple[str, str] | None, fam: int
) -> str | None:
    if isinstance(t, str):
        return str(ipaddress.ip_interface(t).ip)
    eps = _endpoints(cluster, t) if pod else []
    if not eps:
        raise TraceError(f"pod {_label(t)} has no endpoint with an address")
    addrs = [a for e in eps for a in e.addresses if ipaddress.ip_address(a).version == fam]
    return addrs[0] if addrs else None


def _source(
    cluster: PolicyCluster,
    src_text: str,
    src_pod: tuple[str, str] | None,
    src_addr: str,
    netns_of: Callable[[str], str | None],
    local: Callable[[str], bool],
) -> tuple[str | None, str | None]:
    """Where the probe leaves from: SRC's node and network namespace (None, None: this
    node itself). A pod must run on this node."""
    if src_pod is None:
        return None, None
    eps = [e for e in _endpoints(cluster, src_pod) if src_addr in e.addresses]
    if not eps:
        raise TraceError(f"{src_text}: no endpoint of pod {_label(src_pod)} has {src_addr}")
    src_node = eps[0].node
    if not local(eps[0].interface):
        raise TraceError(
            f"{_label(src_pod)} runs on node {src_node}, not here: run tabbyctl policy "
            "trace on that node (the probe leaves from the pod's network namespace)"
        )
    netns = netns_of(src_addr)
    if not netns or not os.path.exists(netns):
        raise TraceError(
            f"the network namespace of {_label(src_pod)} ({netns or 'not recorded'}) is "
            "not on this machine"
        )
    return src_node, netns


def _destination(
    cluster: PolicyCluster,
    dst_pod: tuple[str, str] | None,
    dst_addr: str,
    local: Callable[[str], bool],
) -> tuple[str | None, bool]:
    """DST's node (None: not a pod's, or not known) and whether it is another node."""
    if dst_pod is None:
        return None, False
    eps = [e for e in _endpoints(cluster, dst_pod) if dst_addr in e.addresses]
    if not eps:
        return None, False
    return eps[0].node, not local(eps[0].interface)


def _what_to_send(
    state: ClusterState, dst: Target, port_text: str | None
) -> tuple[ProbeProtocol, int | None, str | None]:
    """The probe's protocol, port number and port name (a named port of DST's)."""
    if port_text is None:
        return "ICMP", None, None
    value, proto = parse_port(port_text)
    if proto not in ("TCP", "UDP"):
        raise TraceError(f"--port {port_text!r}: trace sends TCP, UDP or ICMP probes")
    protocol: ProbeProtocol = "TCP" if proto == "TCP" else "UDP"
    if isinstance(value, str):
        return protocol, _named_port(state, dst, value, proto), value
    return protocol, value, None


# -- running it ---------------------------------------------------------------------------------


def _open_socket(p: Plan) -> ProbeSocket:
    from dataplane.nfttrace import ProbeSocket

    def make() -> ProbeSocket:
        return ProbeSocket(p.family, p.src_addr, p.dst_addr, p.protocol)

    if p.netns is None:
        try:
            return make()
        except OSError as e:
            raise TraceError(
                f"{p.src_addr} is neither a pod's address nor one of this node's: {e}"
            ) from None
    from dataplane.netns import open_netns, run_in_netns

    with open_netns(p.netns) as handle:
        return run_in_netns(handle.fd, make)


def _wait_answer(
    store: Store, key: str, states: tuple[str, ...], seconds: float
) -> TraceAnswer | None:
    from resources.trace import KIND, TraceAnswer

    deadline = time.monotonic() + seconds
    while True:
        doc = store.get(KIND, key)
        if doc is not None:
            answer = TraceAnswer.from_data(doc.data, f"trace {key}")
            if answer.state in states:
                return answer
        if time.monotonic() > deadline:
            return None
        time.sleep(0.05)


def run(p: Plan, store: Store | None) -> JSON:
    """Send the probe, trace it here (and on DST's node), and compare."""
    from dataplane import nfttrace
    from policy import trace as policy_trace
    from resources.trace import KIND, TraceRequest, answer_key

    sock = _open_socket(p)
    probe = sock.probe(p.port)
    request_id = secrets.token_hex(8)
    remote: TraceAnswer | None = None
    remote_state = "not asked"
    asked = False
    try:
        if p.dst_remote and p.dst_node and store is not None:
            req = TraceRequest(
                request_id,
                p.dst_node,
                p.family,
                probe.src,
                probe.dst,
                probe.protocol,
                probe.sport,
                probe.dport,
                probe.icmp_id,
                REMOTE_SECONDS,
            )
            leases(store).put_leased(KIND, request_id, req.to_data(), None, ttl=REQUEST_TTL)
            asked = True
            armed = _wait_answer(
                store, answer_key(request_id, p.dst_node), ("armed", "done", "failed"), 5.0
            )
            remote_state = "no answer" if armed is None else armed.state
        with nfttrace.Trace(probe) as trace:
            sock.send(p.port)
            reply = sock.answer(ANSWER_SECONDS)
            events = trace.collect(0.3)
            listings = trace.rules()
        ds, foreign = policy_trace.decisions(events, listings)
        egress = policy_trace.verdict_of(ds, "egress")
        left_here = not foreign and not (egress is not None and egress.verdict == "drop")
        if asked and remote_state == "armed" and left_here and store is not None:
            assert p.dst_node is not None
            key = answer_key(request_id, p.dst_node)
            remote = _wait_answer(store, key, ("done", "failed"), REMOTE_SECONDS + 2)
            remote_state = "no answer" if remote is None else remote.state
    finally:
        sock.close()
        if asked and store is not None:
            _forget(store, request_id)  # the other node stops tracing when it sees this
            if remote is None and remote_state == "armed" and p.dst_node is not None:
                # wait until it did, so that no trace is left anywhere when we return
                _wait_answer(store, answer_key(request_id, p.dst_node), ("done", "failed"), 3)
    return compose(p, probe, reply, ds, foreign, remote, remote_state)


def _forget(store: Store, request_id: str) -> None:
    from resources.trace import KIND

    try:
        doc = store.get(KIND, request_id)
        if doc is not None:
            store.delete(KIND, request_id, doc.revision)
    except Exception:  # noqa: S110 - it expires with its lease anyway
        pass


# -- what it says ---------------------------------------------------------------------------------


def _side(d: JSON | None, node: str | None, state: str) -> JSON:
    """One direction, as the kernel decided it: ``verdict`` is ``allowed``, ``denied``,
    ``not policed`` (tabby's table let it through without a pod's rules), ``not reached``
    (denied before), or ``unknown`` (the node that decides it did not answer)."""
    out: JSON = {"node": node, "verdict": state}
    if d is None:
        return out
    verdict = {"accept": "allowed", "drop": "denied"}.get(d["verdict"], "not policed")
    out.update({k: d.get(k) for k in ("chain", "handle", "rule", "comment", "path")})
    out["verdict"] = verdict
    return out


def _pick(decisions: Sequence[JSON], direction: str) -> JSON | None:
    chosen = [d for d in decisions if d["direction"] == direction]
    decided = [d for d in chosen if d["verdict"] in ("accept", "drop")]
    pick = decided or chosen
    return pick[0] if pick else None


def _compare(direction: str, kernel: JSON, v: DirectionVerdict | None) -> tuple[str, str | None]:
    """(what explain says, the disagreement or None)."""
    got = kernel["verdict"]
    if v is None:
        said = f"{direction}: not a pod, no policy applies"
        if got in ("allowed", "denied") and not (got == "allowed" and _endpoint_rule(kernel)):
            return said, f"{direction}: the kernel {got} it, explain says no policy applies"
        return said, None
    said = f"{'allowed' if v.allowed else 'denied'}: {v.reason}"
    if got not in ("allowed", "denied", "not policed"):
        return said, None  # not reached, unknown: nothing to compare
    kernel_allowed = got != "denied"
    if kernel_allowed != v.allowed:
        predicted = "allowed" if v.allowed else "denied"
        return said, f"{direction}: the kernel {got} it, explain predicts {predicted}"
    from policy.render import comment_text  # the kernel holds each comment shortened so

    comment = kernel.get("comment") or ""
    if got == "allowed" and v.isolated and not v.allowed_by:  # Calico's: every tier passed it
        if "past every tier" not in comment:
            return said, f"{direction}: the kernel allowed it by {comment!r}, explain: the profile"
        return said, None
    if got == "allowed" and v.isolated and comment not in {comment_text(a) for a in v.allowed_by}:
        names = ", ".join(v.allowed_by)
        return said, f"{direction}: the kernel allowed it by {comment!r}, explain by {names}"
    if got == "allowed" and not v.isolated and not _endpoint_rule(kernel):
        return said, f"{direction}: the kernel allowed it by {comment!r}, explain: not isolated"
    return said, None


def _endpoint_rule(kernel: JSON) -> bool:
    """An endpoint chain's own accept: the pod is not isolated in this direction."""
    return str(kernel.get("comment") or "").endswith(("no ingress policy", "no egress policy"))


def compose(
    p: Plan,
    probe: Probe,
    reply: str,
    ds: list[Decision],
    foreign: list[Foreign],
    remote: TraceAnswer | None,
    remote_state: str,
) -> JSON:
    here = [d.to_json() for d in ds]
    egress = _side(_pick(here, "egress"), p.src_node, "not policed")
    drops = [{"table": f.table, "chain": f.chain, "handle": f.handle} for f in foreign]
    if egress["verdict"] == "denied" or drops:
        ingress = _side(None, p.dst_node, "not reached")
    elif not isinstance(p.dst, tuple):
        ingress = _side(_pick(here, "ingress"), p.dst_node, "not policed")
    elif p.dst_remote:
        if remote is not None and remote.state == "done":
            ingress = _side(_pick(remote.decisions, "ingress"), p.dst_node, "not policed")
            drops += [dict(f) for f in remote.foreign]
        else:
            why = remote.error if remote is not None and remote.error else remote_state
            ingress = _side(None, p.dst_node, "unknown")
            ingress["why"] = f"node {p.dst_node}: {why}"
    else:
        ingress = _side(_pick(here, "ingress"), p.dst_node, "not policed")
    sides = (egress["verdict"], ingress["verdict"])
    if "denied" in sides or drops:
        verdict = "denied"
    elif "unknown" in sides:
        verdict = "unknown"
    else:
        verdict = "allowed"
    ex = p.prediction
    said_e, bad_e = _compare("egress", egress, ex.egress)
    said_i, bad_i = _compare("ingress", ingress, ex.ingress)
    disagreements = [b for b in (bad_e, bad_i) if b]
    if drops:
        disagreements.append(f"dropped by another table: {drops}")
    predicted = "allowed" if ex.allowed else "denied"
    if verdict not in ("unknown", predicted) and not disagreements:
        disagreements.append(f"the kernel {verdict} it, explain predicts {predicted}")
    return {
        "src": _label(p.src),
        "dst": _label(p.dst),
        "protocol": p.protocol,
        "port": p.port,
        "port_name": p.port_name,
        "probe": {
            "src": probe.src,
            "dst": probe.dst,
            "sport": probe.sport,
            "dport": probe.dport,
            "icmp_id": probe.icmp_id,
            "answer": reply,
        },
        "kernel": {"verdict": verdict, "egress": egress, "ingress": ingress, "foreign": drops},
        "explain": {
            "allowed": ex.allowed,
            "egress": said_e,
            "ingress": said_i,
            "summary": ex.lines(),
        },
        "agree": not disagreements,
        "disagreements": disagreements,
    }


def lines(a: JSON) -> list[str]:
    pr = a["probe"]
    what = a["protocol"] + (f"/{a['port']}" if a["port"] is not None else "")
    if pr["sport"] is not None:
        sent = f"{pr['src']}:{pr['sport']} -> {pr['dst']}:{pr['dport']}"
    else:
        sent = f"{pr['src']} -> {pr['dst']} (echo id {pr['icmp_id']})"
    out = [f"trace {a['src']} -> {a['dst']} {what}: probe {sent}: {pr['answer']}"]
    if a["port_name"]:
        out.append(f"  (port {a['port_name']} is {a['port']}/{a['protocol']} on {a['dst']})")
    k = a["kernel"]
    for direction, pod in (("egress", a["src"]), ("ingress", a["dst"])):
        side = k[direction]
        where = f" on {side['node']}" if side.get("node") else ""
        head = f"  {direction} of {pod}{where}: {side['verdict']}"
        if side.get("chain"):
            head += f" in chain {side['chain']}, rule {side['handle']}: {side['rule']}"
        elif side.get("why"):
            head += f" ({side['why']})"
        out.append(head)
        if side.get("path"):
            out.append(f"      path: {' > '.join(side['path'])}")
        out.append(f"      explain: {a['explain'][direction]}")
    for drop in k["foreign"]:
        out.append(f"  dropped in table {drop['table']} chain {drop['chain']}")
    predicted = "ALLOWED" if a["explain"]["allowed"] else "DENIED"
    kernel = k["verdict"].upper()
    if a["agree"]:
        out.append(f"kernel: {kernel}; explain: {predicted}: they agree")
    else:
        out.append(f"kernel: {kernel}; explain: {predicted}: THEY DISAGREE")
        out += [f"  {d}" for d in a["disagreements"]]
    return out


# -- the command -------------------------------------------------------------------------------


@policy_group.command("trace")
@click.argument("src")
@click.argument("dst")
@click.option(
    "--port",
    metavar="P/PROTO",
    help="destination port and protocol (TCP or UDP; a number or a container-port name of "
    "DST), e.g. 80, 53/UDP, http; without it: an ICMP echo",
)
@output_option
@click.pass_obj
def trace_cmd(obj: Ctx, src: str, dst: str, port: str | None, output: str) -> None:
    """Send a real probe from SRC (a pod on this node, NS/NAME or its address, or this
    node's address) to DST (a pod anywhere, or an address) and show what the kernel did
    with it: the chain and rule of tabby's table that allowed or dropped it, per direction
    (DST's node is asked through the datastore when DST is elsewhere), beside what policy
    explain predicts. Needs root. Exit status 3 when the kernel and explain disagree."""
    from ipam.core import Ipam
    from tabbyctl.common import emit, operator_errors
    from tabbyctl.resources import open_resource_store

    with operator_errors(), _stop_on_signals():
        try:
            store = open_resource_store(obj)
            try:
                ipam = Ipam(store, "")

                def netns_of(address: str) -> str | None:
                    owner = ipam.who_owns(address)
                    return str(owner.attrs.get("netns") or "") or None if owner else None

                trace = plan(read_cluster(store), src, dst, port, netns_of)
                answer = run(trace, store)
            finally:
                store.close()
        except (ExplainError, TraceError) as e:
            raise click.ClickException(str(e)) from None
        except OSError as e:
            raise click.ClickException(f"cannot trace: {e}") from None
        except KeyboardInterrupt:  # the trace tables are gone already (the with blocks)
            raise click.ClickException("interrupted: no trace is left behind") from None
    emit(output, answer, lines(answer))
    if not answer["agree"]:
        raise SystemExit(DISAGREE_EXIT)


@contextlib.contextmanager
def _stop_on_signals() -> Iterator[None]:
    """SIGTERM and SIGHUP end a trace as Ctrl-C does: its table is removed on the way out."""
    import signal

    def stop(signum: int, frame: object) -> None:
        raise KeyboardInterrupt

    old = {s: signal.signal(s, stop) for s in (signal.SIGTERM, signal.SIGHUP)}
    try:
        yield
    finally:
        for s, handler in old.items():
            signal.signal(s, handler)


__all__ = ["DISAGREE_EXIT", "Plan", "TraceError", "compose", "lines", "plan", "run", "trace_cmd"]
