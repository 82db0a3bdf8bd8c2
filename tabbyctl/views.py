"""What tabbyctl shows: settings from a conflist, IPAM views, node checks, tables.

Thin over the same libraries the binaries use (ipam.core, datastore, the dataplane), so
what an operator sees is what the plugins see.
"""

from __future__ import annotations

import datetime
import glob
import json
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from bundle.types import JSON, IPAddress, IPNetwork
from cni_config.common import DatastoreSettings, parse
from cni_config.resolve import resolve_datastore
from cni_plugin.config import PluginConf
from cni_protocol.errors import CniError
from dataplane.errors import DataplaneError
from dataplane.names import DEFAULT_VETH_PREFIX
from datastore import Store
from ipam import config as ipam_config
from ipam.core import Ipam, IpOwner, split_handle_id
from stores import open_store

DEFAULT_CONF_DIR = "/etc/cni/net.d"


class CtlError(Exception):
    """A problem to show the operator as one line (exit 1)."""


@dataclass
class Settings:
    """Where the datastore is and who this node is, as the plugins would see it."""

    source: str  # the conflist read, or "built-in defaults"
    network: str
    node: str
    ipam: ipam_config.IpamConf
    datastore: DatastoreSettings
    veth_prefix: str = DEFAULT_VETH_PREFIX
    plugin_conf: JSON = field(default_factory=dict)
    #: the stores opened through these settings, closed by ``close`` (at the command's end)
    opened: list[Store] = field(default_factory=list, repr=False)

    def open_store(self, *, lock_timeout: float | None = None) -> Store:
        settings = self.datastore
        if lock_timeout is not None:
            settings = settings.model_copy(update={"lock_timeout_seconds": lock_timeout})
        store = open_store(settings)
        self.opened.append(store)
        return store

    def close(self) -> None:
        """Every store opened here closed (its connections: the Kubernetes API's are kept
        alive, etcd's watch-free ones too)."""
        import contextlib

        while self.opened:
            with contextlib.suppress(Exception):
                self.opened.pop().close()

    def open(self, *, lock_timeout: float | None = None) -> Ipam:
        return Ipam(self.open_store(lock_timeout=lock_timeout), self.node)

    def describe_store(self) -> str:
        return self.datastore.describe()


def _tabby_entry(doc: JSON) -> JSON | None:
    plugins = doc.get("plugins") if isinstance(doc.get("plugins"), list) else [doc]
    for p in plugins or []:
        if isinstance(p, dict) and p.get("type") == "tabby":
            entry = dict(p)
            entry.setdefault("name", doc.get("name", ""))
            entry.setdefault("cniVersion", doc.get("cniVersion", ""))
            return entry
    return None


def find_conflist(conf_dir: str = DEFAULT_CONF_DIR) -> str | None:
    """The first conflist (lexically, as runtimes pick) whose plugins include tabby."""
    for path in sorted(glob.glob(os.path.join(conf_dir, "*.conf*"))):
        try:
            with open(path, encoding="utf-8") as f:
                doc = json.load(f)
        except (OSError, ValueError):
            continue
        if isinstance(doc, dict) and _tabby_entry(doc) is not None:
            return path
    return None


def load_settings(
    conf_path: str | None,
    *,
    data_dir: str | None = None,
    node: str | None = None,
    datastore_flags: Mapping[str, str | None] | None = None,
    env: Mapping[str, str] | None = None,
) -> Settings:
    """tabbyctl's view: the tabby entry of ``--conf`` (or the first tabby conflist, else
    defaults), validated by the same models the plugins use; the datastore from flags >
    environment > the conflist's ``ipam`` section > defaults."""
    source = "built-in defaults"
    entry: JSON = {"name": "k8s-pod-network", "ipam": {"type": "tabby-ipam"}}
    path = conf_path or find_conflist(DEFAULT_CONF_DIR)
    if path:
        try:
            with open(path, encoding="utf-8") as f:
                doc = json.load(f)
        except OSError as e:
            raise CtlError(f"cannot read {path}: {e.strerror}") from None
        except ValueError as e:
            raise CtlError(f"{path} is not valid JSON: {e}") from None
        found = _tabby_entry(doc) if isinstance(doc, dict) else None
        if found is None:
            raise CtlError(f"{path} has no plugin of type tabby")
        entry, source = found, path
    elif conf_path is None and not os.path.isdir(DEFAULT_CONF_DIR):
        source = f"built-in defaults (no {DEFAULT_CONF_DIR})"
    raw_ipam = entry.get("ipam") or {}
    if not isinstance(raw_ipam, dict):
        raise CtlError(f"{source}: the tabby plugin's ipam section is not a JSON object")
    if node:
        entry["nodename"] = node
    try:
        ipam = parse(ipam_config.IpamConf, raw_ipam, prefix="ipam.")
        # tabbyctl reads the datastore and identity settings; which IPAM binary the plugin
        # would exec is not its business, so a missing ipam.type is not an error here.
        plugin = parse(PluginConf, {**entry, "ipam": {"type": ipam.type, **raw_ipam}})
        flags = {**(datastore_flags or {}), "data_dir": data_dir}
        datastore = resolve_datastore(raw_ipam, flags, os.environ if env is None else env)
        node_name = plugin.node_name()
    except CniError as e:
        raise CtlError(f"{source}: {e}") from None
    return Settings(
        source=source,
        network=str(entry.get("name", "")),
        node=node_name,
        ipam=ipam,
        datastore=datastore,
        veth_prefix=plugin.veth_prefix,
        plugin_conf=entry,
    )


