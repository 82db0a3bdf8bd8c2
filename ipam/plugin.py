"""tabby-ipam's CNI adapter: CmdArgs in, IPAM core calls, IPAM-shaped result out.

The core knows nothing of CNI; this module maps CNI inputs to an AssignRequest (specific
IPs, pod-annotation pools, the attachment's identity and metadata) and core errors to
CNI codes (docs/configuration.md "Error codes": 100-102, 11 for a lock timeout). Rule IDs
(IPM-12, ...) are defined in cni_protocol/CONFORMANCE.md.
"""

from __future__ import annotations

import ipaddress
import json
import logging
import time
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, TypeVar

from bundle.types import JSON
from bundle.types import IPAddress as Address
from cni_config import known
from cni_config.teardown import TEARDOWN_VERBS, Teardown, Unknown
from cni_config.values import CommonValues, DatastoreValues
from cni_protocol import log, skel, types
from cni_protocol.args import parse_cni_args
from cni_protocol.errors import CniError, Code
from cni_protocol.log import DEFAULT_LOG_FILE
from datastore.errors import AccessDenied
from ipam.cni_codes import cni_errors
from ipam.core import Allocation, AssignRequest, DatastoreError, GcReport, Ipam, PoolSpec, handle_id
from ipam.values import IpamPluginValues, IpamValues
from stores import STANDALONE, Stores

if TYPE_CHECKING:
    from ipam.group import GroupCommit

T = TypeVar("T")

logger = logging.getLogger("tabby.ipam")

ANNOTATIONS_CAP = "io.kubernetes.cri.pod-annotations"
ANNOTATION_KEYS = {
    "ipAddrs": ("tabby.io/ipAddrs", "cni.projectcalico.org/ipAddrs"),
    "ipv4pools": ("tabby.io/ipv4pools", "cni.projectcalico.org/ipv4pools"),
    "ipv6pools": ("tabby.io/ipv6pools", "cni.projectcalico.org/ipv6pools"),
}


def configuration(args: skel.CmdArgs) -> IpamPluginValues:
    """The call's validated configuration (parsed once per call, then cached on ``args``):
    strict for ADD, CHECK and STATUS; for DEL and GC each invalid field at its default
    (:func:`teardown_configuration`). A configuration an earlier call validated is read back
    without the models (``cni_config.known``); else the models (pydantic) validate it."""
    if args.command in TEARDOWN_VERBS:
        return teardown_configuration(args).conf
    if not isinstance(args.parsed, IpamPluginValues):
        args.parsed = known.strict(IpamPluginValues, args.config, _parse)
    return args.parsed


def teardown_configuration(args: skel.CmdArgs) -> Teardown[IpamPluginValues]:
    """DEL's and GC's reading of the configuration: each field whose value cannot be honoured
    dropped to its default and listed; a structural problem still fails (code 7)."""
    if not isinstance(args.parsed, Teardown):
        args.parsed = known.tolerant(IpamPluginValues, args.config, _parse_for_teardown)
    return args.parsed


def _parse(config: Mapping[str, object]) -> IpamPluginValues:
    from ipam.config import parse_plugin

    return parse_plugin(config)


def _parse_for_teardown(config: Mapping[str, object]) -> Teardown[IpamPluginValues]:
    from ipam.config import parse_plugin_for_teardown

    read = parse_plugin_for_teardown(config)
    return Teardown(read.conf, read.dropped)


def configure_logging(args: skel.CmdArgs) -> None:
    """Logging as the configuration says; with an invalid configuration the defaults, and
    the verb then reports the problem (STATUS as code 50, the others as 2 or 7)."""
    try:
        conf = configuration(args)
        level, path = conf.log_level, conf.log_file_path
    except CniError:
        level, path = "info", DEFAULT_LOG_FILE
    log.configure_for_call(level, path, f"ipam {args.command}", args.container_id, args.ifname)


def with_ipam(
    stores: Stores,
    conf: DatastoreValues,
    node: str,
    fn: Callable[[Ipam], T],
    *,
    cached: bool = True,
) -> T:
    """``fn`` on the IPAM over the configured store, as ``stores`` runs it: a store of the
    call's own, closed after it (the binary); in tabby-node its long-lived one, read through
    its watch when ``cached`` (``stores.Served``)."""
    return stores.run(conf, lambda store: fn(Ipam(store, node)), cached=cached)


