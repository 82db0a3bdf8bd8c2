"""``tabbyctl node install``: put tabby on a node's own filesystem, as the init container of
the DaemonSet (manifests/tabby.yaml) does on every node before tabby-node starts.

What lands on the host (paths as the host sees them; ``--host-root`` is where the host's
filesystem is mounted, ``/host`` in the init container)::

    /opt/tabby/bundles/<id>/       the bundle (``<version>-<content hash>``), never changed
                                   once it has its name: copied to a temporary name first,
                                   then renamed; with links tabby-node, tabbyctl and
                                   tabby-kube-controllers -> tabby beside the executable
    /opt/tabby/current             -> bundles/<id>, replaced atomically (a new link renamed
                                   over the old one)
    /opt/cni/bin/tabby, tabby-ipam -> /opt/tabby/current/tabby, each replaced atomically
    /etc/cni/net.d/10-tabby.conflist   the ConfigMap's template with its placeholders filled
                                   in (below), checked as tabby's plugins would read it,
                                   written to a hidden temporary name and renamed (the
                                   runtime never reads half a file); written last: its
                                   appearance is what makes the node's network ready
    /etc/cni/net.d/tabby-tls/      the etcd TLS files, when configured (0600, dir 0700)
    /etc/cni/net.d/tabby-kubeconfig    the plugins' own API access in the Kubernetes datastore
                                   (0600, JSON): the API server at KUBERNETES_SERVICE_HOST
                                   and _PORT, its CA and the token of the service account
                                   tabby-cni, read from --cni-credentials (where the
                                   DaemonSet mounts the Secret tabby-cni-token); removed
                                   in another datastore
    /var/lib/tabby/nodename        the node's name (the pod's ``spec.nodeName``)

Why versioned directories and not one ``/opt/tabby`` swapped in place: the bundle is a
PyInstaller onedir bundle whose programs load their modules from files beside the executable
(``_internal``) while they run, and the loader resolves the executable's real path
(``/opt/tabby/bundles/<id>/tabby``): a plugin exec'd a moment before an upgrade keeps finding
its own files, which are never renamed or removed under it. Old bundles are removed, but the
one ``current`` pointed at before this install is kept (a plugin or a terminating tabby-node
may still run from it). The CNI binaries are links, not copies: an onedir executable needs its
``_internal`` beside it.

tabby-node's container runs the copy in ``/opt/tabby/current`` (the host's ``/opt/tabby``
mounted at the same path): a CNI call it serves enters the caller's mount namespace, the
host's, where every file of the bundle it runs from is then found at the same path, with the
same content.

Placeholders of the template (``cni_network_config``), each replaced by a JSON value, from
the environment the DaemonSet sets from the ConfigMap (the variables tabby-node reads)::

    __NODENAME__           "<TABBY_NODENAME>"
    __DATASTORE_TYPE__     "<TABBY_DATASTORE_TYPE>" (default "kubernetes")
    __KUBECONFIG__         "/etc/cni/net.d/tabby-kubeconfig" with datastore_type kubernetes,
                           else null
    __ETCD_ENDPOINTS__     ["<each of TABBY_ETCD_ENDPOINTS, comma-separated>"]
    __ETCD_PREFIX__        "<TABBY_ETCD_PREFIX>" (default "/tabby")
    __ETCD_CA_CERT_FILE__  "/etc/cni/net.d/tabby-tls/etcd-ca" when TABBY_ETCD_CA_CERT_FILE
                           names a file (copied there), else null; likewise
    __ETCD_CERT_FILE__     (TABBY_ETCD_CERT_FILE, etcd-cert) and
    __ETCD_KEY_FILE__      (TABBY_ETCD_KEY_FILE, etcd-key)
    __IPV4_POOLS__         ["<TABBY_IPV4_POOL>"], or [] when empty
    __IPV6_POOLS__         ["<TABBY_IPV6_POOL>"], or [] when unset or empty
    __ASSIGN_IPV4__        true when there is an IPv4 pool, else false
    __ASSIGN_IPV6__        likewise for IPv6
    __CNI_MTU__            TABBY_CNI_MTU as a number (default 0: tabby-node's MTU)
    __LOG_LEVEL__          "<TABBY_LOG_LEVEL>" (default "info")

The conflist written keeps the datastore settings of its own datastore only: with
``datastore_type`` ``kubernetes`` its ``ipam`` section has no ``etcd_*`` field, with another
no ``kubeconfig`` that is null (one template serves both, the ConfigMap's
``datastore_type`` chooses).

A placeholder the installer does not know, or a result that is not a conflist tabby's plugins
accept, or (in the Kubernetes datastore) no token or API server address for the plugins'
kubeconfig, fails the install with one line (the init container's log) and nothing written.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import re
import shutil
import stat
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path

import click

from bundle.types import JSON
from tabby_node import CNI_KUBECONFIG_NAME, CNI_TLS_DIR, CONFLIST_NAME, DEFAULT_CNI_CONF_DIR

INSTALL_DIR = "/opt/tabby"
CNI_BIN_DIR = "/opt/cni/bin"
CNI_CONF_DIR = DEFAULT_CNI_CONF_DIR
STATE_DIR = "/var/lib/tabby"
BUNDLES = "bundles"
CURRENT = "current"
EXECUTABLE = "tabby"
#: The CNI binaries in the CNI bin directory, links to the current bundle's executable.
CNI_LINKS = ("tabby", "tabby-ipam")
#: Links beside the executable in each installed bundle (the role is the name exec'd).
ROLE_LINKS = ("tabby-node", "tabbyctl", "tabby-kube-controllers")
TLS_DIR = CNI_TLS_DIR
#: placeholder -> (environment variable, file name under tabby-tls/)
TLS = {
    "__ETCD_CA_CERT_FILE__": ("TABBY_ETCD_CA_CERT_FILE", "etcd-ca"),
    "__ETCD_CERT_FILE__": ("TABBY_ETCD_CERT_FILE", "etcd-cert"),
    "__ETCD_KEY_FILE__": ("TABBY_ETCD_KEY_FILE", "etcd-key"),
}
TEMPLATE_ENV = "TABBY_CNI_NETWORK_CONFIG"
DATASTORE_ENV = "TABBY_DATASTORE_TYPE"
DEFAULT_DATASTORE = "kubernetes"
KUBECONFIG_NAME = CNI_KUBECONFIG_NAME
#: Where the DaemonSet mounts the Secret tabby-cni-token (a service account token Secret:
#: ``token``, ``ca.crt``): the plugins' credentials.
CNI_CREDENTIALS = "/var/run/secrets/tabby-cni"
#: The ipam settings only the etcd datastore reads (left out of a Kubernetes conflist).
ETCD_SETTINGS = (
    "etcd_endpoints",
    "etcd_prefix",
    "etcd_ca_cert_file",
    "etcd_cert_file",
    "etcd_key_file",
    "etcd_watch_transport",
    "etcd_watch_endpoints",
)
_PLACEHOLDER = re.compile(r"__[A-Z0-9_]+__")
_CHUNK = 1 << 20

Log = Callable[[str], None]


class InstallError(Exception):
    """The install cannot be done as asked: one line for the operator."""


@dataclass(frozen=True)
class Layout:
    """Where things go, as the host sees them, and where the host is mounted here."""

    host_root: Path = Path("/")
    install_dir: str = INSTALL_DIR
    cni_bin_dir: str = CNI_BIN_DIR
    cni_conf_dir: str = CNI_CONF_DIR
    conflist_name: str = CONFLIST_NAME
    state_dir: str = STATE_DIR

    def here(self, host_path: str) -> Path:
        """A host path as this process reaches it."""
        return self.host_root / host_path.lstrip("/")

    @property
    def bundles(self) -> Path:
        return self.here(self.install_dir) / BUNDLES

    @property
    def current(self) -> Path:
        return self.here(self.install_dir) / CURRENT

    def tls_file(self, name: str) -> str:
        """The host path of one etcd TLS file."""
        return f"{self.cni_conf_dir.rstrip('/')}/{TLS_DIR}/{name}"

    @property
    def kubeconfig(self) -> str:
        """The host path of the plugins' kubeconfig."""
        return f"{self.cni_conf_dir.rstrip('/')}/{KUBECONFIG_NAME}"