# -- tables --------------------------------------------------------------------------------


def table(headers: Sequence[str], rows: Sequence[Sequence[object]]) -> list[str]:
    cells = [[str(h) for h in headers]] + [["-" if v is None else str(v) for v in r] for r in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]
    return ["  ".join(v.ljust(w) for v, w in zip(r, widths, strict=True)).rstrip() for r in cells]


#: Counts up to this many digits print as they are; larger ones (IPv6 pools) as powers of two.
PLAIN_DIGITS = 9


def count_text(n: object) -> str:
    """An address count a person can read: as is up to ``PLAIN_DIGITS`` digits, else as a
    power of two (``2^80``), or one plus or minus a small rest (``2^64-70``), or roughly
    (``~2^79.6``). JSON output keeps the exact number."""
    if not isinstance(n, int) or isinstance(n, bool) or n < 10**PLAIN_DIGITS:
        return "-" if n is None else str(n)
    low = n.bit_length() - 1
    for p in (low, low + 1):
        rest = n - (1 << p)
        if abs(rest) < 10**6:
            return f"2^{p}" + ("" if rest == 0 else f"{rest:+d}")
    import math

    return f"~2^{math.log2(n):.1f}"


def when(ts: object) -> str:
    if not isinstance(ts, int | float):
        return "-"
    return datetime.datetime.fromtimestamp(ts, tz=datetime.UTC).strftime("%Y-%m-%d %H:%M:%SZ")


#: tabby-node's VXLAN tunnel addresses (``tabby_node.tunnels.Tunnels.ensure``): network
#: ``tabby-tunnel``, attribute ``purpose: vxlan-tunnel``. They have no netns and no host veth
#: by design: never a leak for ``ipam check`` or ``ipam gc``.
TUNNEL_NETWORK = "tabby-tunnel"
TUNNEL_PURPOSE = "vxlan-tunnel"


def is_tunnel(o: IpOwner) -> bool:
    if o.attrs.get("purpose") == TUNNEL_PURPOSE or o.attrs.get("network") == TUNNEL_NETWORK:
        return True
    return o.handle_id.split(":", 1)[0] == TUNNEL_NETWORK


def allocation_node(o: IpOwner) -> str | None:
    """The node an allocation belongs to: the one that recorded it, else its block's."""
    return o.attrs.get("node") or o.node


def owner_row(o: IpOwner) -> JSON:
    a = o.attrs
    pod = f"{a.get('pod_namespace')}/{a.get('pod_name')}" if a.get("pod_name") else ""
    try:
        network, cid, ifname = split_handle_id(o.handle_id)
    except Exception:
        network, cid, ifname = "", "", ""
    return {
        "ip": str(o.ip),
        "handle": o.handle_id,
        "block": o.block_cidr,
        "node": allocation_node(o),
        "network": a.get("network") or network,
        "container_id": a.get("container_id") or cid,
        "ifname": a.get("ifname") or ifname,
        "pod": pod,
        "pod_uid": a.get("pod_uid", ""),
        "netns": a.get("netns", ""),
        "time": a.get("time"),
        "purpose": TUNNEL_PURPOSE if is_tunnel(o) else "workload",
        "block_node": o.node,
    }


# -- the IPAM view (tabbyctl ipam show, and the demo) ---------------------------------------