def _guard(fn: Callable[[], T]) -> T:
    with cni_errors():
        return fn()


# -- request decoding ---------------------------------------------------------------------


def _ip(text: object, source: str) -> Address:
    if not isinstance(text, str):
        raise CniError(Code.INVALID_CONFIG, f"invalid IP in {source}", repr(text))
    try:
        return ipaddress.ip_interface(text.strip()).ip
    except ValueError:
        raise CniError(Code.INVALID_CONFIG, f"invalid IP in {source}", repr(text)) from None


def requested_ips(conf: CommonValues, cni_args: dict[str, str]) -> list[Address]:
    """Specific IPs, highest first: runtimeConfig.ips, args.cni.ips, CNI_ARGS IP= (IPM-12)."""
    rc_ips = conf.runtime_value("ips")
    if rc_ips:
        if not isinstance(rc_ips, list):
            raise CniError(Code.INVALID_CONFIG, "runtimeConfig.ips must be a list", repr(rc_ips))
        return [_ip(v, "runtimeConfig.ips") for v in rc_ips]
    ips = conf.args_ips()
    if ips:
        return [_ip(v, "args.cni.ips") for v in ips]
    if cni_args.get("IP"):
        return [_ip(v, "CNI_ARGS IP") for v in cni_args["IP"].split(",") if v.strip()]
    return []


def _annotation(annotations: JSON, which: str) -> list[str] | None:
    for key in ANNOTATION_KEYS[which]:
        if key in annotations:
            raw = annotations[key]
            try:
                value = json.loads(raw) if isinstance(raw, str) else raw
            except ValueError:
                raise CniError(
                    Code.INVALID_CONFIG, f"invalid pod annotation {key}", repr(raw)
                ) from None
            if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
                raise CniError(
                    Code.INVALID_CONFIG, f"pod annotation {key} must be a JSON list", repr(raw)
                )
            return value
    return None


def pod_annotations(conf: CommonValues) -> JSON:
    value = conf.runtime_value(ANNOTATIONS_CAP)
    return value if isinstance(value, dict) else {}


def _annotation_pools(annotations: JSON, which: str, family: int) -> list[str] | None:
    pools = _annotation(annotations, which)
    for p in pools or []:
        try:
            net = ipaddress.ip_network(p)
        except ValueError:
            raise CniError(Code.INVALID_CONFIG, "invalid pool in pod annotation", repr(p)) from None
        if net.version != family:
            raise CniError(Code.INVALID_CONFIG, f"pod annotation pool is not IPv{family}", repr(p))
    return pools


def build_request(args: skel.CmdArgs, conf: IpamPluginValues, node: str) -> AssignRequest:
    cni_args = parse_cni_args(args.args)
    annotations = pod_annotations(conf)
    specific = requested_ips(conf, cni_args)
    if not specific:
        specific = [
            _ip(v, "pod annotation ipAddrs") for v in (_annotation(annotations, "ipAddrs") or [])
        ]
    v4_pools = _annotation_pools(annotations, "ipv4pools", 4)
    v6_pools = _annotation_pools(annotations, "ipv6pools", 6)
    ipam = conf.ipam
    attrs = {
        "node": node,
        "network": args.network,
        "container_id": args.container_id,
        "ifname": args.ifname,
        "pod_namespace": cni_args.get("K8S_POD_NAMESPACE", ""),
        "pod_name": cni_args.get("K8S_POD_NAME", ""),
        "pod_uid": cni_args.get("K8S_POD_UID", ""),
        "netns": args.netns,
        "time": time.time(),
    }
    host = _host_interface(args)
    if host is not None:
        attrs["host_interface"] = host
    return AssignRequest(
        handle_id=handle_id(args.network, args.container_id, args.ifname),
        attrs=attrs,
        want_v4=ipam.assign_ipv4,
        want_v6=ipam.assign_ipv6,
        v4_pools=v4_pools if v4_pools is not None else ipam.ipv4_pools,
        v6_pools=v6_pools if v6_pools is not None else ipam.ipv6_pools,
        specific_ips=specific,
        strict_affinity=ipam.strict_affinity,
        max_blocks_per_host=ipam.max_blocks_per_host,
        reserved=ipam.reserved_networks,
    )