@dataclass
class Report:
    bundle_id: str = ""
    copied_bytes: int = 0
    previous: str | None = None
    removed: list[str] = field(default_factory=list)
    conflist: str = ""


# -- the bundle --------------------------------------------------------------------------------


def own_bundle() -> Path:
    """The directory of the bundle this tabbyctl runs from (a frozen one only)."""
    if not getattr(sys, "frozen", False):
        raise InstallError("not running from a bundle: give --bundle DIR (a ./build.sh bundle)")
    return Path(os.path.realpath(sys.executable)).parent


def _walk(root: Path) -> Iterator[tuple[str, os.stat_result]]:
    """(relative path, lstat) of everything under ``root``, in name order."""
    stack = [""]
    while stack:
        rel = stack.pop()
        names = sorted(os.listdir(root / rel) if rel else os.listdir(root), reverse=True)
        for name in names:
            path = f"{rel}/{name}" if rel else name
            st = os.lstat(root / path)
            yield path, st
            if stat.S_ISDIR(st.st_mode):
                stack.append(path)


def content_hash(bundle: Path) -> str:
    """A digest of the bundle's tree: every path, its kind and mode, a link's target and a
    file's bytes (the same bundle gives the same digest wherever it lies)."""
    h = hashlib.sha256()
    for rel, st in sorted(_walk(bundle)):
        mode = stat.S_IMODE(st.st_mode)
        if stat.S_ISLNK(st.st_mode):
            h.update(f"L {rel} {os.readlink(bundle / rel)}\n".encode())
        elif stat.S_ISDIR(st.st_mode):
            h.update(f"D {rel} {mode:o}\n".encode())
        elif stat.S_ISREG(st.st_mode):
            h.update(f"F {rel} {mode:o} {st.st_size}\n".encode())
            with open(bundle / rel, "rb") as f:
                while chunk := f.read(_CHUNK):
                    h.update(chunk)
        else:
            raise InstallError(f"{bundle / rel}: not a file, directory or link")
    return h.hexdigest()