def ipam_report(
    ipam: Ipam,
    reserved: Sequence[str | IPNetwork | IPAddress],
    *,
    show_blocks: bool,
    node: str | None = None,
) -> JSON:
    """Pools (cluster-wide), every allocation with its node, and the blocks with their
    node. ``node`` keeps that node's blocks and allocations only. Blocks are listed with
    ``show_blocks``, with ``node``, and whenever blocks belong to more than one node (a
    cluster: every node's blocks)."""
    pools = [p._asdict() for p in ipam.pool_usage(reserved)]
    owners = ipam.allocations()
    if node is not None:
        owners = [o for o in owners if allocation_node(o) == node]
    report: JSON = {"pools": pools, "allocations": [owner_row(o) for o in owners]}
    blocks = ipam.block_usage(reserved)
    if show_blocks or node is not None or len({b.node for b in blocks if b.node}) > 1:
        if node is not None:
            blocks = [b for b in blocks if b.node == node]
        report["blocks"] = [b._asdict() for b in blocks]
    if node is not None:
        report["node"] = node
    return report


def ipam_tables(report: JSON) -> list[str]:
    lines = table(
        ["POOL", "BLOCK SIZE", "TOTAL", "IN USE", "RESERVED", "FREE", "BLOCKS", "STATE"],
        [
            [
                p["cidr"],
                f"/{p['block_size']}",
                count_text(p["total"]),
                p["in_use"],
                count_text(p["reserved"]),
                count_text(p["free"]),
                p["blocks"],
                "disabled" if p["disabled"] else "enabled",
            ]
            for p in report["pools"]
        ],
    )
    if "blocks" in report:
        lines.append("")
        lines += table(
            ["BLOCK", "POOL", "AFFINITY", "IN USE", "FREE"],
            [
                [
                    b["cidr"],
                    b["pool"],
                    f"host:{b['node']}" if b["node"] else None,
                    b["in_use"],
                    b["free"],
                ]
                for b in report["blocks"]
            ],
        )
    if report["allocations"]:
        lines.append("")
        lines += table(
            ["IP", "NODE", "POD", "IFNAME", "CONTAINER", "SINCE"],
            [
                [
                    a["ip"],
                    a["node"],
                    a["pod"] or (TUNNEL_PURPOSE if a["purpose"] == TUNNEL_PURPOSE else None),
                    a["ifname"],
                    a["container_id"][:20],
                    when(a["time"]),
                ]
                for a in report["allocations"]
            ],
        )
    return lines


def render_ipam_summary(store: Store, *, show_blocks: bool) -> list[str]:
    return ipam_tables(ipam_report(Ipam(store, ""), [], show_blocks=show_blocks))


def allocated_addresses(store: Store) -> list[str]:
    return [str(o.ip) for o in Ipam(store, "").allocations()]


# -- this node: allocations vs namespaces, host veths and routes ----------------------------


def node_findings(settings: Settings, ipam: Ipam) -> list[dict[str, str]]:
    """Allocations of this node whose netns or host veth is gone (VXLAN tunnel addresses
    excepted: they have neither); host veths or routes with no allocation. Read-only."""
    import dataplane as dp

    findings: list[dict[str, str]] = []
    owners = [o for o in ipam.allocations() if allocation_node(o) == settings.node]
    by_handle: dict[str, list[IpOwner]] = {}
    for o in owners:
        if not is_tunnel(o):  # no netns, no veth: by design
            by_handle.setdefault(o.handle_id, []).append(o)
    try:
        veths = {v.name: v for v in dp.list_host_veths(settings.veth_prefix)}
    except DataplaneError as e:
        raise CtlError(f"cannot list host veths: {e}") from None
    expected_veths: dict[str, str] = {}
    for hid, allocs in sorted(by_handle.items()):
        network, cid, ifname = split_handle_id(hid)
        name = dp.host_veth_name(settings.veth_prefix, network, cid, ifname)
        expected_veths[name] = hid
        ips = ", ".join(str(a.ip) for a in allocs)
        netns = str(allocs[0].attrs.get("netns") or "")
        if netns and not os.path.exists(netns):
            findings.append(
                {
                    "kind": "netns-gone",
                    "subject": hid,
                    "message": f"{ips}: network namespace {netns} no longer exists",
                }
            )
        if name not in veths:
            findings.append(
                {
                    "kind": "host-veth-gone",
                    "subject": hid,
                    "message": f"{ips}: host veth {name} does not exist",
                }
            )
    held = {str(o.ip) for o in owners}
    for name, v in sorted(veths.items()):
        if name not in expected_veths:
            alias = getattr(v, "alias", "") or ""
            if alias.startswith("tabby:"):
                findings.append(
                    {
                        "kind": "veth-without-allocation",
                        "subject": name,
                        "message": f"host veth {name} ({alias}) has no allocation",
                    }
                )
        for route in v.routes:
            addr = str(route.network_address)
            if addr not in held:
                findings.append(
                    {
                        "kind": "route-without-allocation",
                        "subject": name,
                        "message": f"host route {route} dev {name}: address "
                        "not allocated to this node",
                    }
                )
    return findings