def _host_interface(args: skel.CmdArgs) -> str | None:
    """The attachment's host veth as ``tabby`` names it (its ``veth_prefix``, in the same
    configuration): recorded with the allocation, where the Kubernetes datastore makes the
    attachment's WorkloadEndpoint from (docs/kubernetes.md "Kubernetes datastore")."""
    from dataplane.errors import DataplaneError
    from dataplane.names import host_veth_name

    prefix = args.config.get("veth_prefix", "cali")
    if args.config.get("type") != "tabby" or not isinstance(prefix, str):
        return None
    try:
        return host_veth_name(prefix, args.network, args.container_id, args.ifname)
    except DataplaneError:
        return None  # tabby itself refuses the prefix


def _pool_specs(conf: IpamValues) -> list[PoolSpec]:
    specs = [PoolSpec(p, conf.block_size_ipv4) for p in conf.ipv4_pools if conf.assign_ipv4]
    specs += [PoolSpec(p, conf.block_size_ipv6) for p in conf.ipv6_pools if conf.assign_ipv6]
    return specs


# -- verbs ------------------------------------------------------------------------------


class IpamVerbs:
    """tabby-ipam's verbs, their datastore work run by ``stores`` (the binary: a store of the
    call's own; tabby-node: its served store, ``stores.Served``)."""

    def __init__(self, stores: Stores = STANDALONE, group: GroupCommit | None = None) -> None:
        self.stores = stores
        self.group = group  #: tabby-node's: concurrent ADDs assigned together

    def handlers(self) -> skel.Handlers:
        return skel.Handlers(
            add=self.add, delete=self.delete, check=self.check, gc=self.gc, status=self.status
        )

    def add(self, args: skel.CmdArgs) -> JSON:
        return cmd_add(args, self.stores, self.group)

    def delete(self, args: skel.CmdArgs) -> None:
        return cmd_del(args, self.stores)

    def check(self, args: skel.CmdArgs) -> None:
        return cmd_check(args, self.stores)

    def gc(self, args: skel.CmdArgs) -> None:
        return cmd_gc(args, self.stores)

    def status(self, args: skel.CmdArgs) -> None:
        return cmd_status(args, self.stores)


def cmd_add(args: skel.CmdArgs, stores: Stores, group: GroupCommit | None = None) -> JSON:
    conf = configuration(args)
    node = conf.node_name()
    req = build_request(args, conf, node)

    def assign(ipam: Ipam) -> list[Allocation]:
        ipam.ensure_pools(_pool_specs(conf.ipam))
        return ipam.assign(req)

    def work() -> list[Allocation]:
        if group is not None and not req.specific_ips:
            return group.assign(conf.ipam, node, _pool_specs(conf.ipam), req)
        return with_ipam(stores, conf.ipam, node, assign)

    allocations = _guard(work)
    if not allocations:
        raise CniError(Code.NO_ADDRESS, "no address available", "IPAM assigned nothing")
    ips = [{"address": f"{a.ip}/{a.ip.max_prefixlen}"} for a in allocations]
    logger.info(
        "assigned %s to %s (blocks %s)",
        ", ".join(str(a.ip) for a in allocations),
        req.handle_id,
        ", ".join(sorted({str(a.block_cidr) for a in allocations})),
    )
    return types.render({"ips": ips}, args.cni_version)


def cmd_del(args: skel.CmdArgs, stores: Stores) -> None:
    # DEL needs no node name (CFG-7, DEL-7): release by handle, in the blocks of the node's
    # index when the node is known (where every allocation made for it lies), else in every
    # block. It needs the store: a store named by an invalid field is none, and nothing is
    # released from another (DEL-9).
    read = teardown_configuration(args)
    read.warn(logger, "DEL")
    conf = read.conf
    hid = handle_id(args.network, args.container_id, args.ifname)
    try:
        read.store(conf.ipam)
    except Unknown as e:
        logger.warning("no store of that name (%s): nothing of %s released", e, hid)
        return None
    try:
        node = read.node_name(conf)
        given = conf.node_name_given()
    except Unknown as e:
        logger.warning("node name unknown (%s): looking for %s in every block", e, hid)
        node, given = "", False

    def release() -> list[Allocation]:
        def fn(ipam: Ipam) -> list[Allocation]:
            got = ipam.release_handle(hid)
            if not got and node and not given:
                # the name is the hostname's guess (no nodename, no node-name file): the
                # ADD may have run under another; every block is looked at
                got = Ipam(ipam.store, "").release_handle(hid)
            return got

        try:
            return with_ipam(stores, conf.ipam, node, fn)
        except AccessDenied as e:
            # tabby uninstalled, its token revoked: retrying cannot help, and the pod must
            # go. What the attachment holds, if its blocks are still there, is a leak the
            # controllers release after --leak-grace.
            logger.warning("%s: nothing of %s released (a leak for the controllers' GC)", e, hid)
            return []

    released = _guard(release)
    if released:
        logger.info("released %s of %s", ", ".join(str(a.ip) for a in released), hid)
    else:
        logger.debug("nothing allocated to %s (already released)", hid)
    return None


