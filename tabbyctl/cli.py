"""tabbyctl: a thin click layer over the libraries the binaries use.

Every listing takes ``-o table|json``. Errors an operator can act on are one line and
exit status 1 (no traceback): no conflist, unreadable store (which file), not root.
"""

from __future__ import annotations

import os
import sys

import click

from bundle import __version__
from cni_protocol.version import SUPPORTED_VERSIONS
from tabbyctl.common import Ctx, F, emit, operator_errors, output_option


def datastore_options(fn: F) -> F:
    """The datastore flags (docs/cluster.md "Datastore settings"); a flag wins over the
    environment (TABBY_*), which wins over ``--conf``."""
    from cni_config.resolve import SOURCES

    for name, (flag, var) in reversed(SOURCES.items()):
        if name == "data_dir":
            continue  # --data-dir predates the table and is declared with the group
        fn = click.option(flag, name, default=None, help=f"datastore setting (env {var})")(fn)
    return fn


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.option(
    "--conf",
    type=click.Path(dir_okay=False),
    help="conflist to read the store settings from (default: the first conflist in "
    "/etc/cni/net.d with a tabby plugin, else built-in defaults)",
)
@click.option("--data-dir", help="the file store directory (env TABBY_DATA_DIR)")
@click.option("--node", help="override this node's name")
@datastore_options
@click.pass_context
def cli(
    ctx: click.Context,
    /,
    conf: str | None,
    data_dir: str | None,
    node: str | None,
    **datastore: str | None,
) -> None:
    """Operate a tabby pod network: IPAM inspection and repair, pools, resources, demo."""
    ctx.obj = Ctx(conf, data_dir, node, datastore)
    ctx.call_on_close(ctx.obj.close)


@cli.command()
@output_option
def version(output: str) -> None:
    """Print tabbyctl's version and the CNI versions the plugins speak."""
    info = {
        "version": __version__,
        "cniVersions": list(SUPPORTED_VERSIONS),
        "python": sys.version.split()[0],
    }
    emit(
        output,
        info,
        [f"tabby {__version__} (CNI {', '.join(SUPPORTED_VERSIONS)}; Python {info['python']})"],
    )


# -- ipam --------------------------------------------------------------------------------


@cli.group()
def ipam() -> None:
    """Inspect and repair IP address management."""


@ipam.command("show")
@click.option("--show-blocks", is_flag=True, help="list blocks with their affinity")
@click.option("--ip", "ip", help="show who owns this address")
@click.option("--node", "node", help="only this node's blocks and allocations")
@output_option
@click.pass_obj
def ipam_show(obj: Ctx, show_blocks: bool, ip: str | None, node: str | None, output: str) -> None:
    """Pools with TOTAL / IN USE / RESERVED / FREE, every allocation with its node, or one
    IP's owner. Blocks (with their node) are listed with --show-blocks or --node, and
    whenever more than one node holds blocks."""
    from tabbyctl import views

    if ip and node:
        raise click.UsageError("give --ip or --node, not both")
    with operator_errors():
        s = obj.settings()
        ipam_ = s.open()
        if ip:
            owner = ipam_.who_owns(ip)
            if owner is None:
                emit(output, {"ip": ip, "allocated": False}, [f"{ip} is not allocated"])
                return
            row = views.owner_row(owner)
            emit(
                output,
                {**row, "allocated": True},
                views.table(
                    ["FIELD", "VALUE"],
                    [
                        [k.upper(), views.when(v) if k == "time" else (v or "-")]
                        for k, v in row.items()
                    ],
                ),
            )
            return
        report = views.ipam_report(
            ipam_, s.ipam.reserved_networks, show_blocks=show_blocks, node=node
        )
        report["store"] = s.describe_store()
        emit(
            output,
            report,
            [f"{s.describe_store()} ({s.source})", "", *views.ipam_tables(report)],
        )


@ipam.command("check")
@output_option
@click.pass_obj
def ipam_check(obj: Ctx, output: str) -> None:
    """Consistency of the store and of this node; exit 1 when problems are found."""
    from tabbyctl import views

    with operator_errors():
        s = obj.settings()
        ipam_ = s.open()
        store = [p._asdict() for p in ipam_.check()]
        node = views.node_findings(s, ipam_)
        tunnels = views.tunnel_rows(ipam_, s.node)
    problems = [p for p in store if p["severity"] == "error"] + node
    data = {"store": store, "node": node, "node_name": s.node, "ok": not problems}
    if tunnels:
        data["vxlan_tunnels"] = tunnels
    rows = [[p["severity"], p["kind"], p["subject"], p["message"]] for p in store]
    rows += [["node", f["kind"], f["subject"], f["message"]] for f in node]
    lines = (
        views.table(["SEVERITY", "KIND", "SUBJECT", "PROBLEM"], rows)
        if rows
        else [f"no problems found ({s.describe_store()}, node {s.node})"]
    )
    emit(output, data, lines + views.tunnel_note(tunnels))
    if problems:
        sys.exit(1)