def bundle_version(bundle: Path) -> str:
    """The version the bundle says it is (its executable run as ``tabbyctl version``)."""
    exe = bundle / EXECUTABLE
    if not os.access(exe, os.X_OK):
        raise InstallError(f"no bundle at {bundle} ({exe} missing)")
    try:
        proc = subprocess.run(
            ["tabbyctl", "version", "-o", "json"],
            executable=exe,
            capture_output=True,
            text=True,
            check=False,
            timeout=60,
        )
        return str(json.loads(proc.stdout)["version"])
    except (OSError, ValueError, KeyError, TypeError, subprocess.TimeoutExpired):
        raise InstallError(f"{exe} does not answer as tabbyctl version: a broken bundle") from None


def bundle_id(bundle: Path) -> str:
    """``<version>-<first 12 hex digits of the content hash>``."""
    return f"{bundle_version(bundle)}-{content_hash(bundle)[:12]}"


def _tree_bytes(root: Path) -> int:
    return sum(st.st_size for _, st in _walk(root) if stat.S_ISREG(st.st_mode))


def _fresh_link(target: str, path: Path) -> None:
    """``path`` -> ``target``, replacing whatever link or file was there in one rename."""
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    with contextlib.suppress(FileNotFoundError):
        os.unlink(tmp)
    os.symlink(target, tmp)
    try:
        os.replace(tmp, path)
    except OSError as e:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise InstallError(f"cannot replace {path}: {e.strerror}") from None


def _write_file(path: Path, data: bytes, mode: int) -> None:
    """``path`` holding ``data``, written under a hidden temporary name (no extension a CNI
    runtime would read), flushed to disk and renamed into place."""
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, mode)
    try:
        os.fchmod(fd, mode)
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view) :]
        os.fsync(fd)
    finally:
        os.close(fd)
    os.replace(tmp, path)


@contextlib.contextmanager
def _locked(directory: Path) -> Iterator[None]:
    """One install at a time per host (two pods of the DaemonSet may overlap on a node)."""
    directory.mkdir(mode=0o755, parents=True, exist_ok=True)
    fd = os.open(directory / ".install.lock", os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)


