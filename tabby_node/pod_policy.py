"""The no-window path: a pod's policy programmed before its ADD answers.

The CNI calls tabby-node serves record their pod's WorkloadEndpoint as the plugin does
(:class:`PodEndpoints`, the call server's endpoint recorder), then have the pod's rules
programmed at once (:class:`PodPolicy`), on the dataplane thread (``tabby_node.passes``),
before the ADD answers; a DEL takes them away.
"""

from __future__ import annotations

import contextlib
import logging
import time
from typing import TYPE_CHECKING

from cni_protocol.errors import CniError, Code
from policy.inputs import pod_key
from resources.index import ENDPOINTS, PODS

if TYPE_CHECKING:
    from bundle.types import IPAddress
    from cni_plugin.values import PluginValues
    from cni_protocol import skel
    from datastore.base import Doc
    from policy.state import PolicyDataplane
    from stores import Stores
    from tabby_node.cache import Cache
    from tabby_node.view import DataplaneThread, PolicyHooks

log = logging.getLogger("tabby.node")

ENDPOINT_WAIT_SECONDS = 10.0
#: How long a pod's ADD waits for tabby-kube-controllers to mirror the pod's labels.
MIRROR_WAIT_SECONDS = 10.0


class PodPolicy:
    """One endpoint's policy, asked for by a CNI thread and programmed on the dataplane
    thread (``dataplane``), which waits for it."""

    def __init__(
        self,
        cache: Cache,
        policy: PolicyDataplane,
        dataplane: DataplaneThread,
        metrics: PolicyHooks | None = None,
    ) -> None:
        self.cache = cache
        self.policy = policy
        self.dataplane = dataplane
        self.metrics = metrics

    def endpoint_added(self, key: str, doc: Doc | None) -> None:
        """The plugin recorded an endpoint (in a CNI thread): program its policy now
        (``doc``: as stored, when the cache may not have it yet)."""

        def program() -> None:
            if doc is not None:
                self.cache.put_local(ENDPOINTS.name, key, doc)
            self._program(key)

        self.dataplane.call(program, ENDPOINT_WAIT_SECONDS)

    def _program(self, key: str) -> None:
        from policy import inputs

        # ``synced``, not ``state``: the state is every endpoint's inputs, materialised
        # (O(endpoints in the cluster): ~8 ms at 20,000, on the path of every ADD served)
        if not self.policy.synced:
            return  # the first full sync will include it
        wep = self.cache.get(ENDPOINTS, key)
        if wep is None:
            return  # did not parse (logged): the next pass leaves it out as well
        pod = self.cache.get(PODS, pod_key(wep))
        result = self.policy.add_endpoint(
            inputs.endpoint(wep), inputs.pod(pod) if pod is not None else None
        )
        if self.metrics is not None:  # metrics
            self.metrics.policy_applied(result)

    def endpoint_removed(self, key: str) -> None:
        def unprogram() -> None:
            self.cache.put_local(ENDPOINTS.name, key, None)
            if self.policy.synced:
                namespace, _, name = key.partition("/")
                result = self.policy.remove_endpoint(namespace, name)
                if self.metrics is not None:  # metrics
                    self.metrics.policy_applied(result)

        self.dataplane.call(unprogram, ENDPOINT_WAIT_SECONDS)


class PodEndpoints:
    """tabby-node's endpoint recorder: the plugin's (the WorkloadEndpoint in the datastore,
    the writes of concurrent calls batched in one lock session: ``EndpointGroup``), then the
    pod's policy programmed (``policy``) before the ADD answers."""

    def __init__(self, cache: Cache, policy: PodPolicy, stores: Stores) -> None:
        from cni_plugin.plugin import DatastoreEndpoints, EndpointGroup

        self.cache = cache
        self.policy = policy
        self.inner = DatastoreEndpoints(stores, EndpointGroup(stores))

    def added(
        self,
        args: skel.CmdArgs,
        conf: PluginValues,
        addresses: list[IPAddress],
        host_ifname: str,
    ) -> None:
        self.wait_mirrored(args)
        # the write was learnt by the served store's knowledge: the cache holds it now
        key = self.inner.record(args, conf, addresses, host_ifname)
        made = None
        if conf.ipam.datastore_type == "kubernetes":  # made of the blocks, by the watch
            made = self.cache.endpoint_of_blocks(key, [str(a) for a in addresses])
        try:
            self.policy.endpoint_added(key, made)
        except Exception as e:
            raise CniError(
                Code.DATAPLANE, "cannot program the pod's network policy", str(e)
            ) from None

    def wait_mirrored(self, args: skel.CmdArgs) -> None:
        """No window: in Kubernetes mode the pod's rules must come from its labels, which
        tabby-kube-controllers mirror. Hold the ADD (bounded) until they are here; with the
        controllers down the pod starts at once, unlabelled until they arrive."""
        from cni_protocol.args import parse_cni_args

        cni_args = parse_cni_args(args.args)
        name = cni_args.get("K8S_POD_NAME", "")
        if not name:
            return
        namespace = cni_args.get("K8S_POD_NAMESPACE") or "default"
        uid = cni_args.get("K8S_POD_UID", "")
        started = time.monotonic()
        if not self.cache.wait_mirrored(namespace, name, uid, MIRROR_WAIT_SECONDS):
            log.warning(
                "pod %s/%s: its labels were not mirrored within %.0f s: starting it with what "
                "the datastore has (its rules follow when they arrive)",
                namespace,
                name,
                MIRROR_WAIT_SECONDS,
            )
        elif time.monotonic() - started > 0.05:
            log.info(
                "pod %s/%s: waited %.0f ms for its labels",
                namespace,
                name,
                (time.monotonic() - started) * 1000,
            )

    def removed(self, args: skel.CmdArgs, conf: PluginValues) -> None:
        key = self.inner.erase(args, conf)
        if key is not None:
            with contextlib.suppress(Exception):
                self.policy.endpoint_removed(key)
