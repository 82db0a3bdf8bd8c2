"""tabbyctl's resource commands: ``apply``, ``get``, ``delete``, ``datastore migrate``.

A thin click layer over ``resources.client.ResourceClient``. Files are YAML or JSON,
one or many documents (a ``kind: List`` is unpacked). Errors are one line on stderr and exit
status 1, nothing written. Registered on the ``tabbyctl`` group by ``tabbyctl.cli``.

How tabbyctl finds the datastore is ``open_resource_store`` and nothing else.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import TYPE_CHECKING, TypeVar

import click

if TYPE_CHECKING:
    import yaml

    from datastore.base import Store
    from resources.client import ResourceClient
    from resources.k8s import LabelSelector
    from resources.meta import Resource
    from resources.storage import KindInfo
    from tabbyctl.common import Ctx

OUTPUTS = ("table", "json", "yaml")
M = TypeVar("M", bound="Resource")


# -- the datastore seam ------------------------------------------------------------------------


def open_resource_store(obj: Ctx) -> Store:
    """THE place tabbyctl's resource commands get their store from.

    ``obj`` is the ``tabbyctl`` group's context object; today its ``settings()`` (the
    conflist named by ``--conf`` and the datastore flags, see ``tabbyctl.views``) name
    the datastore, opened with ``stores.open_store``.
    """
    from stores import open_store

    return open_store(obj.settings().datastore)


@contextmanager
def _client(obj: Ctx) -> Iterator[ResourceClient]:
    """A ResourceClient over the datastore, closed afterwards; failures become one line."""
    from resources.client import ResourceClient

    with _errors():
        store = open_resource_store(obj)
        try:
            yield ResourceClient(store, kubernetes_datastore=on_kubernetes(obj))
        finally:
            store.close()


def on_kubernetes(obj: Ctx) -> bool:
    """Whether the datastore is the Kubernetes API (docs/kubernetes.md "Kubernetes
    datastore"): what Kubernetes owns is read there, never written by tabbyctl."""
    return obj.settings().datastore.datastore_type == "kubernetes"


@contextmanager
def _errors() -> Iterator[None]:
    """Resource, store and configuration failures become one line and exit 1."""
    from resources.errors import ResourceError
    from tabbyctl.common import operator_errors

    with operator_errors():
        try:
            yield
        except ResourceError as e:
            raise click.ClickException(str(e)) from None


# -- reading files -------------------------------------------------------------------------------


class _NotResources(click.ClickException):
    pass


def _loader() -> type[yaml.SafeLoader]:
    """A safe YAML loader that keeps timestamps as strings (``creationTimestamp``)."""
    import yaml

    class Loader(yaml.SafeLoader):
        pass

    Loader.yaml_implicit_resolvers = {
        first: [(tag, rx) for tag, rx in resolvers if tag != "tag:yaml.org,2002:timestamp"]
        for first, resolvers in yaml.SafeLoader.yaml_implicit_resolvers.items()
    }
    return Loader


#: The most values the documents of one file may hold once YAML's aliases are expanded
#: (a manifest of a thousand resources holds ~100,000): an alias of an alias of ... (a
#: "billion laughs") is refused before anything walks it.
MAX_VALUES = 1_000_000


def _check_expansion(docs: list[object], source: str) -> None:
    """Refuse documents that contain themselves (a YAML alias inside its own anchor) or
    that expand past MAX_VALUES values: both would exhaust the stack or the memory of
    whatever walks them next (the models, JSON, the store)."""
    count = 0
    # (value, the ids of the containers above it): a container met again among its own
    # ancestors is a cycle; met elsewhere it is an alias, counted again as it expands
    todo: list[tuple[object, frozenset[int]]] = [(d, frozenset()) for d in docs]
    while todo:
        value, above = todo.pop()
        count += 1
        if count > MAX_VALUES:
            raise _NotResources(f"{source}: more than {MAX_VALUES:,} values (YAML aliases?)")
        if isinstance(value, dict | list):
            if id(value) in above:
                raise _NotResources(f"{source}: a YAML alias inside its own anchor")
            inner = above | {id(value)}
            children = value.items() if isinstance(value, dict) else enumerate(value)
            todo.extend((child, inner) for _, child in children)


def load_documents(text: str, source: str) -> list[object]:
    """Every document of a YAML or JSON text (``kind: List`` items unpacked)."""
    docs: list[object] | None = None
    if text.lstrip().startswith(("{", "[")):
        try:
            data = json.loads(text)
            docs = data if isinstance(data, list) else [data]
        except ValueError:
            docs = None  # may still be YAML flow style
        except RecursionError:
            raise _NotResources(f"{source}: nested too deeply") from None
    if docs is None:
        import yaml

        try:
            docs = [d for d in yaml.load_all(text, Loader=_loader()) if d is not None]
        except yaml.YAMLError as e:
            where = getattr(e, "problem_mark", None)
            at = f" (line {where.line + 1})" if where is not None else ""
            problem = getattr(e, "problem", None) or str(e).splitlines()[0]
            raise _NotResources(f"{source}: not YAML or JSON{at}: {problem}") from None
        except RecursionError:  # the parser's own recursion, past the stack
            raise _NotResources(f"{source}: nested too deeply") from None
    _check_expansion(docs, source)
    out: list[object] = []
    for doc in docs:
        if isinstance(doc, dict) and doc.get("kind") == "List" and "items" in doc:
            items = doc["items"]
            out.extend(items if isinstance(items, list) else [items])
        else:
            out.append(doc)
    if out and not any(isinstance(d, dict) for d in out):
        raise _NotResources(f"{source}: not YAML or JSON resource documents")
    return out


def _read_files(files: Sequence[str]) -> list[object]:
    docs: list[object] = []
    for path in files:
        try:
            if path == "-":
                text = sys.stdin.read()
            else:
                with open(path, encoding="utf-8") as f:
                    text = f.read()
        except OSError as e:
            raise click.ClickException(f"cannot read {path}: {e.strerror or e}") from None
        except UnicodeDecodeError:
            raise _NotResources(f"{path}: not YAML or JSON (not UTF-8 text)") from None
        docs.extend(load_documents(text, "standard input" if path == "-" else path))
    if not docs:
        raise click.ClickException(f"no documents in {', '.join(files)}")
    return docs


# -- output -------------------------------------------------------------------------------------


def _dump(output: str, data: object) -> None:
    if output == "json":
        click.echo(json.dumps(data, indent=2))
    else:
        import yaml

        click.echo(yaml.safe_dump(data, sort_keys=False, default_flow_style=False), nl=False)


def _labels(r: Resource) -> str:
    from resources.meta import format_labels

    return format_labels(r.metadata.labels)


def _rows(model: type[M], cells: Callable[[M], list[object]]) -> Callable[[Resource], list[object]]:
    """The cells of a resource of ``model``: a listing holds resources of one kind."""

    def row(r: Resource) -> list[object]:
        assert isinstance(r, model)
        return cells(r)

    return row


def _columns(info: KindInfo) -> tuple[list[str], Callable[[Resource], list[object]]]:
    """Table headers and row of each kind."""
    from resources.calico import CALICO_MODELS
    from resources.k8s import Namespace, NetworkPolicy, Pod, ServiceAccount
    from resources.tabby import BGPConfiguration, BGPPeer, IPPool, Node, WorkloadEndpoint

    kind = info.kind
    if kind == "IPPool":
        return [
            "NAME",
            "CIDR",
            "BLOCK SIZE",
            "IPIP",
            "VXLAN",
            "NAT",
            "DISABLED",
            "SELECTOR",
        ], _rows(
            IPPool,
            lambda r: [
                r.name,
                r.spec.cidr,
                r.spec.blockSize,
                r.spec.ipipMode or "-",
                r.spec.vxlanMode or "-",
                str(r.spec.natOutgoing).lower(),
                str(r.spec.disabled).lower(),
                r.spec.nodeSelector,
            ],
        )
    if kind == "Node":
        return ["NAME", "BACKEND", "IPV4", "IPV6", "ASN", "RR CLUSTER", "LABELS"], _rows(
            Node,
            lambda r: [
                r.name,
                r.spec.backend,
                r.spec.ipv4Address,
                r.spec.ipv6Address,
                r.spec.bgp.asNumber if r.spec.bgp else None,
                r.spec.bgp.routeReflectorClusterID if r.spec.bgp else None,
                _labels(r),
            ],
        )
    if kind == "BGPConfiguration":
        return ["NAME", "ASN", "MESH", "LOG"], _rows(
            BGPConfiguration,
            lambda r: [
                r.name,
                r.spec.asNumber,
                str(r.spec.nodeToNodeMeshEnabled).lower(),
                r.spec.logSeverityScreen,
            ],
        )
    if kind == "BGPPeer":
        return ["NAME", "PEER IP", "ASN", "PEER SELECTOR", "NODE", "NODE SELECTOR"], _rows(
            BGPPeer,
            lambda r: [
                r.name,
                r.spec.peerIP,
                r.spec.asNumber,
                r.spec.peerSelector,
                r.spec.node,
                r.spec.nodeSelector or ("-" if r.spec.node else "(all nodes)"),
            ],
        )
    if info.model in CALICO_MODELS:
        return _calico_columns(info)
    if info.model is NetworkPolicy:
        return ["NAMESPACE", "NAME", "POD-SELECTOR", "POLICY TYPES"], _rows(
            NetworkPolicy,
            lambda r: [
                r.namespace,
                r.name,
                _selector(r.spec.podSelector),
                ",".join(r.spec.policyTypes or ()),  # set by validation
            ],
        )
    if kind == "Namespace":
        return ["NAME", "LABELS"], _rows(Namespace, lambda r: [r.name, _labels(r)])
    if kind == "ServiceAccount":
        return ["NAMESPACE", "NAME", "LABELS"], _rows(
            ServiceAccount, lambda r: [r.namespace, r.name, _labels(r)]
        )
    if kind == "Pod":
        return ["NAMESPACE", "NAME", "LABELS", "NAMED PORTS"], _rows(
            Pod,
            lambda r: [
                r.namespace,
                r.name,
                _labels(r),
                ",".join(f"{n}:{port}/{proto}" for n, proto, port in r.named_ports()) or "-",
            ],
        )
    return [
        "NAMESPACE",
        "NAME",
        "NODE",
        "POD",
        "INTERFACE",
        "HOST INTERFACE",
        "NETWORKS",
        "LABELS",
    ], _rows(
        WorkloadEndpoint,
        lambda r: [
            r.namespace,
            r.name,
            r.spec.node,
            r.spec.pod,
            r.spec.interface,
            r.spec.hostInterface,
            ",".join(r.spec.ipNetworks) or "-",
            _labels(r),
        ],
    )


def _calico_columns(info: KindInfo) -> tuple[list[str], Callable[[Resource], list[object]]]:
    """Table headers and row of Calico's kinds (a Calico policy shows its tier: no table of
    it reads like one of Kubernetes' NetworkPolicies)."""
    from resources import calico

    def policy(r: calico.CalicoPolicy) -> list[object]:
        order = "-" if r.spec.order is None else f"{r.spec.order:g}"
        types = ",".join(r.spec.types or ())
        return [r.spec.tier, r.name, order, r.spec.selector or "all()", types]

    headers = ["TIER", "NAME", "ORDER", "SELECTOR", "TYPES"]
    model = info.model
    if model is calico.CalicoNetworkPolicy:
        return ["NAMESPACE", *headers], _rows(model, lambda r: [r.namespace, *policy(r)])
    if model is calico.GlobalNetworkPolicy:
        return headers, _rows(model, policy)
    if model is calico.StagedNetworkPolicy:
        return ["NAMESPACE", *headers, "STAGED ACTION"], _rows(
            model, lambda r: [r.namespace, *policy(r), r.spec.stagedAction]
        )
    if model is calico.StagedGlobalNetworkPolicy:
        return [*headers, "STAGED ACTION"], _rows(
            model, lambda r: [*policy(r), r.spec.stagedAction]
        )
    if model is calico.StagedKubernetesNetworkPolicy:
        return ["NAMESPACE", "NAME", "POD-SELECTOR", "POLICY TYPES", "STAGED ACTION"], _rows(
            model,
            lambda r: [
                r.namespace,
                r.name,
                _selector(r.spec.podSelector),
                ",".join(r.spec.policyTypes or ()),
                r.spec.stagedAction,
            ],
        )
    if model is calico.Tier:
        return ["NAME", "ORDER", "DEFAULT ACTION"], _rows(
            model,
            lambda r: [
                r.name,
                "-" if r.spec.order is None else f"{r.spec.order:g}",
                r.spec.defaultAction,
            ],
        )
    if model is calico.NetworkSet:
        return ["NAMESPACE", "NAME", "NETS", "LABELS"], _rows(
            model, lambda r: [r.namespace, r.name, ",".join(r.spec.nets or ()) or "-", _labels(r)]
        )
    if model is calico.GlobalNetworkSet:
        return ["NAME", "NETS", "LABELS"], _rows(
            model, lambda r: [r.name, ",".join(r.spec.nets or ()) or "-", _labels(r)]
        )
    return ["NAME", "NODE", "INTERFACE", "EXPECTED IPS", "LABELS"], _rows(
        calico.HostEndpoint,
        lambda r: [
            r.name,
            r.spec.node,
            r.spec.interfaceName or "-",
            ",".join(r.spec.expectedIPs or ()) or "-",
            _labels(r),
        ],
    )


def _selector(sel: LabelSelector) -> str:
    parts = [f"{k}={v}" for k, v in sorted((sel.matchLabels or {}).items())]
    for e in sel.matchExpressions or ():
        values = ",".join(e.values or ())
        parts.append(f"{e.key} {e.operator}" + (f" ({values})" if values else ""))
    return ",".join(parts) or "<all>"


# -- commands -----------------------------------------------------------------------------------

_FILES = click.option(
    "-f",
    "--filename",
    "files",
    multiple=True,
    metavar="FILE",
    help="YAML or JSON file of resources, - for standard input (repeatable)",
)


@click.command("apply")
@_FILES
@click.pass_obj
def apply_cmd(obj: Ctx, files: tuple[str, ...]) -> None:
    """Create or update resources from YAML or JSON, all or nothing.

    The fields a document sets are merged into an existing resource (as kubectl apply does);
    a metadata.resourceVersion must match the stored one. One invalid document fails the
    whole file: nothing is written.
    """
    if not files:
        raise click.UsageError("give -f FILE (or -f - for standard input)")
    docs = _read_files(files)
    with _client(obj) as client:
        applied = client.apply(docs)
    for a in applied:
        click.echo(f"{a.label} {a.action}")


@click.command("get")
@click.argument("kind")
@click.argument("name", required=False)
@click.option(
    "-n", "--namespace", help="namespace of a namespaced kind (default: all; with a NAME: default)"
)
@click.option("-o", "--output", type=click.Choice(OUTPUTS), default="table", show_default=True)
@click.pass_obj
def get_cmd(obj: Ctx, kind: str, name: str | None, namespace: str | None, output: str) -> None:
    """Show resources of KIND (singular, plural or short name: ippool, nodes, netpol, ns,
    pods, wep, ...), or the one named NAME."""
    from resources.storage import resolve_kind
    from tabbyctl.views import table

    with _client(obj) as client:
        info = resolve_kind(kind)
        if name is not None:
            items = [client.get(info, name, namespace)]
        else:
            items = client.list(info, namespace)
    if output != "table":
        if name is not None:
            _dump(output, items[0].wire())
        else:
            _dump(output, {"apiVersion": "v1", "kind": "List", "items": [r.wire() for r in items]})
        return
    if not items:
        where = f" in namespace {namespace}" if namespace and info.namespaced else ""
        click.echo(f"no {info.plural} found{where}")
        return
    headers, row = _columns(info)
    for line in table(headers, [row(r) for r in items]):
        click.echo(line)


@click.command("delete")
@click.argument("kind", required=False)
@click.argument("name", required=False)
@_FILES
@click.option("-n", "--namespace", help="namespace of a namespaced kind (default: default)")
@click.option("--ignore-not-found", is_flag=True, help="a resource that does not exist is no error")
@click.option(
    "--release-blocks",
    is_flag=True,
    help="delete node only: also release every address block the node holds",
)
@click.pass_obj
def delete_cmd(
    obj: Ctx,
    kind: str | None,
    name: str | None,
    files: tuple[str, ...],
    namespace: str | None,
    ignore_not_found: bool,
    release_blocks: bool,
) -> None:
    """Delete KIND NAME, or every resource named in -f FILE (all or nothing).

    Deleting a Node does not free its address blocks unless --release-blocks is given.
    """
    from resources.errors import NotFound
    from resources.storage import resolve_kind

    if bool(files) == bool(kind):
        raise click.UsageError("give KIND NAME or -f FILE")
    if files:
        if release_blocks:
            raise click.UsageError("--release-blocks goes with: delete node NAME")
        docs = _read_files(files)
        with _client(obj) as client:
            deleted = client.delete_documents(docs, ignore_not_found=ignore_not_found)
        for d in deleted:
            click.echo(f"{d.label} deleted")
        return
    if name is None:
        raise click.UsageError("give the NAME of the resource to delete")
    with _client(obj) as client:
        info = resolve_kind(str(kind))
        if release_blocks and info.kind != "Node":
            raise click.UsageError("--release-blocks goes with: delete node NAME")
        try:
            click.echo(f"{client.delete(info, name, namespace).label} deleted")
        except NotFound:
            if not (ignore_not_found or release_blocks):
                raise
        if release_blocks:
            click.echo(_release_node(client.store, name))


def _release_node(store: Store, node: str) -> str:
    """Release every block (and address) the node holds: ``Ipam.release_node``."""
    from ipam.core import Ipam

    done = Ipam(store, "").release_node(node)
    summary = (
        f"node {node}: released {len(done.addresses)} address(es) of {len(done.released)} "
        f"attachment(s), deleted {len(done.deleted_blocks)} empty block(s), "
        f"{len(done.unaffined_blocks)} block(s) still in use now affine to no node"
    )
    if done.errors:
        raise click.ClickException(f"{summary}; errors: {'; '.join(done.errors)}")
    return summary


@click.group("datastore")
def datastore() -> None:
    """Move tabby's state between datastores."""


@datastore.command("migrate")
@click.option("--to", "to", type=click.Choice(["etcdv3", "file", "kubernetes"]), required=True)
@click.option("--etcd-endpoints", help="target etcd endpoints (comma-separated URLs)")
@click.option("--etcd-prefix", help="target key prefix (default /tabby)")
@click.option("--etcd-ca-cert-file", help="target etcd CA certificate")
@click.option("--etcd-cert-file", help="target etcd client certificate")
@click.option("--etcd-key-file", help="target etcd client key")
@click.option("--to-data-dir", help="target file store directory (--to file)")
@click.option(
    "--kubeconfig",
    "to_kubeconfig",
    help="--to kubernetes: the target API server (default: KUBECONFIG, else the pod's "
    "service account)",
)
@click.option(
    "--settle",
    type=click.FloatRange(min=0),
    help="--to kubernetes: seconds to wait after freezing the source's pools, for the ADDs in "
    "flight (default: the source's lock_timeout_seconds)",
)
@click.option(
    "--abort",
    is_flag=True,
    help="--to kubernetes: end a migration instead: the source's pools enabled again, the "
    "target's IPAM copy removed (refused once a node allocated on the target)",
)
@click.pass_obj
def migrate(
    obj: Ctx,
    /,
    to: str,
    to_data_dir: str | None,
    to_kubeconfig: str | None,
    settle: float | None,
    abort: bool,
    **etcd: str | None,
) -> None:
    """Copy this node's datastore (pools, blocks, affinities, handles, resources, workload
    endpoints) into another one, which must hold no tabby data yet.

    The node's CNI calls wait while the copy runs; switch the node's conflist to the new
    datastore afterwards.

    --to kubernetes moves a running cluster into the Kubernetes API: the source's pools are
    frozen (no ADD allocates there), pools, BGP resources, Nodes, blocks and indexes merged
    into the API, the API's pools opened; then switch the nodes by a rolling restart. Run it
    again after an interruption; --abort ends it instead (docs/kubernetes.md).
    """
    from cni_config.resolve import resolve_datastore
    from resources.migrate import copy_store
    from stores import open_store

    if to == "file" and not to_data_dir:
        raise click.UsageError("--to file needs --to-data-dir DIR")
    if to != "kubernetes" and (to_kubeconfig or settle is not None or abort):
        raise click.UsageError("--kubeconfig, --settle and --abort go with --to kubernetes")
    flags: dict[str, str | None] = {"datastore_type": to, **etcd}
    if to == "file":
        flags["data_dir"] = to_data_dir
    if to == "kubernetes":
        flags["kubeconfig"] = to_kubeconfig
    with _errors():
        if to == "kubernetes" and on_kubernetes(obj):
            raise click.ClickException(
                "the datastore is the Kubernetes API already: nothing to move"
            )
        settings = resolve_datastore(None, flags, {} if to != "kubernetes" else _kube_env())
        source = open_resource_store(obj)
        try:
            target = open_store(settings)
            try:
                if to == "kubernetes":
                    _to_kubernetes(obj, source, target, settings.describe(), settle, abort)
                    return
                counts = copy_store(source, target)
            finally:
                target.close()
        finally:
            source.close()
    total = sum(counts.values())
    for kind, n in counts.items():
        click.echo(f"{kind:<18} {n}")
    click.echo(f"copied {total} documents to {settings.describe()}")


def _kube_env() -> dict[str, str]:
    """What the target's settings read of the environment: the kubeconfig only (the
    TABBY_* variables name the source)."""
    import os

    return {k: v for k, v in os.environ.items() if k == "KUBECONFIG"}


def _to_kubernetes(
    obj: Ctx, source: Store, target: Store, where: str, settle: float | None, abort: bool
) -> None:
    """``datastore migrate --to kubernetes`` (``resources.migrate_kube``)."""
    from resources import migrate_kube

    target.check_usable()
    if abort:
        done = migrate_kube.abort(source, target)
        click.echo(
            f"pools enabled again in the source: {', '.join(done.thawed) or 'none'}; "
            f"removed from {where}: {done.counts.get('blocks removed', 0)} block(s), "
            f"{done.counts.get('indexes removed', 0)} index(es)"
        )
        return
    wait = obj.settings().datastore.lock_timeout_seconds if settle is None else settle
    report = migrate_kube.migrate(source, target, settle=wait, say=click.echo)
    for line in report.skipped:
        click.echo(f"not copied: {line}", err=True)
    for line in report.conflicts:
        click.echo(f"conflict: {line}", err=True)
    for what in ("pools", "bgpconfigurations", "bgppeers", "nodes", "indexes", "blocks"):
        click.echo(f"{what:<18} {report.counts.get(what, 0)}")
    click.echo(f"{'allocations':<18} {report.counts.get('allocations', 0)}")
    click.echo(
        f"copied to {where} in {report.passes} pass(es); pools open there: "
        f"{', '.join(report.opened) or 'none new'}; now restart the nodes on the Kubernetes "
        'datastore (docs/kubernetes.md "Migrating a running cluster from etcd")'
    )


COMMANDS: tuple[click.Command, ...] = (apply_cmd, get_cmd, delete_cmd, datastore)