def install_bundle(bundle: Path, layout: Layout, log: Log, report: Report) -> None:
    """The bundle under ``bundles/<id>`` (copied unless there), ``current`` and the CNI
    links pointed at it, older bundles removed (the one ``current`` named before kept)."""
    ident = bundle_id(bundle)
    report.bundle_id = ident
    bundles = layout.bundles
    with _locked(layout.here(layout.install_dir)):
        bundles.mkdir(mode=0o755, parents=True, exist_ok=True)
        for stale in bundles.glob(".*.tmp-*"):  # an install that died half-way
            shutil.rmtree(stale, ignore_errors=True)
        final = bundles / ident
        if final.is_dir():
            log(f"bundle {ident} is already in {layout.install_dir}/{BUNDLES}")
        else:
            started = time.monotonic()
            staging = bundles / f".{ident}.tmp-{os.getpid()}"
            shutil.copytree(bundle, staging, symlinks=True)
            for role in ROLE_LINKS:
                os.symlink(EXECUTABLE, staging / role)
            os.chmod(staging, 0o755)  # noqa: S103 (programs every user may run)
            os.replace(staging, final)
            report.copied_bytes = _tree_bytes(final)
            log(
                f"bundle {ident} copied to {layout.install_dir}/{BUNDLES}/{ident} "
                f"({report.copied_bytes / 1e6:.1f} MB in {time.monotonic() - started:.1f} s)"
            )
        try:
            before = os.readlink(layout.current)
        except OSError:
            before = ""
        previous = os.path.basename(before.rstrip("/")) if before else None
        report.previous = previous if previous != ident else None
        _fresh_link(f"{BUNDLES}/{ident}", layout.current)
        log(f"{layout.install_dir}/{CURRENT} -> {BUNDLES}/{ident}")
        cni_bin = layout.here(layout.cni_bin_dir)
        cni_bin.mkdir(mode=0o755, parents=True, exist_ok=True)
        target = f"{layout.install_dir.rstrip('/')}/{CURRENT}/{EXECUTABLE}"
        for name in CNI_LINKS:
            _fresh_link(target, cni_bin / name)
        log(f"{layout.cni_bin_dir}/{{{','.join(CNI_LINKS)}}} -> {target}")
        keep = {ident, previous}
        for old in sorted(bundles.iterdir()):
            if old.name not in keep and not old.name.startswith("."):
                shutil.rmtree(old, ignore_errors=True)
                report.removed.append(old.name)
                log(f"removed the old bundle {old.name}")


# -- the node's files ----------------------------------------------------------------------------


def _tls_files(layout: Layout, env: Mapping[str, str]) -> dict[str, str | None]:
    """Each TLS placeholder's host path (the file copied there), or None."""
    out: dict[str, str | None] = {}
    tls_dir = layout.here(layout.cni_conf_dir) / TLS_DIR
    for placeholder, (var, name) in TLS.items():
        source = env.get(var, "")
        if not source:
            out[placeholder] = None
            with contextlib.suppress(FileNotFoundError):
                os.unlink(tls_dir / name)  # no longer configured
            continue
        try:
            data = Path(source).read_bytes()
        except OSError as e:
            raise InstallError(f"{var}={source}: {e.strerror}") from None
        tls_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
        os.chmod(tls_dir, 0o700)
        _write_file(tls_dir / name, data, 0o600)
        out[placeholder] = layout.tls_file(name)
    return out


def datastore_type(env: Mapping[str, str]) -> str:
    return env.get(DATASTORE_ENV, "") or DEFAULT_DATASTORE