def tunnel_rows(ipam: Ipam, node: str) -> list[JSON]:
    """This node's VXLAN tunnel addresses (skipped by the node-local leak checks)."""
    return [owner_row(o) for o in ipam.allocations() if is_tunnel(o) and allocation_node(o) == node]


def tunnel_note(tunnels: Sequence[JSON]) -> list[str]:
    if not tunnels:
        return []
    what = ", ".join(f"{t['ip']} ({t['ifname']})" for t in tunnels)
    return [
        f"vxlan tunnel addresses of tabby-node (no netns or veth by design, never leaks): {what}"
    ]


# -- a node that is gone (tabbyctl ipam gc --node N) ------------------------------------------


def release_gone_node(
    ipam: Ipam, node: str, *, force: bool, dry_run: bool, kubernetes: bool = False
) -> JSON:
    """Release everything of ``node`` (``Ipam.release_node``): refused while its heartbeat
    document exists (its tabby-node is alive; in the Kubernetes datastore, ``kubernetes``:
    its Kubernetes Node is Ready, the kubelet's liveness) unless ``force``. ``dry_run``
    (allowed either way) lists what would go: the allocations recorded for the node, its
    blocks (deleted when only its own addresses are in them, else made affine to no node)."""
    beat = ipam.store.get("heartbeat", node)
    if beat is not None and not (force or dry_run):
        if kubernetes:
            raise CtlError(
                f"node {node} is alive: its Kubernetes Node is Ready; drain and delete it "
                f"(kubectl delete node {node}), or give --force"
            )
        last = when(beat.data.get("time")) if isinstance(beat.data, dict) else "-"
        raise CtlError(
            f"node {node} is alive: its heartbeat is in the datastore (kept alive since {last}); "
            "stop its tabby-node and let the heartbeat expire (--node-ttl), or give --force"
        )
    base = {"node": node, "dry_run": dry_run, "alive": beat is not None, "forced": force}
    if kubernetes:
        base["kubernetes"] = True
    if not dry_run:
        done = ipam.release_node(node)
        return {**base, **done._asdict()}
    owners = [o for o in ipam.allocations() if o.attrs.get("node") == node]
    mine: dict[str, int] = {}
    for o in owners:
        mine[o.block_cidr] = mine.get(o.block_cidr, 0) + 1
    blocks = [b for b in ipam.block_usage() if b.node == node]
    return {
        **base,
        "released": sorted({o.handle_id for o in owners}),
        "addresses": [str(o.ip) for o in owners],
        "deleted_blocks": [b.cidr for b in blocks if b.in_use == mine.get(b.cidr, 0)],
        "unaffined_blocks": [b.cidr for b in blocks if b.in_use != mine.get(b.cidr, 0)],
        "affinity_deleted": False,
        "errors": [],
    }


def gone_node_lines(data: JSON) -> list[str]:
    if data["dry_run"]:
        release, delete, make = "would release", "would delete", "would make"
    else:
        release, delete, make = "released", "deleted", "made"
    lines: list[str] = []
    if data["alive"]:
        why = (
            "its Kubernetes Node is Ready"
            if data.get("kubernetes")
            else "its heartbeat is in the datastore"
        )
        lines.append(f"warning: node {data['node']} is alive ({why})")
    rows = [[h, "release attachment"] for h in data["released"]]
    rows += [[b, "delete empty block"] for b in data["deleted_blocks"]]
    rows += [[b, "make block in use affine to no node"] for b in data["unaffined_blocks"]]
    if rows:
        lines += table(["HANDLE OR BLOCK", "ACTION"], rows)
    lines.append(
        f"node {data['node']}: {release} {len(data['addresses'])} address(es) of "
        f"{len(data['released'])} attachment(s), {delete} {len(data['deleted_blocks'])} "
        f"empty block(s), {make} {len(data['unaffined_blocks'])} block(s) still in use "
        "affine to no node"
    )
    return lines
