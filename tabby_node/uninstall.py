"""A stop that is an uninstall, told apart from a restart, and what an uninstall removes.

In Kubernetes tabby-node stops for one of two reasons, and they want opposite things:

* its pod is replaced or restarted (a rolling upgrade, ``kubectl rollout restart``, the
  container restarted, the node drained): the network goes on exactly as it is, for the
  running pods and for the ones created until the new tabby-node serves;
* tabby is uninstalled (``kubectl delete -f manifests/tabby.yaml``): nothing of tabby will
  serve this node again, and a new pod must not be started into a network that cannot carry
  it. The node is left without tabby's network for new pods: the conflist goes (the runtime
  then reports the network not ready, and the kubelet starts no pod there until another
  network is installed), and so does the nftables table ``inet tabby`` (it drops the
  traffic of every pod interface it has no rules for, and nothing would write them now).

What tells them apart, read when the stop begins (only with ``--daemonset``: without it a
stop is never an uninstall, as under systemd), first answer wins:

1. the DaemonSet running tabby-node (``--daemonset NAMESPACE/NAME``): gone (404) or being
   deleted (``deletionTimestamp``), an uninstall; there, a restart, unless its namespace is
   being deleted (the manifest deletes the namespace first, and its controller may delete
   the pods before kubectl reaches the DaemonSet);
2. tabby-node's own credentials refused (401: its ServiceAccount is gone) or its reading of
   the DaemonSet forbidden (403: its Role or RoleBinding is gone; they come in the same
   manifest as ``--daemonset``, so only their deletion forbids it): an uninstall (the
   manifest's deletion takes them before it reaches the DaemonSet);
3. otherwise (the API server unreachable, or failing) nothing is decided by the API, and
   the stop is an uninstall only if the watch saw tabby's CustomResourceDefinitions being
   deleted (the Kubernetes datastore: ``StoreRemoved``).

An uninstall removes, in this order: ``<cni-conf-dir>/10-tabby.conflist`` (first: no new
ADD starts after it), the plugins' kubeconfig and the etcd TLS files beside it (tabby's
credentials, useless without the conflist), then the table. Everything else stays: the
running pods' interfaces, addresses and routes (they keep talking, without policy), the
routes BIRD installed (it stops as for a restart), the VXLAN device, the binaries, the
bundle, ``/var/lib/tabby`` (docs/kubernetes.md "Uninstall" says how to remove them).
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
from collections.abc import Callable
from typing import NamedTuple

from bundle.types import JSON
from tabby_node import CNI_KUBECONFIG_NAME, CNI_TLS_DIR, CONFLIST_NAME

log = logging.getLogger("tabby.node")

#: Seconds the one request may take (the pod's grace period is 30 s).
TIMEOUT = 5.0


class Verdict(NamedTuple):
    uninstall: bool
    why: str


def daemonset_path(daemonset: str) -> str:
    namespace, _, name = daemonset.partition("/")
    return f"/apis/apps/v1/namespaces/{namespace}/daemonsets/{name}"


def read_verdict(
    daemonset: str,
    get: Callable[[str], JSON],
    store_removed: str | None,
) -> Verdict:
    """Uninstall or restart (module docstring), ``get`` being the API's GET of one path
    (raising ``stores.kube.client.ApiError``), ``store_removed`` what the watch said when
    it saw tabby's definitions being deleted (None: it did not)."""
    from stores.kube.client import ApiError, NotFound

    try:
        obj = get(daemonset_path(daemonset))
    except NotFound:
        return Verdict(True, f"the DaemonSet {daemonset} is gone")
    except ApiError as e:
        if e.status == 401:
            return Verdict(True, f"tabby-node's credentials are refused ({e})")
        if e.status == 403:
            return Verdict(True, f"tabby-node may no longer read its DaemonSet ({e})")
        if store_removed is not None:
            return Verdict(True, f"tabby's definitions are being deleted ({store_removed})")
        return Verdict(False, f"cannot read the DaemonSet {daemonset} ({e})")
    if _deleting(obj):
        return Verdict(True, f"the DaemonSet {daemonset} is being deleted")
    namespace = daemonset.partition("/")[0]
    try:
        if _deleting(get(f"/api/v1/namespaces/{namespace}")):
            return Verdict(True, f"the namespace {namespace} is being deleted")
    except ApiError as e:  # the DaemonSet is there: a restart
        log.info("cannot read the namespace %s: %s", namespace, e)
    return Verdict(False, f"the DaemonSet {daemonset} is there")


def _deleting(obj: JSON) -> bool:
    meta = obj.get("metadata")
    return isinstance(meta, dict) and bool(meta.get("deletionTimestamp"))


def remove_cni_files(cni_conf_dir: str) -> list[str]:
    """The conflist first, then the plugins' kubeconfig and TLS files; what was removed."""
    removed = []
    for name in (CONFLIST_NAME, CNI_KUBECONFIG_NAME):
        path = os.path.join(cni_conf_dir, name)
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)
            removed.append(path)
    tls = os.path.join(cni_conf_dir, CNI_TLS_DIR)
    if os.path.isdir(tls):
        shutil.rmtree(tls)
        removed.append(tls)
    return removed


class Uninstall:
    """The stop step of tabby-node in Kubernetes: reads the verdict and, for an uninstall,
    cleans the node (``delete_table``: the policy dataplane's)."""

    def __init__(
        self,
        daemonset: str,
        cni_conf_dir: str,
        *,
        kubeconfig: str | None,
        store_removed: Callable[[], str | None],
        delete_table: Callable[[], None],
    ) -> None:
        self.daemonset = daemonset
        self.cni_conf_dir = cni_conf_dir
        self.kubeconfig = kubeconfig
        self.store_removed = store_removed
        self.delete_table = delete_table

    def verdict(self) -> Verdict:
        from stores.kube.client import ApiError, KubeClient, KubeConfig

        try:
            client = KubeClient(
                KubeConfig.load(self.kubeconfig), timeout=TIMEOUT, agent="tabby-node"
            )
        except (ApiError, OSError, ValueError) as e:
            return read_verdict(self.daemonset, _unreachable(e), self.store_removed())
        try:
            return read_verdict(self.daemonset, client.get, self.store_removed())
        finally:
            client.close()

    def __call__(self) -> None:
        verdict = self.verdict()
        if not verdict.uninstall:
            log.warning("stopping, not uninstalled (%s): the node's network is kept", verdict.why)
            return
        log.warning("stopping: tabby is uninstalled (%s); cleaning the node", verdict.why)
        try:
            removed = remove_cni_files(self.cni_conf_dir)
        except OSError as e:
            log.error("uninstall: cannot remove tabby's CNI files: %s", e)
            removed = []
        try:
            self.delete_table()
        except Exception as e:  # the table may be gone already; the files went first
            log.error("uninstall: cannot delete the nftables table: %s", e)
        else:
            removed.append("nftables table inet tabby")
        log.warning(
            "uninstall: removed %s; running pods keep their interfaces and routes, "
            "without policy; no new pod starts here until a network is installed",
            ", ".join(removed) or "nothing",
        )


def _unreachable(error: Exception) -> Callable[[str], JSON]:
    from stores.kube.client import ApiError

    def get(path: str) -> JSON:
        raise ApiError(0, "no API configuration", str(error))

    return get