@ipam.command("release")
@click.option("--ip", "ip", help="release this address")
@click.option(
    "--handle", help="release every address of this handle (<network>:<container id>:<ifname>)"
)
@output_option
@click.pass_obj
def ipam_release(obj: Ctx, ip: str | None, handle: str | None, output: str) -> None:
    """Release one allocation, by address or by handle."""
    if bool(ip) == bool(handle):
        raise click.UsageError("give exactly one of --ip or --handle")
    with operator_errors():
        ipam_ = obj.settings().open()
        if ip:
            done = ipam_.release_ip(ip)
            released = [ip] if done else []
        else:
            released = [str(a.ip) for a in ipam_.release_handle(str(handle))]
    emit(
        output,
        {"released": released},
        [f"released {', '.join(released)}" if released else "nothing to release"],
    )
    if not released:
        sys.exit(1)


@ipam.command("gc")
@click.option(
    "--grace",
    type=float,
    default=60.0,
    show_default=True,
    help="keep allocations younger than this many seconds",
)
@click.option("--dry-run", is_flag=True, help="only list what would be released")
@click.option("--node", "gone", help="release everything of this node, which is gone")
@click.option("--force", is_flag=True, help="with --node: even while its heartbeat is live")
@output_option
@click.pass_obj
def ipam_gc(
    obj: Ctx, grace: float, dry_run: bool, gone: str | None, force: bool, output: str
) -> None:
    """Release this node's allocations whose attachment is gone (netns and host veth).

    Use after a reboot or a crash left addresses behind: an allocation is released only
    when its network namespace no longer exists AND its host veth is gone. tabby-node's
    VXLAN tunnel addresses are never leaks.

    With --node N: release every allocation and block of node N, which is gone (refused
    while N's heartbeat is in the datastore, unless --force).
    """
    import time

    import dataplane as dp
    from ipam.core import split_handle_id
    from tabbyctl import views

    if force and not gone:
        raise click.UsageError("--force goes with --node")
    if gone:
        with operator_errors():
            s = obj.settings()
            data = views.release_gone_node(
                s.open(),
                gone,
                force=force,
                dry_run=dry_run,
                kubernetes=s.datastore.datastore_type == "kubernetes",
            )
        emit(output, data, views.gone_node_lines(data))
        if data["errors"]:
            raise click.ClickException(f"node {gone}: {'; '.join(data['errors'])}")
        return
    with operator_errors():
        s = obj.settings()
        ipam_ = s.open()
        live = {v.name for v in dp.list_host_veths(s.veth_prefix)}
        now = time.time()
        stale: dict[str, list[str]] = {}
        for o in ipam_.allocations():
            if views.allocation_node(o) != s.node or views.is_tunnel(o):
                continue
            t = o.attrs.get("time")
            if isinstance(t, int | float) and now - t < grace:
                continue
            netns = str(o.attrs.get("netns") or "")
            network, cid, ifname = split_handle_id(o.handle_id)
            veth = dp.host_veth_name(s.veth_prefix, network, cid, ifname)
            if veth in live or (netns and os.path.exists(netns)):
                continue
            stale.setdefault(o.handle_id, []).append(str(o.ip))
        released: dict[str, list[str]] = {}
        if not dry_run:
            for hid in stale:
                released[hid] = [str(a.ip) for a in ipam_.release_handle(hid)]
        tunnels = views.tunnel_rows(ipam_, s.node)
    shown = stale if dry_run else released
    verb = "would release" if dry_run else "released"
    if shown:
        lines = [
            *views.table(["HANDLE", "ADDRESSES"], [[h, ", ".join(a)] for h, a in shown.items()]),
            f"{verb} {sum(len(a) for a in shown.values())} addresses",
        ]
    else:
        lines = [f"no leaked allocations on node {s.node}"]
    report: dict[str, object] = {"dry_run": dry_run, "stale" if dry_run else "released": shown}
    if tunnels:
        report["vxlan_tunnels"] = tunnels
    emit(output, report, lines + views.tunnel_note(tunnels))


# -- pools -------------------------------------------------------------------------------


@cli.group()
def pool() -> None:
    """List and manage address pools."""


@pool.command("list")
@output_option
@click.pass_obj
def pool_list(obj: Ctx, output: str) -> None:
    """Pools with usage."""
    from tabbyctl import views

    with operator_errors():
        s = obj.settings()
        usage = [p._asdict() for p in s.open().pool_usage(s.ipam.reserved_networks)]
    emit(
        output,
        usage,
        views.ipam_tables({"pools": usage, "allocations": []})
        if usage
        else ["no pools yet (a pool is created on the first ADD that needs it)"],
    )