def cni_kubeconfig(credentials: Path, env: Mapping[str, str]) -> bytes:
    """The plugins' kubeconfig (JSON, which is YAML): the API server the pod reaches
    (``KUBERNETES_SERVICE_HOST``/``_PORT``: the kubelet's service address, or the ConfigMap
    tabby-kubernetes-api's), the CA and the token of the Secret mounted at ``credentials``."""
    import base64

    host = env.get("KUBERNETES_SERVICE_HOST", "")
    port = env.get("KUBERNETES_SERVICE_PORT", "") or "443"
    if not host:
        raise InstallError(
            "KUBERNETES_SERVICE_HOST is not set: no API server address for the plugins' "
            "kubeconfig (the ConfigMap tabby-kubernetes-api gives one)"
        )
    found: dict[str, bytes] = {}
    for name in ("token", "ca.crt"):
        try:
            found[name] = (credentials / name).read_bytes()
        except OSError as e:
            raise InstallError(
                f"{credentials / name}: {e.strerror} (the Secret tabby-cni-token, mounted "
                "there, has no token yet?)"
            ) from None
    token = found["token"].decode(errors="replace").strip()
    if not token:
        raise InstallError(f"{credentials / 'token'} is empty: the Secret has no token yet")
    server = f"https://[{host}]:{port}" if ":" in host else f"https://{host}:{port}"
    doc = {
        "apiVersion": "v1",
        "kind": "Config",
        "clusters": [
            {
                "name": "kubernetes",
                "cluster": {
                    "server": server,
                    "certificate-authority-data": base64.b64encode(found["ca.crt"]).decode(),
                },
            }
        ],
        "users": [{"name": "tabby-cni", "user": {"token": token}}],
        "contexts": [
            {"name": "tabby-cni", "context": {"cluster": "kubernetes", "user": "tabby-cni"}}
        ],
        "current-context": "tabby-cni",
    }
    return (json.dumps(doc, indent=2) + "\n").encode()


def _pools(value: str) -> list[str]:
    return [value] if value.strip() else []


def placeholders(
    env: Mapping[str, str],
    tls: Mapping[str, str | None],
    nodename: str,
    kubeconfig: str | None = None,
) -> dict[str, object]:
    """Each placeholder's JSON value (module docstring); ``kubeconfig``: the host path of
    the plugins' kubeconfig (the Kubernetes datastore)."""
    endpoints = [e.strip() for e in env.get("TABBY_ETCD_ENDPOINTS", "").split(",") if e.strip()]
    v4 = _pools(env.get("TABBY_IPV4_POOL", ""))
    v6 = _pools(env.get("TABBY_IPV6_POOL", ""))
    mtu_text = env.get("TABBY_CNI_MTU", "") or "0"
    try:
        mtu = int(mtu_text)
    except ValueError:
        raise InstallError(f"TABBY_CNI_MTU={mtu_text!r} is not a number") from None
    return {
        "__NODENAME__": nodename,
        "__DATASTORE_TYPE__": datastore_type(env),
        "__KUBECONFIG__": kubeconfig,
        "__ETCD_ENDPOINTS__": endpoints,
        "__ETCD_PREFIX__": env.get("TABBY_ETCD_PREFIX", "") or "/tabby",
        **tls,
        "__IPV4_POOLS__": v4,
        "__IPV6_POOLS__": v6,
        "__ASSIGN_IPV4__": bool(v4),
        "__ASSIGN_IPV6__": bool(v6),
        "__CNI_MTU__": mtu,
        "__LOG_LEVEL__": env.get("TABBY_LOG_LEVEL", "") or "info",
    }


def render_conflist(template: str, values: Mapping[str, object]) -> JSON:
    """The template with every placeholder replaced by its JSON value, checked: JSON, a
    conflist (``name``, ``plugins``) with a ``tabby`` plugin whose fields and ``ipam``
    section tabby's plugins accept."""
    unknown = sorted(set(_PLACEHOLDER.findall(template)) - set(values))
    if unknown:
        raise InstallError(f"the conflist template has unknown placeholders: {', '.join(unknown)}")
    text = _PLACEHOLDER.sub(lambda m: json.dumps(values[m.group(0)]), template)
    try:
        doc = json.loads(text)
    except ValueError as e:
        raise InstallError(f"the conflist template is not JSON once filled in: {e}") from None
    if not isinstance(doc, dict) or not isinstance(doc.get("plugins"), list) or not doc.get("name"):
        raise InstallError("the conflist template is not a conflist (name, plugins)")
    tabby = [p for p in doc["plugins"] if isinstance(p, dict) and p.get("type") == "tabby"]
    if len(tabby) != 1:
        raise InstallError("the conflist template must have exactly one plugin of type tabby")
    _own_datastore_only(tabby[0])
    check_plugin(doc, tabby[0])
    return doc


def _own_datastore_only(plugin: JSON) -> None:
    """The ipam section without the settings of the datastore it does not name."""
    ipam = plugin.get("ipam")
    if not isinstance(ipam, dict):
        return
    if ipam.get("datastore_type") == "kubernetes":
        for name in ETCD_SETTINGS:
            ipam.pop(name, None)
    elif ipam.get("kubeconfig", "") is None:
        del ipam["kubeconfig"]


