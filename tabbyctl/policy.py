"""``tabbyctl policy explain``: which NetworkPolicies select a pod, and why a connection is
allowed or denied; ``policy log`` (``tabbyctl.policy_log``) and ``policy trace``
(``tabbyctl.policy_trace``, which adds its command to this group): what the kernel did.

Computed from the datastore's resources with the engine tabby-node enforces: the documents
are read from the store and turned into the engine's inputs by the same function tabby-node
runs on its cache (``policy.inputs.PolicyInputs``, then
``policy.inputs.cluster_state``); the answer is ``engine.explain`` and
``engine.selecting_policies``. A document tabby-node would skip (it does not validate) is
skipped here too, with the same warning on stderr.

Targets: a pod as ``NAMESPACE/NAME`` (a bare ``NAME`` is in ``default``), an address, or a
CIDR (which stands for its first address, as in the engine). Traffic from a node's own
addresses to a pod on that node is reported unpoliced, as tabby-node enforces it (kubelet
probes).
"""

from __future__ import annotations

import dataclasses
import ipaddress
import re
from collections.abc import Iterable
from typing import TYPE_CHECKING

import click

from bundle.types import JSON
from tabby_node import DEFAULT_HEALTH_PORT, DEFAULT_METRICS_PORT
from tabbyctl.common import Ctx, output_option

if TYPE_CHECKING:
    from datastore.base import Store
    from policy.engine import ClusterState, DirectionVerdict, Explanation, Target
    from resources.tabby import Node
    from tabbyctl import policy_log

PROTOCOLS = ("TCP", "UDP", "SCTP")


class ExplainError(Exception):
    """An answer that cannot be given (unknown pod, bad target or port): one line."""


@dataclasses.dataclass(frozen=True)
class PolicyCluster:
    """The engine's view of the cluster, and every node's own addresses."""

    state: ClusterState
    node_addresses: dict[str, tuple[str, ...]]


def _node_addresses(node: Node) -> tuple[str, ...]:
    spec = node.spec
    out = []
    for value in (
        spec.ipv4Address,
        spec.ipv6Address,
        spec.ipv4VXLANTunnelAddr,
        spec.ipv6VXLANTunnelAddr,
    ):
        if value:
            try:
                out.append(str(ipaddress.ip_interface(value).ip))
            except ValueError:
                continue
    return tuple(out)


def read_cluster(store: Store) -> PolicyCluster:
    """The policy inputs in ``store``, converted exactly as tabby-node converts them."""
    from policy.inputs import PolicyInputs
    from resources.index import NODES, POLICY, Documents

    docs = Documents.read(store, (*POLICY, NODES))
    state, _nat = PolicyInputs().convert(docs)
    nodes = {key: _node_addresses(e.value) for key, e in docs.of(NODES).items()}
    return PolicyCluster(state, nodes)


# -- parsing the operator's words ---------------------------------------------------------------


def parse_pod(text: str, what: str = "pod") -> tuple[str, str]:
    ns, sep, name = text.partition("/")
    if not sep:
        ns, name = "default", text
    if not ns or not name or "/" in name:
        raise ExplainError(f"{what} {text!r}: expected NAMESPACE/NAME")
    return ns, name


def parse_target(text: str, what: str) -> Target:
    """A pod (``NAMESPACE/NAME``), an address or a CIDR."""
    try:
        ipaddress.ip_interface(text)
    except ValueError:
        if ":" in text or re.fullmatch(r"[0-9.]+(/[0-9]*)?", text):
            raise ExplainError(f"{what} {text!r}: not a valid address or CIDR") from None
        return parse_pod(text, what)
    return text


def parse_port(text: str) -> tuple[int | str, str]:
    """``P[/PROTO]``: a port number or a container-port name, TCP when no protocol."""
    port, sep, proto = text.partition("/")
    proto = proto.upper() if sep else "TCP"
    if proto not in PROTOCOLS:
        raise ExplainError(f"--port {text!r}: protocol must be one of {', '.join(PROTOCOLS)}")
    if port.isdigit():
        number = int(port)
        if not 1 <= number <= 65535:
            raise ExplainError(f"--port {text!r}: a port number is 1..65535")
        return number, proto
    if not port:
        raise ExplainError(f"--port {text!r}: expected P/PROTO, e.g. 80/TCP or http/TCP")
    return port, proto