def cmd_check(args: skel.CmdArgs, stores: Stores) -> None:
    conf = configuration(args)
    prev = types.prev_result(args.config, args.cni_version)
    if prev is None:
        raise CniError(
            Code.INVALID_CONFIG,
            "CHECK needs prevResult",
            "the runtime must send the cached ADD result (CHK-2)",
        )
    hid = handle_id(args.network, args.container_id, args.ifname)

    try:
        node = conf.node_name()
    except CniError:
        node = ""  # every block is looked at

    def lookup() -> list[Allocation]:
        return with_ipam(stores, conf.ipam, node, lambda ipam: ipam.get_handle(hid))

    held = _guard(lookup)
    if not held:
        raise CniError(
            Code.UNKNOWN_CONTAINER,
            "no IPAM allocation for this attachment",
            f"handle {hid} holds no address",
        )
    held_ips = {a.ip for a in held}
    listed = {ipaddress.ip_interface(ip["address"]).ip for ip in prev.get("ips", [])}
    missing = held_ips - listed
    if missing:
        raise CniError(
            Code.UNKNOWN_CONTAINER,
            "IPAM allocation does not match prevResult",
            f"handle {hid} holds {sorted(map(str, missing))} not in prevResult",
        )
    return None


def cmd_gc(args: skel.CmdArgs, stores: Stores) -> None:
    read = teardown_configuration(args)
    read.warn(logger, "GC")
    conf = read.conf
    valid = conf.valid_attachment_set()
    if valid is None:
        return None
    # Only this node's handles: the valid list is this runtime's, and a shared store holds
    # other nodes' attachments too. Each of store, node and grace says what may be released:
    # none of them is guessed (DEL-9).
    try:
        read.store(conf.ipam)
        node = read.node_name(conf)
        read.need("ipam.gc_grace_seconds")
    except Unknown as e:
        logger.warning("GC releases nothing (%s)", e)
        return None
    grace = conf.ipam.gc_grace_seconds

    def gc() -> GcReport:
        return with_ipam(
            stores,
            conf.ipam,
            node,
            lambda ipam: ipam.gc(args.network, valid, grace_seconds=grace),
            cached=False,  # it repairs the node's index: as the store holds it
        )

    report = _guard(gc)
    if report.errors:
        raise CniError(
            Code.TRY_AGAIN_LATER,
            f"GC released {len(report.released)} handles, {len(report.errors)} failed",
            "; ".join(report.errors)[:2000],
        )
    return None


def cmd_status(args: skel.CmdArgs, stores: Stores) -> None:
    try:
        conf = configuration(args)
        node = conf.node_name()
    except CniError as e:
        raise CniError(Code.NOT_READY, "IPAM configuration unusable", str(e)) from None
    ipam_conf = conf.ipam

    def ready(ipam: Ipam) -> str | None:
        ipam.store.check_usable()
        return ipam.can_allocate(
            ipam_conf.ipv4_pools,
            ipam_conf.ipv6_pools,
            need_v4=ipam_conf.assign_ipv4,
            need_v6=ipam_conf.assign_ipv6,
            strict_affinity=ipam_conf.strict_affinity,
            max_blocks_per_host=ipam_conf.max_blocks_per_host,
            reserved=ipam_conf.reserved_networks,
            block_size_v4=ipam_conf.block_size_ipv4,
            block_size_v6=ipam_conf.block_size_ipv6,
        )

    try:
        reason = with_ipam(stores, ipam_conf, node, ready, cached=False)
    except DatastoreError as e:
        raise CniError(Code.NOT_READY, "IPAM datastore not usable", str(e)) from None
    except OSError as e:
        raise CniError(Code.NOT_READY, "IPAM datastore not usable", str(e)) from None
    if reason:
        raise CniError(Code.NOT_READY, "no address can be allocated for this node", reason)
    return None


HANDLERS = IpamVerbs().handlers()