def check_plugin(conflist: JSON, plugin: JSON) -> None:
    """Read the tabby plugin's configuration as the ``tabby`` and ``tabby-ipam`` binaries
    will: any problem they would report is reported now, naming the field."""
    from cni_plugin.config import parse_plugin
    from cni_protocol.errors import CniError
    from ipam.config import parse_plugin as parse_ipam

    conf = {"cniVersion": conflist.get("cniVersion", "1.0.0"), "name": conflist["name"], **plugin}
    try:
        parse_plugin(conf)
        ipam = conf.get("ipam")
        if not isinstance(ipam, dict) or ipam.get("type") != "tabby-ipam":
            raise InstallError("the tabby plugin must delegate to ipam type tabby-ipam")
        parse_ipam(conf)
    except CniError as e:
        raise InstallError(f"the conflist would not work: {e}") from None


def _kubeconfig_file(
    layout: Layout, credentials: Path, env: Mapping[str, str], log: Log
) -> str | None:
    """The plugins' kubeconfig written (the Kubernetes datastore: its host path), or a
    stale one removed (another datastore: None)."""
    target = layout.here(layout.cni_conf_dir) / KUBECONFIG_NAME
    if datastore_type(env) != "kubernetes":
        with contextlib.suppress(FileNotFoundError):
            os.unlink(target)  # no longer the datastore
        return None
    data = cni_kubeconfig(credentials, env)
    target.parent.mkdir(mode=0o755, parents=True, exist_ok=True)
    _write_file(target, data, 0o600)
    log(f"{layout.kubeconfig}: the plugins' API access (service account tabby-cni)")
    return layout.kubeconfig


def install_files(
    layout: Layout,
    template: str,
    nodename: str,
    env: Mapping[str, str],
    log: Log,
    report: Report,
    credentials: Path = Path(CNI_CREDENTIALS),
) -> None:
    """The node name, the TLS files, the plugins' kubeconfig and, last, the conflist."""
    from cni_config.common import node_name_problem

    problem = node_name_problem(nodename)
    if problem is not None:
        raise InstallError(f"node name {nodename!r}: {problem}")
    tls = _tls_files(layout, env)
    kubeconfig = _kubeconfig_file(layout, credentials, env, log)
    doc = render_conflist(template, placeholders(env, tls, nodename, kubeconfig))
    state = layout.here(layout.state_dir)
    state.mkdir(mode=0o755, parents=True, exist_ok=True)
    _write_file(state / "nodename", f"{nodename}\n".encode(), 0o644)
    log(f"{layout.state_dir}/nodename: {nodename}")
    for placeholder, path in tls.items():
        if path is not None:
            log(f"{path} from {env[TLS[placeholder][0]]}")
    conf_dir = layout.here(layout.cni_conf_dir)
    conf_dir.mkdir(mode=0o755, parents=True, exist_ok=True)
    target = conf_dir / layout.conflist_name
    _write_file(target, (json.dumps(doc, indent=2) + "\n").encode(), 0o644)
    report.conflist = f"{layout.cni_conf_dir.rstrip('/')}/{layout.conflist_name}"
    log(f"{report.conflist} written")
    earlier = sorted(
        n
        for n in os.listdir(conf_dir)
        if n.endswith((".conf", ".conflist", ".json"))
        and not n.startswith(".")
        and n < layout.conflist_name
    )
    if earlier:
        log(
            f"warning: {', '.join(earlier)} sorts before {layout.conflist_name}: runtimes use the "
            "first network configuration they find, so pods would not get tabby's network"
        )


def install(
    layout: Layout,
    bundle: Path,
    template: str,
    nodename: str,
    env: Mapping[str, str],
    log: Log,
    *,
    bundle_too: bool = True,
    credentials: Path = Path(CNI_CREDENTIALS),
) -> Report:
    """Everything, in the order that never exposes a half-done node (module docstring)."""
    report = Report()
    if not template.strip():
        raise InstallError(f"no conflist template: give --conflist-template or {TEMPLATE_ENV}")
    # The template and the plugins' credentials are checked before anything is changed on
    # the host.
    kubeconfig = None
    if datastore_type(env) == "kubernetes":
        cni_kubeconfig(credentials, env)
        kubeconfig = layout.kubeconfig
    render_conflist(template, placeholders(env, dict.fromkeys(TLS, None), nodename, kubeconfig))
    if bundle_too:
        install_bundle(bundle, layout, log, report)
    install_files(layout, template, nodename, env, log, report, credentials)
    return report