# -- answers ------------------------------------------------------------------------------------


def _pod_known(state: ClusterState, pod: tuple[str, str]) -> bool:
    return any((p.namespace, p.name) == pod for p in state.pods) or any(
        (e.namespace, e.pod) == pod for e in state.endpoints
    )


def _first_address(t: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address:
    return ipaddress.ip_interface(t).network.network_address


def _pod_of(state: ClusterState, t: Target) -> tuple[str, str] | None:
    """The pod a target is (a pod, or an address that belongs to a pod's endpoint)."""
    if isinstance(t, tuple):
        return t
    addr = _first_address(t)
    for e in state.endpoints:
        if any(ipaddress.ip_address(a) == addr for a in e.addresses):
            return (e.namespace, e.pod)
    return None


def _node_of(state: ClusterState, pod: tuple[str, str] | None) -> str | None:
    for e in sorted(state.endpoints, key=lambda e: e.key):
        if (e.namespace, e.pod) == pod and e.addresses:
            return e.node
    return None


def _named_port(state: ClusterState, dst: Target, name: str, protocol: str) -> int:
    pod = _pod_of(state, dst)
    where = f"pod {pod[0]}/{pod[1]}" if pod else f"{dst} (not a pod)"
    for p in state.pods:
        if (p.namespace, p.name) == pod:
            for cp in p.ports:
                if cp.name == name and cp.protocol == protocol:
                    return cp.port
    raise ExplainError(f"the destination {where} declares no container port {name!r} ({protocol})")


def _verdict(v: DirectionVerdict | None) -> dict[str, object] | None:
    if v is None:
        return None
    return {
        "pod": v.pod,
        "direction": v.direction,
        "selected_by": list(v.selecting),
        "isolated": v.isolated,
        "allowed": v.allowed,
        "allowed_by": list(v.allowed_by),
        "reason": v.reason,
        # Calico's model: the tier and rule that decided, the Log rules met, what the
        # staged policies would have done (as the text output says them)
        "tier": v.tier,
        "decided_by": v.decided_by,
        "logged": list(v.logged),
        "staged": v.staged,
    }


def _label(t: Target) -> str:
    return f"{t[0]}/{t[1]}" if isinstance(t, tuple) else t


def explain(
    cluster: PolicyCluster,
    pod: str,
    *,
    to: str | None = None,
    from_: str | None = None,
    port: str | None = None,
) -> JSON:
    """The answer to ``tabbyctl policy explain POD [--to|--from X] [--port P/PROTO]``."""
    from policy import engine

    if to is not None and from_ is not None:
        raise ExplainError("give --to or --from, not both")
    state = cluster.state
    me = parse_pod(pod)
    label = f"{me[0]}/{me[1]}"
    if not _pod_known(state, me):
        raise ExplainError(f"pod {label} not found: no Pod resource and no WorkloadEndpoint")
    selected = engine.selecting_policies(state, *me)
    out: JSON = {
        "pod": label,
        "policies": selected,
        "isolated": {d: bool(names) for d, names in selected.items()},
        "traffic": None,
    }
    if to is None and from_ is None:
        if port is not None:
            raise ExplainError("--port goes with --to or --from")
        return out
    src: Target
    dst: Target
    if to is not None:
        src, dst = me, parse_target(to, "--to")
    else:
        src, dst = parse_target(str(from_), "--from"), me
    for t in (src, dst):
        if isinstance(t, tuple) and not _pod_known(state, t):
            raise ExplainError(
                f"pod {_label(t)} not found: no Pod resource and no WorkloadEndpoint"
            )
    protocol, number, port_name = "TCP", None, None
    if port is not None:
        value, protocol = parse_port(port)
        if isinstance(value, str):
            port_name = value
            number = _named_port(state, dst, value, protocol)
        else:
            number = value
    ex = predict(cluster, src, dst, protocol, number)
    out["traffic"] = {
        "src": ex.src,
        "dst": ex.dst,
        "protocol": ex.protocol,
        "port": ex.port,
        "port_name": port_name,
        "allowed": ex.allowed,
        "egress": _verdict(ex.egress),
        "ingress": _verdict(ex.ingress),
        "summary": ex.lines(),
    }
    return out


def predict(
    cluster: PolicyCluster, src: Target, dst: Target, protocol: str, port: int | None
) -> Explanation:
    """The engine's answer for a new connection ``src -> dst`` (``protocol``: TCP, UDP,
    SCTP, or e.g. ICMP, which only rules without ports allow), traffic from the
    destination's own node unpoliced, as tabby-node enforces it."""
    from policy import engine

    state = cluster.state
    node = _node_of(state, _pod_of(state, dst))
    hosts: Iterable[str] = cluster.node_addresses.get(node or "", ())
    try:
        return engine.explain(state, src, dst, protocol, port, node=node, host_addresses=hosts)
    except LookupError as e:
        raise ExplainError(
            f"{e.args[0] if e.args else e}: its traffic cannot be evaluated"
        ) from None


def explain_host(
    cluster: PolicyCluster,
    node: str,
    *,
    to: str | None = None,
    from_: str | None = None,
    port: str | None = None,
    in_interface: str | None = None,
    out_interface: str | None = None,
) -> JSON:
    """The answer to ``tabbyctl policy explain-host NODE``: a new connection from ``from_``
    to the node, from the node to ``to``, or (both) through it, and the host-endpoint
    stages it meets (Calico's default failsafe ports)."""
    from dataplane.names import DEFAULT_VETH_PREFIX
    from policy import engine

    if to is None and from_ is None:
        raise ExplainError("give --from, --to, or both (traffic through the node)")
    state = cluster.state
    # (a host endpoint's expected IP first: without an interface, its endpoint is the one)
    own = [a for h in state.host_endpoints if h.node == node for a in h.expected_ips]
    own += [a for a in cluster.node_addresses.get(node, ()) if a not in own]
    if not own and (to is None or from_ is None):
        raise ExplainError(f"node {node}: no address known (no Node resource, no host endpoint)")
    src = parse_target(from_, "--from") if from_ is not None else own[0]
    dst = parse_target(to, "--to") if to is not None else own[0]
    protocol, number = "TCP", None
    if port is not None:
        value, protocol = parse_port(port)
        if isinstance(value, str):
            raise ExplainError(f"--port {port!r}: a number (a host has no named ports here)")
        number = value
    try:
        ex = engine.explain(
            state,
            src,
            dst,
            protocol,
            number,
            node=node,
            host_addresses=own,
            in_interface=in_interface,
            out_interface=out_interface,
            workload_prefix=DEFAULT_VETH_PREFIX,
        )
    except LookupError as e:
        raise ExplainError(str(e.args[0] if e.args else e)) from None
    return {
        "node": node,
        "src": ex.src,
        "dst": ex.dst,
        "protocol": ex.protocol,
        "port": ex.port,
        "allowed": ex.allowed,
        "host": [_verdict(v) for v in ex.host],
        "egress": _verdict(ex.egress),
        "ingress": _verdict(ex.ingress),
        "summary": ex.lines(),
    }


def explain_lines(answer: JSON) -> list[str]:
    lines = [f"pod {answer['pod']}"]
    for d in ("ingress", "egress"):
        names = answer["policies"][d]
        if names:
            lines.append(f"  {d}: isolated, selected by {', '.join(names)}")
        else:
            lines.append(f"  {d}: not isolated (no policy selects it for {d}): all allowed")
    traffic = answer["traffic"]
    if traffic is None:
        return lines
    lines.append("")
    lines += traffic["summary"]
    if traffic["port_name"]:
        lines.append(
            f"  (port {traffic['port_name']} is {traffic['port']}/{traffic['protocol']}"
            " on the destination pod)"
        )
    if traffic["port"] is None and not traffic["allowed"]:
        lines.append(
            "  (without --port only rules that allow every port count: give --port P/PROTO)"
        )
    return lines


# -- the commands -------------------------------------------------------------------------------


@click.group("policy")
def policy_group() -> None:
    """NetworkPolicy: which policies select a pod, why traffic is allowed or not (explain),
    what the kernel denied (log) and what it does with a real probe (trace)."""


@policy_group.command("explain")
@click.argument("pod")
@click.option("--to", "to", metavar="POD|CIDR|IP", help="the peer POD sends to")
@click.option("--from", "from_", metavar="POD|CIDR|IP", help="the peer POD receives from")
@click.option(
    "--port",
    metavar="P/PROTO",
    help="destination port (number or container-port name) and protocol, e.g. 80/TCP, "
    "53/UDP, http (TCP when no protocol); without it only rules that allow every port count",
)
@output_option
@click.pass_obj
def explain_cmd(
    obj: Ctx, pod: str, to: str | None, from_: str | None, port: str | None, output: str
) -> None:
    """Which policies select POD (NAMESPACE/NAME) for ingress and egress; with --to or
    --from, whether a new connection is allowed and by which rule, or which isolation denies
    it. Computed from the datastore with the engine tabby-node enforces.

    Exit status 0 for any answer, allowed or denied; 1 when no answer can be given.
    """
    from tabbyctl.common import emit, operator_errors
    from tabbyctl.resources import open_resource_store

    if to is not None and from_ is not None:
        raise click.UsageError("give --to or --from, not both")
    if port is not None and to is None and from_ is None:
        raise click.UsageError("--port goes with --to or --from")
    with operator_errors():
        try:
            store = open_resource_store(obj)
            try:
                answer = explain(read_cluster(store), pod, to=to, from_=from_, port=port)
            finally:
                store.close()
        except ExplainError as e:
            raise click.ClickException(str(e)) from None
    lines = explain_lines(answer)
    if answer["traffic"] is not None:
        answer["traffic"] = {k: v for k, v in answer["traffic"].items() if k != "summary"}
    emit(output, answer, lines)


@policy_group.command("explain-host")
@click.argument("node")
@click.option("--from", "from_", metavar="POD|IP", help="a connection from here to NODE")
@click.option("--to", "to", metavar="POD|IP", help="a connection from NODE to here")
@click.option("--port", metavar="P/PROTO", help="destination port and protocol, e.g. 22/TCP")
@click.option("--in-interface", metavar="IF", help="the interface it arrives on at NODE")
@click.option("--out-interface", metavar="IF", help="the interface it leaves NODE by")
@output_option
@click.pass_obj
def explain_host_cmd(
    obj: Ctx,
    node: str,
    from_: str | None,
    to: str | None,
    port: str | None,
    in_interface: str | None,
    out_interface: str | None,
    output: str,
) -> None:
    """Host endpoints: whether a new connection to NODE (--from), from it (--to) or through
    it (both) is allowed, by which stage (untracked, pre-DNAT, normal, applyOnForward),
    tier, policy and rule, or by a failsafe port (Calico's defaults). Without an interface,
    that of the host endpoint whose expected IPs hold NODE's address, else the "*" one.

    Exit status 0 for any answer, allowed or denied; 1 when no answer can be given.
    """
    from tabbyctl.common import emit, operator_errors
    from tabbyctl.resources import open_resource_store

    with operator_errors():
        try:
            store = open_resource_store(obj)
            try:
                answer = explain_host(
                    read_cluster(store),
                    node,
                    to=to,
                    from_=from_,
                    port=port,
                    in_interface=in_interface,
                    out_interface=out_interface,
                )
            finally:
                store.close()
        except ExplainError as e:
            raise click.ClickException(str(e)) from None
    lines = list(answer.pop("summary"))
    emit(output, answer, lines)


@policy_group.command("log")
@click.option("--follow", "-f", is_flag=True, help="keep printing denied flows as they come")
@click.option("-n", "--namespace", help="only flows with a pod of this namespace at either end")
@click.option("--pod", metavar="POD", help="only flows with this pod at either end (NS/NAME)")
@click.option(
    "--node",
    "nodes",
    metavar="NODE",
    multiple=True,
    help="read this node's log (repeatable; its Node resource's address, --metrics-port) "
    "instead of this node's",
)
@click.option("--all-nodes", is_flag=True, help="read every node's log, merged by time")
@click.option(
    "--health-port",
    type=int,
    default=DEFAULT_HEALTH_PORT,
    show_default=True,
    envvar="TABBY_HEALTH_PORT",
    help="tabby-node's --health-port on this node (env TABBY_HEALTH_PORT)",
)
@click.option(
    "--metrics-port",
    type=int,
    default=DEFAULT_METRICS_PORT,
    show_default=True,
    envvar="TABBY_METRICS_PORT",
    help="tabby-node's --metrics-port on the nodes --node names (env TABBY_METRICS_PORT)",
)
@click.option(
    "--token-file",
    envvar="TABBY_POLICY_LOG_TOKEN_FILE",
    metavar="FILE",
    help="with --node/--all-nodes: a bearer token the nodes review with the Kubernetes API "
    "(a service account token for audience tabby-node; env TABBY_POLICY_LOG_TOKEN_FILE)",
)
@click.option(
    "--ca-file",
    envvar="TABBY_POLICY_LOG_CA_FILE",
    metavar="FILE",
    help="with --node/--all-nodes: HTTPS, the nodes' metrics certificates checked against "
    "this CA (env TABBY_POLICY_LOG_CA_FILE)",
)
@click.option(
    "--cert-file",
    envvar="TABBY_POLICY_LOG_CERT_FILE",
    metavar="FILE",
    help="with --ca-file: this client certificate (env TABBY_POLICY_LOG_CERT_FILE)",
)
@click.option(
    "--key-file",
    envvar="TABBY_POLICY_LOG_KEY_FILE",
    metavar="FILE",
    help="the key of --cert-file (env TABBY_POLICY_LOG_KEY_FILE)",
)
@output_option
@click.pass_obj
def log_cmd(
    obj: Ctx,
    follow: bool,
    namespace: str | None,
    pod: str | None,
    nodes: tuple[str, ...],
    all_nodes: bool,
    health_port: int,
    metrics_port: int,
    token_file: str | None,
    ca_file: str | None,
    cert_file: str | None,
    key_file: str | None,
    output: str,
) -> None:
    """The flows the kernel denied on this node (or --node's, --all-nodes'), newest last:
    when, both ends (pods named), protocol and port, the direction that denied it and the
    policies that isolate that side. From tabby-node (its last 1,000, one per flow in
    10 s). With -o json: one object per line. Other nodes serve their log to callers that
    authenticate: --token-file in Kubernetes, --cert-file/--key-file/--ca-file elsewhere."""
    from tabbyctl.policy_log import Credentials, LogError, local, pod_filter, show

    try:
        if nodes or all_nodes:
            creds = Credentials(token_file, cert_file, key_file or cert_file, ca_file)
            sources = _node_sources(obj, nodes, all_nodes, metrics_port, creds)
        else:
            sources = [local(health_port)]
        show(
            sources,
            follow=follow,
            keep=pod_filter(namespace, pod),
            output=output,
            echo=click.echo,
        )
    except (LogError, ExplainError) as e:
        raise click.ClickException(str(e)) from None
    except KeyboardInterrupt:
        return


def _node_sources(
    obj: Ctx,
    wanted: tuple[str, ...],
    every: bool,
    port: int,
    credentials: policy_log.Credentials,
) -> list[policy_log.Source]:
    """Where the named nodes' (or every node's) logs are: their Node resources' IPv4 (or
    IPv6) address."""
    from resources.index import NODES, Documents
    from tabbyctl.common import operator_errors
    from tabbyctl.policy_log import Source
    from tabbyctl.resources import open_resource_store

    with operator_errors():
        store = open_resource_store(obj)
        try:
            known = {k: e.value for k, e in Documents.read(store, (NODES,)).of(NODES).items()}
        finally:
            store.close()
    names = sorted(known) if every else list(dict.fromkeys(wanted))
    out = []
    for name in names:
        node = known.get(name)
        if node is None:
            raise ExplainError(f"node {name!r}: no such node")
        address = node.spec.ipv4Address or node.spec.ipv6Address
        if not address:
            raise ExplainError(f"node {name!r} has no address in its Node resource")
        host = address.split("/")[0]
        what = f"tabby-node of {name} on {host}:{port}"
        out.append(Source(host, port, what, credentials))
    if not out:
        raise ExplainError("no node to read a log from")
    return out