@pool.command("add")
@click.argument("cidr")
@click.option("--block-size", type=int, help="block prefix length (default 26 / 122)")
@click.pass_obj
def pool_add(obj: Ctx, cidr: str, block_size: int | None) -> None:
    """Create a pool."""
    from ipam.core import PoolSpec

    with operator_errors():
        obj.settings().open().add_pool(PoolSpec(cidr, block_size))
    click.echo(f"pool {cidr} added")


def _set_disabled(obj: Ctx, cidr: str, disabled: bool) -> None:
    with operator_errors():
        obj.settings().open().set_pool_disabled(cidr, disabled)
    click.echo(f"pool {cidr} {'disabled' if disabled else 'enabled'}")


@pool.command("disable")
@click.argument("cidr")
@click.pass_obj
def pool_disable(obj: Ctx, cidr: str) -> None:
    """Serve no new addresses from a pool (existing ones stay)."""
    _set_disabled(obj, cidr, True)


@pool.command("enable")
@click.argument("cidr")
@click.pass_obj
def pool_enable(obj: Ctx, cidr: str) -> None:
    """Serve addresses from a pool again."""
    _set_disabled(obj, cidr, False)


@pool.command("delete")
@click.argument("cidr")
@click.pass_obj
def pool_delete(obj: Ctx, cidr: str) -> None:
    """Delete a pool that holds no allocations (its empty blocks go with it)."""
    with operator_errors():
        obj.settings().open().delete_pool(cidr)
    click.echo(f"pool {cidr} deleted")


# -- node --------------------------------------------------------------------------------


@cli.group("node")
def node_group() -> None:
    """This node: tabby-node's status, diagnostics, and installing tabby on it."""


# -- demo --------------------------------------------------------------------------------


@cli.command()
@click.option(
    "--nodes",
    type=click.IntRange(1, 5),
    default=1,
    show_default=True,
    help="1: one node and its pods; 2-5: a cluster (etcd, tabby-node per node, routing)",
)
@click.option(
    "--backend",
    type=click.Choice(["bird", "vxlan"]),
    default="bird",
    show_default=True,
    help="with --nodes 2-5: how pods reach other nodes (BGP with BIRD, or VXLAN)",
)
@click.option(
    "--pods",
    type=click.IntRange(1, 50),
    default=None,
    help="pods (per node in a cluster); default 3 on one node, 2 per node in a cluster",
)
@click.option("--keep", is_flag=True, help="leave the namespaces and store in place")
@click.option(
    "--cni-bin-dir",
    default="/opt/cni/bin",
    show_default=True,
    help="where the installed plugins are",
)
@click.option(
    "--no-node",
    is_flag=True,
    help="one node only: do not start tabby-node, the plugins do all the work in-process",
)
def demo(
    nodes: int,
    backend: str,
    pods: int | None,
    keep: bool,
    cni_bin_dir: str,
    no_node: bool,
) -> None:
    """A pod network in throwaway namespaces, driven like a runtime, proved, cleaned up.

    --nodes 1 (default): a node and its pods, a tabby-node of its own serving the calls
    (unless --no-node). --nodes 2-5: a cluster on an underlay bridge with etcd, tabby-node
    on every node, pods reaching each other across nodes, a NetworkPolicy enforced.
    """
    from tabbyctl.demo.proc import LabError

    try:
        if nodes == 1:
            from tabbyctl.demo import single

            rc = single.run(pods or 3, keep, cni_bin_dir, click.echo, use_node=not no_node)
        else:
            if no_node:
                raise click.UsageError("--no-node applies to --nodes 1 only")
            from tabbyctl.demo import cluster

            rc = cluster.run(nodes, pods or 2, backend, keep, cni_bin_dir, click.echo)
    except LabError as e:
        raise click.ClickException(str(e)) from None
    sys.exit(rc)


def main() -> None:
    cli(prog_name="tabbyctl")


from tabbyctl import resources as _resources  # noqa: E402  (apply, get, delete, datastore)

cli.add_command(_resources.apply_cmd)
cli.add_command(_resources.get_cmd)
cli.add_command(_resources.delete_cmd)
cli.add_command(_resources.datastore)

from tabbyctl import node as _node  # noqa: E402  (node status)
from tabbyctl import policy as _policy  # noqa: E402  (policy explain, log)
from tabbyctl import policy_trace as _policy_trace  # noqa: E402, F401  (adds policy trace)

node_group.add_command(_node.status_cmd)
cli.add_command(_policy.policy_group)

from tabbyctl import diags as _diags  # noqa: E402  (node diags)
from tabbyctl import install as _install  # noqa: E402  (node install)

_diags.register(cli)
_install.register(node_group)