# -- the command ---------------------------------------------------------------------------------


def register(node_group: click.Group) -> None:
    """``install`` under tabbyctl's ``node`` group."""

    @node_group.command("install")
    @click.option(
        "--host-root",
        default="/",
        show_default=True,
        type=click.Path(file_okay=False, exists=True),
        help="where the host's filesystem is mounted (the init container: /host)",
    )
    @click.option(
        "--bundle",
        type=click.Path(file_okay=False, exists=True),
        help="the bundle to install (default: the one this tabbyctl runs from)",
    )
    @click.option(
        "--conflist-template",
        type=click.Path(dir_okay=False, exists=True),
        help=f"the conflist with placeholders (default: the text of {TEMPLATE_ENV})",
    )
    @click.option(
        "--nodename",
        envvar="TABBY_NODENAME",
        help="this node's name (env TABBY_NODENAME; the DaemonSet: spec.nodeName)",
    )
    @click.option("--install-dir", default=INSTALL_DIR, show_default=True)
    @click.option("--cni-bin-dir", default=CNI_BIN_DIR, show_default=True)
    @click.option("--cni-conf-dir", default=CNI_CONF_DIR, show_default=True)
    @click.option("--conflist-name", default=CONFLIST_NAME, show_default=True)
    @click.option("--state-dir", default=STATE_DIR, show_default=True)
    @click.option(
        "--cni-credentials",
        default=CNI_CREDENTIALS,
        show_default=True,
        type=click.Path(file_okay=False),
        help="the plugins' service account token and CA (token, ca.crt): the Kubernetes "
        "datastore's kubeconfig is made of them",
    )
    @click.option(
        "--no-bundle",
        is_flag=True,
        help="only the conflist, TLS files, kubeconfig and node name",
    )
    def install_cmd(
        host_root: str,
        bundle: str | None,
        conflist_template: str | None,
        nodename: str | None,
        install_dir: str,
        cni_bin_dir: str,
        cni_conf_dir: str,
        conflist_name: str,
        state_dir: str,
        cni_credentials: str,
        no_bundle: bool,
    ) -> None:
        """Install tabby on this node: the bundle, the CNI binaries, the conflist (from a
        template whose placeholders come from TABBY_* variables), the etcd TLS files or the
        plugins' kubeconfig, and the node name, each replaced atomically (what the
        DaemonSet's init container runs; docs/kubernetes.md "Installing on Kubernetes")."""
        try:
            if not nodename:
                raise InstallError("no node name: give --nodename or TABBY_NODENAME")
            for name, value in (
                ("--install-dir", install_dir),
                ("--cni-bin-dir", cni_bin_dir),
                ("--cni-conf-dir", cni_conf_dir),
                ("--state-dir", state_dir),
            ):
                if not value.startswith("/"):
                    raise InstallError(f"{name} {value}: not an absolute path")
            if "/" in conflist_name or not conflist_name.endswith(".conflist"):
                raise InstallError(f"--conflist-name {conflist_name}: a file name *.conflist")
            if conflist_template is not None:
                template = Path(conflist_template).read_text(encoding="utf-8")
            else:
                template = os.environ.get(TEMPLATE_ENV, "")
            layout = Layout(
                Path(host_root), install_dir, cni_bin_dir, cni_conf_dir, conflist_name, state_dir
            )
            source = Path(bundle) if bundle else (own_bundle() if not no_bundle else Path("."))
            started = time.monotonic()
            install(
                layout,
                source,
                template,
                nodename,
                os.environ,
                click.echo,
                bundle_too=not no_bundle,
                credentials=Path(cni_credentials),
            )
            click.echo(f"tabby installed on {nodename} in {time.monotonic() - started:.1f} s")
        except InstallError as e:
            raise click.ClickException(str(e)) from None
        except OSError as e:
            where = f"{e.filename}: " if e.filename else ""
            raise click.ClickException(f"install failed: {where}{e.strerror or e}") from None
