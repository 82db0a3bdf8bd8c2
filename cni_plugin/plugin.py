"""The ``tabby`` plugin's verbs: delegate addressing to IPAM, wire the pod, report.

ADD: IPAM ADD (exec'd from CNI_PATH with identical stdin, or in tabby-node's own process)
while the dataplane makes the veth pair, then the pair configured with the addresses ->
result. If anything fails after IPAM succeeded, the dataplane is rolled back and IPAM DEL
runs before the error is reported (ADD-5). DEL: local teardown started first and always,
IPAM DEL always, once the endpoint is removed, beside the teardown (DEL-2, DEL-3, DEL-7); an
invalid field is dropped to its default, and a part that depends on one is skipped (DEL-9).
CHECK compares the kernel with prevResult and forwards to IPAM.
GC removes host veths of this network whose attachment is not valid, then forwards.
Rule IDs (ADD-5, ...) are defined in cni_protocol/CONFORMANCE.md.
"""

from __future__ import annotations

import ipaddress
import logging
import time
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Protocol, TypeVar, cast

from bundle.types import JSON
from bundle.types import IPAddress as Address
from cni_protocol import invoke, log, phases, skel, types
from cni_protocol.errors import CniError, Code
from dataplane.names import host_veth_name

if TYPE_CHECKING:
    from contextlib import AbstractContextManager

    from cni_config.teardown import Teardown
    from cni_plugin.values import PluginValues
    from dataplane.model import Dataplane, SetupResult, SetupSpec
    from datastore.base import Store, StoreSettings
    from stores import Stores

logger = logging.getLogger("tabby.plugin")
T = TypeVar("T")
Pending = Callable[[], "JSON | None"]

IPV4_GATEWAY = "169.254.1.1"


# -- seams: the dataplane and the IPAM invoker are injected ---------------------------------


class IpamInvoker(Protocol):
    """How tabby reaches its delegated IPAM plugin."""

    def start(self, ipam_type: str, command: str, args: skel.CmdArgs) -> Pending:
        """Start the call; the returned function waits for its parsed result (or raises
        the delegate's CniError unchanged)."""
        ...


class ExecIpam:
    """The spec's way: exec the plugin from CNI_PATH with our stdin and env."""

    def start(self, ipam_type: str, command: str, args: skel.CmdArgs) -> Pending:
        return invoke.start_plugin(ipam_type, command, args.stdin, args.env, args.path).result


class EndpointRecorder(Protocol):
    """Where tabby records each attachment (a WorkloadEndpoint: node, pod, interfaces,
    addresses), for policy and operators."""

    def added(
        self, args: skel.CmdArgs, conf: PluginValues, addresses: list[Address], host_ifname: str
    ) -> None:
        """The attachment is up; raises CniError when it cannot be recorded (ADD fails and
        is rolled back)."""
        ...

    def removed(self, args: skel.CmdArgs, conf: PluginValues) -> None:
        """The attachment is gone; raises CniError when the record could not be removed."""
        ...


def pod_identity(args: skel.CmdArgs) -> tuple[str, str]:
    """(namespace, pod name) of the attachment, from CNI_ARGS (Kubernetes runtimes send
    them); without them the container id names the pod, in namespace ``default``."""
    from cni_protocol.args import parse_cni_args

    cni_args = parse_cni_args(args.args)
    namespace = cni_args.get("K8S_POD_NAMESPACE") or "default"
    return namespace, cni_args.get("K8S_POD_NAME") or args.container_id


class DatastoreEndpoints:
    """Records each attachment as a WorkloadEndpoint in the datastore the ``ipam`` section
    names (the one tabby-ipam allocates from), with its Pod's labels; ``stores`` runs the
    datastore work (the binary: a store of the call's own; tabby-node: its served one), each
    write in a lock session of its own, or, given ``group`` (tabby-node), in the session of
    its batch (:class:`EndpointGroup`)."""

    def __init__(self, stores: Stores | None = None, group: EndpointGroup | None = None) -> None:
        from stores import STANDALONE

        self.stores: Stores = stores if stores is not None else STANDALONE
        self.group = group

    def added(
        self, args: skel.CmdArgs, conf: PluginValues, addresses: list[Address], host_ifname: str
    ) -> None:
        self.record(args, conf, addresses, host_ifname)

    def removed(self, args: skel.CmdArgs, conf: PluginValues) -> None:
        self.erase(args, conf)

    def _run(self, settings: StoreSettings, op: Callable[[Store], T]) -> T:
        """``op`` (one compare-and-swap, no lock taken) under the node's lock: in its
        batch's session, or in a session of its own."""
        with _store_errors():
            if self.group is not None:
                return self.group.run(settings, op)
            return self.stores.run(settings, locked(op))

    def record(
        self, args: skel.CmdArgs, conf: PluginValues, addresses: list[Address], host_ifname: str
    ) -> str:
        """Write the endpoint (one compare-and-swap); returns its key. In the Kubernetes
        datastore nothing is written: the endpoint is made of the attachment's
        allocations (docs/kubernetes.md "Kubernetes datastore")."""
        from resources.wep import endpoint_key, write_endpoint

        namespace, pod = pod_identity(args)
        node = conf.node_name()
        if conf.ipam.datastore_type == "kubernetes":
            return endpoint_key(namespace, node, pod, args.ifname)

        def write(store: Store) -> str:
            return write_endpoint(
                store,
                namespace=namespace,
                node=node,
                pod=pod,
                container_id=args.container_id,
                interface=args.ifname,
                host_interface=host_ifname,
                ip_networks=[f"{a}/{a.max_prefixlen}" for a in addresses],
            )

        return self._run(conf.ipam, write)

    def erase(self, args: skel.CmdArgs, conf: PluginValues) -> str | None:
        """Remove this container's endpoint; its key if one was removed."""
        from resources.wep import endpoint_key, remove_endpoint

        namespace, pod = pod_identity(args)
        key = endpoint_key(namespace, conf.node_name(), pod, args.ifname)
        if conf.ipam.datastore_type == "kubernetes":
            return key  # made of the allocations: gone with them
        removed = self._run(conf.ipam, lambda store: remove_endpoint(store, key, args.container_id))
        return key if removed else None


def locked(op: Callable[[Store], T]) -> Callable[[Store], T]:
    """``op`` in a lock session of its own."""

    def run(store: Store) -> T:
        with store.lock():
            return op(store)

    return run


class EndpointGroup:
    """tabby-node's: the endpoint writes (and removals) of concurrent calls on one datastore
    run in batches (``datastore.group``), a batch in ONE lock session of the node: a burst
    of ADDs takes the node's lock once per batch, not once per pod, and queues behind it once,
    and the batch's documents are made durable together at its end
    (``datastore.base.write_batch``: the file store fsyncs the directory once, not once per
    pod). Each write is still its own compare-and-swap of its own document, as alone (the
    store protocol has nothing else), durable before its call answers; one that failed in the batch
    is run again alone (``Stores.run``: of the store itself when the view may have been
    stale), unless the store itself failed (unreachable, the lock not had in time)."""

    def __init__(self, stores: Stores) -> None:
        from datastore.group import Batches

        self.stores = stores
        self.batches: Batches[Callable[[Store], object], object] = Batches()

    def run(self, settings: StoreSettings, op: Callable[[Store], T]) -> T:
        from datastore.errors import LockTimeout
        from stores import identity

        got = self.batches.submit(
            identity(settings),
            op,
            lambda ops: self._session(settings, ops),
            wait=settings.lock_timeout_seconds * 2 + 5,
            timeout_error=lambda: LockTimeout(
                settings.datastore_type, "no batch took this endpoint write in time"
            ),
        )
        return cast("T", got)

    def _session(
        self, settings: StoreSettings, ops: list[Callable[[Store], object]]
    ) -> list[object]:
        from datastore.base import write_batch
        from datastore.errors import DatastoreError, LockTimeout, StoreUnavailable

        def session(store: Store) -> list[object]:
            out: list[object] = []
            # endpoints are independent documents, and each call answers after the batch:
            # durable together at its end (the file store: one directory fsync, not one each)
            with store.lock(), write_batch(store):
                for op in ops:
                    try:
                        out.append(op(store))
                    except (StoreUnavailable, LockTimeout):
                        raise  # the store itself: the whole batch fails
                    except DatastoreError as e:  # this one alone: asked again below
                        out.append(e)
            return out

        try:
            results = self.stores.run(settings, session)
        except (StoreUnavailable, LockTimeout) as e:  # asking again would double the wait
            return [e] * len(ops)
        for i, got in enumerate(results):
            if isinstance(got, DatastoreError):
                try:
                    results[i] = self.stores.run(settings, locked(ops[i]))
                except DatastoreError as e:
                    results[i] = e
        return results


def _store_errors() -> AbstractContextManager[None]:
    from ipam.cni_codes import cni_errors

    return cni_errors()


class _InBackground:
    """``fn()`` on a thread of its own (:class:`bundle.beside.Beside`: it inherits the
    caller's namespaces); ``wait()`` returns what it raised (None: it returned). Its time
    counts to the caller's phase ``phase``, and the time ``wait()`` waited to
    ``<phase>_wait`` (:mod:`cni_protocol.phases`)."""

    def __init__(self, fn: Callable[[], object], phase: str) -> None:
        from bundle.beside import Beside

        self._phase = phase
        self._call: Beside[object] = Beside(fn, f"tabby-{phase}")

    def wait(self) -> BaseException | None:
        started = time.perf_counter()
        out = self._call.join()
        phases.add(f"{self._phase}_wait", time.perf_counter() - started)
        phases.add(self._phase, self._call.seconds)
        return out if isinstance(out, BaseException) else None


class _AddIpam:
    """An ADD's IPAM call: started at once when ``overlapped`` (an exec'd plugin runs while
    the caller validates), else when the dataplane asks for the addresses
    (:meth:`addresses`, with the veth pair under way). Once they are known, the attachment
    (``conf``, its host veth ``host``) is recorded (in tabby-node, its policy programmed)
    while the pair is configured.
    ``beside``: the time the dataplane spent in :meth:`addresses` (IPAM's, not the
    kernel's)."""

    def __init__(self, owner: Plugin, args: skel.CmdArgs, ipam_type: str, overlapped: bool):
        self.owner, self.args, self.ipam_type = owner, args, ipam_type
        self.started = time.perf_counter()
        self.pending = owner.ipam.start(ipam_type, "ADD", args) if overlapped else None
        self.result: JSON = {}
        self.allocated: list[Address] = []
        self.asked = False
        self.beside = 0.0
        self._recorded: _InBackground | None = None

    def addresses(self, conf: PluginValues, host: str) -> list[Address]:
        self.asked = True
        entered = time.perf_counter()
        try:
            return self._allocate(conf, host)
        finally:
            self.beside = time.perf_counter() - entered

    def _allocate(self, conf: PluginValues, host: str) -> list[Address]:
        args = self.args
        try:
            if self.pending is None:
                self.started = time.perf_counter()
                raw = self.owner.ipam.start(self.ipam_type, "ADD", args)()
            else:
                raw = self.pending()
        finally:
            phases.add("ipam", time.perf_counter() - self.started)
        try:
            self.result = types.canonical(raw or {}, args.cni_version)
            addresses = _addresses(self.result)
            if not addresses:
                raise CniError(
                    Code.DELEGATE_FAILED,
                    f"{conf.ipam_type} returned no IP addresses",
                    "ADD-8: a result without addresses is an error",
                )
        except BaseException:
            self.owner._ipam_del_quietly(args, self.ipam_type)
            raise
        self.allocated = addresses
        endpoints = self.owner.endpoints
        self._recorded = _InBackground(
            lambda: endpoints.added(args, conf, addresses, host), "endpoint"
        )
        return addresses

    def refused(self) -> None:
        """The ADD was refused before the dataplane asked: an overlapped call that
        allocated gives its addresses back."""
        if self.pending is None or self.asked:
            return
        try:
            self.pending()
        except CniError:
            return  # IPAM failed too: nothing was allocated
        self.owner._refused_after_ipam(self.args, self.ipam_type)

    def rolled_back(self, conf: PluginValues) -> None:
        """The dataplane failed (and removed what it made): the endpoint and the addresses
        go too, whatever was allocated (ADD-5)."""
        self.refused()
        if not self.allocated:
            return
        if self.recorded() is None:
            self.owner._erase_quietly(self.args, conf)
        self.owner._ipam_del_quietly(self.args, self.ipam_type)

    def recorded(self) -> BaseException | None:
        """Waits for the attachment's record: what it raised (None: recorded)."""
        assert self._recorded is not None
        return self._recorded.wait()


def policy_table_present() -> bool:
    """Whether tabby-node's policy table (``inet tabby``) is in this process's network
    namespace, the node's (one netlink request). A kernel without nftables has none; any
    other failure to ask counts as there (a refused ADD is retried; a pod started into a
    table that drops its traffic is not)."""
    import errno

    from dataplane.names import NFT_TABLE
    from dataplane.nfnetlink import table_exists

    try:
        return table_exists(NFT_TABLE)
    except OSError as e:
        if e.errno in (errno.EPROTONOSUPPORT, errno.EOPNOTSUPP, errno.EAFNOSUPPORT):
            return False
        logger.warning("cannot tell whether nftables table inet %s is there: %s", NFT_TABLE, e)
        return True


def refuse_unserved_add() -> None:
    """An ADD while no tabby-node listens and its table is on the node: the table drops
    every pod interface it has no rules for, and only tabby-node writes them, so this pod
    would get an address and no traffic. Refused with code 11 before anything is done (the
    runtime retries; tabby-node back, it serves the retry)."""
    from dataplane.names import NFT_TABLE

    raise CniError(
        Code.TRY_AGAIN_LATER,
        "tabby-node is not running: its NetworkPolicy table would drop this pod's traffic",
        f"nftables table inet {NFT_TABLE} is on this node and drops the traffic of every pod "
        "interface tabby-node has not programmed, and no tabby-node listens on its socket to "
        "program this one, so nothing was done. Try again when "
        f"tabby-node serves; to network pods without it (and without policy), remove the "
        f"table: nft delete table inet {NFT_TABLE}",
    )


def linux_dataplane() -> Dataplane:
    """The kernel side, imported only when a verb needs it (pyroute2 is ~60-110 ms)."""
    from dataplane import get_dataplane

    return get_dataplane()


def configuration(args: skel.CmdArgs) -> PluginValues:
    """The call's validated configuration (parsed once per call, then cached on ``args``):
    strict for ADD, CHECK and STATUS; for DEL and GC each invalid field at its default
    (:func:`teardown_configuration`).

    A configuration an earlier call validated is read back without the models
    (``cni_config.known``); else the models (pydantic) validate it, imported here, not at
    module level: a standalone ADD starts its IPAM process first and validates while that
    process runs (see ``Plugin.add``)."""
    from cni_config.teardown import TEARDOWN_VERBS
    from cni_plugin.values import PluginValues

    if args.command in TEARDOWN_VERBS:
        return teardown_configuration(args).conf
    if not isinstance(args.parsed, PluginValues):
        from cni_config import known

        args.parsed = known.strict(PluginValues, args.config, _parse_plugin)
    return args.parsed


def _parse_plugin(config: Mapping[str, object]) -> PluginValues:
    from cni_plugin.config import parse_plugin

    return parse_plugin(config)


def _parse_plugin_for_teardown(config: Mapping[str, object]) -> Teardown[PluginValues]:
    from cni_config.teardown import Teardown
    from cni_plugin.config import parse_plugin_for_teardown

    read = parse_plugin_for_teardown(config)
    return Teardown(read.conf, read.dropped)


def teardown_configuration(args: skel.CmdArgs) -> Teardown[PluginValues]:
    """DEL's and GC's reading of the configuration: each field whose value cannot be honoured
    dropped to its default and listed; a structural problem still fails (code 7)."""
    from cni_config import known
    from cni_config.teardown import Teardown
    from cni_plugin.values import PluginValues

    if not isinstance(args.parsed, Teardown):
        args.parsed = known.tolerant(PluginValues, args.config, _parse_plugin_for_teardown)
    return args.parsed


def apply_logging(args: skel.CmdArgs, conf: PluginValues | None) -> None:
    """The call's logging: the configuration's level and file, else the defaults."""
    from cni_protocol.log import DEFAULT_LOG_FILE

    level, path = (conf.log_level, conf.log_file_path) if conf else ("info", DEFAULT_LOG_FILE)
    log.configure_for_call(level, path, args.command, args.container_id, args.ifname)


def configure_logging(args: skel.CmdArgs) -> None:
    """Before the verb: logging as the configuration says (with an invalid configuration the
    defaults, and the verb then reports the problem; DEL and GC: an invalid ``log_level`` or
    ``log_file_path`` at its default). ADD and CHECK validate later, once their IPAM call is
    under way, and apply the configuration's logging then."""
    if args.command in ("ADD", "CHECK"):
        apply_logging(args, None)
        return
    try:
        conf: PluginValues | None = configuration(args)
    except CniError:
        conf = None
    apply_logging(args, conf)


def _raw_ipam_type(config: Mapping[str, object]) -> str | None:
    """``ipam.type`` as given, before validation (exec checks it is a plain name)."""
    ipam = config.get("ipam")
    value = ipam.get("type") if isinstance(ipam, dict) else None
    return value if isinstance(value, str) and value else None


def _mac_capability(conf: PluginValues) -> str | None:
    mac = conf.runtime_value("mac")
    if mac is None or mac == "":
        return None
    if not isinstance(mac, str) or len(mac.split(":")) != 6:
        raise CniError(Code.INVALID_CONFIG, "invalid runtimeConfig.mac", repr(mac))
    try:
        octets = [int(o, 16) for o in mac.split(":")]
    except ValueError:
        raise CniError(Code.INVALID_CONFIG, "invalid runtimeConfig.mac", repr(mac)) from None
    if octets[0] & 1:
        raise CniError(
            Code.INVALID_CONFIG, "invalid runtimeConfig.mac", f"{mac} is a multicast address"
        )
    return mac.lower()


def _addresses(result: JSON) -> list[Address]:
    return [ipaddress.ip_interface(ip["address"]).ip for ip in result.get("ips", [])]


def host_ifname(args: skel.CmdArgs, conf: PluginValues) -> str:
    from cni_plugin.cni_codes import cni_errors

    with cni_errors():
        return host_veth_name(conf.veth_prefix, args.network, args.container_id, args.ifname)


def attachment_alias(args: skel.CmdArgs) -> str:
    """Recorded on the host veth (IFLA_IFALIAS) so GC and tabbyctl can tell whose it is."""
    return f"tabby:{args.network}:{args.container_id}:{args.ifname}"


def setup_spec(
    args: skel.CmdArgs, conf: PluginValues, addresses: list[Address], mac: str | None, mtu: int
) -> SetupSpec:
    """What the dataplane builds (ADD) or verifies (CHECK) for this attachment."""
    from dataplane.model import SetupSpec

    return SetupSpec(
        netns_path=args.netns,
        ifname=args.ifname,
        host_ifname=host_ifname(args, conf),
        addresses=addresses,
        mtu=mtu,
        mac=mac,
        allow_ip_forwarding=conf.allow_ip_forwarding,
        alias=attachment_alias(args),
    )


def build_result(
    args: skel.CmdArgs,
    conf: PluginValues,
    prev: JSON,
    ipam_result: JSON,
    addresses: list[Address],
    done: SetupResult,
    mtu: int,
) -> JSON:
    """Both interfaces, the IPs on the container side, the routes actually programmed."""
    from dataplane.model import IPV6_GATEWAY, SCOPE_LINK

    interfaces = list(prev.get("interfaces", []))
    interfaces.append({"name": done.host_ifname, "mac": done.host_mac, "mtu": mtu})
    interfaces.append(
        {"name": args.ifname, "mac": done.container_mac, "mtu": mtu, "sandbox": args.netns}
    )
    idx = len(interfaces) - 1
    ips = list(prev.get("ips", []))
    for a in addresses:
        gw = IPV4_GATEWAY if a.version == 4 else str(IPV6_GATEWAY)
        ips.append({"address": f"{a}/{a.max_prefixlen}", "gateway": gw, "interface": idx})
    routes = list(prev.get("routes", []))
    for r in done.routes:
        route: dict[str, object] = {"dst": str(r.dst)}
        if r.gw is not None:
            route["gw"] = str(r.gw)
        if r.scope == SCOPE_LINK:
            route["scope"] = SCOPE_LINK
        routes.append(route)
    out: JSON = {**prev, "interfaces": interfaces, "ips": ips, "routes": routes}
    dns = ipam_result.get("dns") or prev.get("dns")
    if dns:
        out["dns"] = dns
    return out


# -- the verbs ------------------------------------------------------------------------------


class Plugin:
    """tabby's verbs over an injected dataplane and IPAM invoker.

    ``dataplane`` is a loader (called when a verb first needs the kernel), so that building
    the handlers imports nothing heavy; the verbs see it through
    :class:`~cni_plugin.cni_codes.CniDataplane`, which turns its errors into CNI errors.
    tabby-node passes its own IPAM invoker, which runs tabby-ipam in-process.

    ``policy_table`` (the binaries, :data:`HANDLERS`): tells whether tabby-node's policy
    table is on the node; while it is, an ADD here, not served by tabby-node, is refused
    (:func:`refuse_unserved_add`). tabby-node programs a pod's policy before its ADD
    answers and passes none.
    """

    def __init__(
        self,
        dataplane: Callable[[], Dataplane] = linux_dataplane,
        ipam: IpamInvoker | None = None,
        endpoints: EndpointRecorder | None = None,
        mtu_file: str | None = None,
        validate_first: bool = False,
        policy_table: Callable[[], bool] | None = None,
    ) -> None:
        self._load_dataplane = dataplane
        self.policy_table = policy_table
        self.mtu_file = mtu_file
        #: True where the models are warm (tabby-node): validate before the IPAM call,
        #: instead of overlapping validation with the IPAM process (the binaries).
        self.validate_first = validate_first
        self.ipam: IpamInvoker = ipam if ipam is not None else ExecIpam()
        self.endpoints: EndpointRecorder = (
            endpoints if endpoints is not None else DatastoreEndpoints()
        )

    def handlers(self) -> skel.Handlers:
        return skel.Handlers(
            add=self.add, delete=self.delete, check=self.check, gc=self.gc, status=self.status
        )

    @property
    def dataplane(self) -> Dataplane:
        from cni_plugin.cni_codes import CniDataplane

        return CniDataplane(self._load_dataplane())

    def _ipam(self, args: skel.CmdArgs, conf: PluginValues, command: str) -> Pending:
        return self.ipam.start(conf.ipam_type, command, args)

    def _mtu(self, conf: PluginValues) -> int:
        """The pods' MTU: ``mtu``, or for 0 the file tabby-node writes (the serving node's
        own state directory when tabby-node runs the call)."""
        return conf.effective_mtu(self.mtu_file) if self.mtu_file else conf.effective_mtu()

    def _teardown_quietly(
        self, args: skel.CmdArgs, conf: PluginValues, addresses: list[Address]
    ) -> None:
        try:
            self.dataplane.teardown(args.netns, args.ifname, host_ifname(args, conf), addresses)
        except CniError as e:
            logger.error("rollback: teardown failed: %s", e)

    def _refused_after_ipam(self, args: skel.CmdArgs, ipam_type: str) -> None:
        """The configuration was refused after the overlapped IPAM ADD succeeded: give the
        addresses back, unless the attachment is live (a repeated ADD got the addresses the
        running pod holds: releasing them would hand them out twice)."""
        try:
            live = self.dataplane.pod_interface_present(args.netns, args.ifname)
        except CniError:
            live = True  # cannot tell: keeping an allocation is the safe mistake
        if live:
            logger.warning("refused ADD of a live attachment: its addresses are kept")
            return
        self._ipam_del_quietly(args, ipam_type)

    def _erase_quietly(self, args: skel.CmdArgs, conf: PluginValues) -> None:
        try:
            self.endpoints.removed(args, conf)
        except CniError as e:
            logger.error("rollback: cannot remove the workload endpoint: %s", e)

    def _ipam_del_quietly(self, args: skel.CmdArgs, ipam_type: str) -> None:
        try:
            self.ipam.start(ipam_type, "DEL", args)()
        except CniError as e:
            logger.error("rollback: IPAM DEL failed: %s", e)

    def add(self, args: skel.CmdArgs) -> JSON:
        # The IPAM call and the veth pair overlap. An exec'd IPAM plugin (the binaries)
        # starts first: this process validates its configuration, loads netlink and makes
        # the pair while the IPAM process runs (2 cores: about 100 ms off a standalone ADD);
        # a configuration that turns out invalid is refused after the IPAM call is rolled
        # back. Where the configuration is validated first (tabby-node, IPAM in-process),
        # the IPAM call runs in this thread while the dataplane makes the pair on another.
        # Either way the pair is configured once the addresses are known, and nothing is
        # left behind when any part fails.
        if self.policy_table is not None and self.policy_table():
            refuse_unserved_add()
        ipam_type = _raw_ipam_type(args.config)
        if ipam_type is None or self.validate_first:
            ipam_type = configuration(args).ipam_type  # raises the precise error (code 7)
        call = _AddIpam(self, args, ipam_type, overlapped=not self.validate_first)
        try:
            conf = configuration(args)
            apply_logging(args, conf)
            mac = _mac_capability(conf)
            prev = types.prev_result(args.config, args.cni_version) or {}
            mtu = self._mtu(conf)
            dp = self.dataplane
            pair = setup_spec(args, conf, [], mac, mtu)
        except BaseException:
            call.refused()
            raise
        setup_started = time.perf_counter()
        try:
            done = dp.setup(pair, lambda: call.addresses(conf, pair.host_ifname))
        except BaseException:
            # Whatever failed, the dataplane removed what it made (ADD-5); BaseException:
            # also on SIGTERM/Ctrl-C.
            call.rolled_back(conf)
            raise
        finally:
            phases.on_path("netlink", time.perf_counter() - setup_started - call.beside)
        failure = call.recorded()
        if failure is not None:
            self._teardown_quietly(args, conf, call.allocated)
            self._ipam_del_quietly(args, ipam_type)
            raise failure
        logger.info(
            "added %s on %s (host veth %s)",
            ", ".join(map(str, call.allocated)),
            args.netns,
            done.host_ifname,
        )
        return types.render(
            build_result(args, conf, prev, call.result, call.allocated, done, mtu),
            args.cni_version,
        )

    def delete(self, args: skel.CmdArgs) -> None:
        # An invalid field does not stop a DEL (DEL-9): it is dropped to its default; what
        # derives from it (the host veth's name, the node, the store) is skipped.
        from cni_config.teardown import Unknown

        read = teardown_configuration(args)
        read.warn(logger, "DEL")
        conf = read.conf
        prev = None
        try:
            prev = types.prev_result(args.config, args.cni_version)
        except CniError as e:  # a bad cached result must not block cleanup (DEL-4)
            logger.warning("ignoring unusable prevResult: %s", e)
        host: str | None = None
        try:
            read.need("veth_prefix")
            host = host_ifname(args, conf)
        except Unknown as e:
            logger.warning("no host veth of that name can exist (%s): pod side only", e)
        # The endpoint (and in tabby-node the pod's policy) is removed, and the kernel side
        # torn down, each on a thread of its own: the teardown waits for no store (DEL-7).
        # The addresses are released once the endpoint is gone (no policy of the old pod
        # can meet a new pod given its address), beside the kernel's teardown (the veth's
        # deletion is most of a DEL): a new pod given an address still on the old veth gets
        # the host route (it replaces it), and the old veth's deletion takes only what
        # points at it. IPAM DEL runs whatever failed before (DEL-3).
        erased: _InBackground | None = None
        try:
            read.store(conf.ipam)
            read.node_name(conf)
        except Unknown as e:
            logger.warning("no workload endpoint of that key or store (%s): none removed", e)
        else:
            erased = _InBackground(lambda: self.endpoints.removed(args, conf), "endpoint")
        addresses = _addresses(prev) if prev else None
        torn = _InBackground(
            lambda: self.dataplane.teardown(args.netns or None, args.ifname, host, addresses),
            "netlink",
        )
        local_error: CniError | None = None
        try:
            failure = erased.wait() if erased is not None else None
            if isinstance(failure, CniError):
                logger.error("cannot remove the workload endpoint: %s", failure)
                local_error = failure
            elif failure is not None:
                raise failure
            with phases.timed("ipam"):
                self._ipam(args, conf, "DEL")()
        finally:
            unbuilt = torn.wait()
            if isinstance(unbuilt, CniError):
                logger.error("local teardown failed: %s", unbuilt)
        if isinstance(unbuilt, CniError):
            local_error = unbuilt
        elif unbuilt is not None:
            raise unbuilt
        logger.info("deleted (netns %s)", args.netns or "-")
        if local_error is not None:
            raise local_error
        return None

    def check(self, args: skel.CmdArgs) -> None:
        # IPAM's CHECK runs (in its own process) while this one validates and inspects the
        # kernel; the dataplane's error, if any, is the one reported, as when they ran one
        # after the other.
        ipam_type = _raw_ipam_type(args.config)
        if ipam_type is None:
            configuration(args)  # raises the precise error (code 7)
            raise CniError(Code.INVALID_CONFIG, "ipam.type is required")  # pragma: no cover
        with phases.timed("ipam"):
            pending = self.ipam.start(ipam_type, "CHECK", args)
        try:
            self._check_dataplane(args)
        except BaseException:
            try:
                pending()
            except Exception as e:  # reported second: logged only
                logger.info("IPAM CHECK also failed: %s", e)
            raise
        with phases.timed("ipam"):
            pending()
        return None

    def _check_dataplane(self, args: skel.CmdArgs) -> None:
        from dataplane.model import ExpectedState, default_pod_routes

        conf = configuration(args)
        apply_logging(args, conf)
        prev = types.prev_result(args.config, args.cni_version)
        if prev is None:
            raise CniError(
                Code.INVALID_CONFIG,
                "CHECK needs prevResult",
                "the runtime must send the cached ADD result (CHK-2)",
            )
        interfaces = prev.get("interfaces", [])
        pod_idx = next(
            (
                i
                for i, itf in enumerate(interfaces)
                if itf.get("name") == args.ifname and itf.get("sandbox")
            ),
            None,
        )
        if pod_idx is None:
            raise CniError(
                Code.DATAPLANE,
                f"prevResult has no interface {args.ifname}",
                "CHECK compares the kernel with prevResult",
            )
        pod_if = interfaces[pod_idx]
        if pod_if.get("sandbox") != args.netns:
            raise CniError(
                Code.DATAPLANE,
                "sandbox mismatch",
                f"prevResult says {pod_if.get('sandbox')}, CNI_NETNS is {args.netns}",
            )
        addresses = [
            ipaddress.ip_interface(ip["address"]).ip
            for ip in prev.get("ips", [])
            if ip.get("interface") == pod_idx
        ]
        spec = setup_spec(args, conf, addresses, None, self._mtu(conf))
        # Compare against prevResult (the final result: a later plugin may have changed the
        # MAC, CHK-4), not against what ADD printed. The pod routes to expect are those
        # prevResult says were programmed: a second attachment of the same pod skips the
        # default routes the first one owns.
        listed = {(r.get("dst"), r.get("gw") or None) for r in prev.get("routes", [])}
        routes = [
            r
            for r in default_pod_routes(addresses)
            if (str(r.dst), str(r.gw) if r.gw is not None else None) in listed
        ]
        with phases.timed("netlink", waited=True):
            self.dataplane.check(
                spec, ExpectedState(container_mac=pod_if.get("mac"), routes=routes)
            )

    def gc(self, args: skel.CmdArgs) -> None:
        """Remove this network's host veths whose attachment is not valid; forward to IPAM.

        Keeps going after individual failures and reports them together (GC-5).
        """
        from cni_config.teardown import Unknown

        read = teardown_configuration(args)
        read.warn(logger, "GC")
        conf = read.conf
        valid = conf.valid_attachment_set()
        errors: list[CniError] = []
        if valid is not None:
            try:
                read.need("veth_prefix")
            except Unknown as e:
                logger.warning("GC looks for no host veths (%s): none has that prefix", e)
            else:
                errors += self._gc_host_veths(args, conf.veth_prefix, valid)
        try:
            self._ipam(args, conf, "GC")()  # GC-6: always forwarded, with the same stdin
        except CniError as e:
            errors.append(e)
        if errors:
            first = errors[0]
            raise CniError(first.code, first.msg, "; ".join(str(e) for e in errors))
        return None

    def _gc_host_veths(
        self, args: skel.CmdArgs, prefix: str, valid: set[tuple[str, str]]
    ) -> list[CniError]:
        """Delete this network's host veths whose attachment is not in ``valid``."""
        from cni_plugin.cni_codes import cni_errors

        errors: list[CniError] = []
        with cni_errors():
            keep = {host_veth_name(prefix, args.network, cid, ifname) for cid, ifname in valid}
        mine = f"tabby:{args.network}:"
        dp = self.dataplane
        try:
            stale = [
                v.name
                for v in dp.list_host_veths(prefix)
                if v.alias.startswith(mine) and v.name not in keep
            ]
        except CniError as e:
            return [e]
        for name in stale:
            try:
                dp.delete_host_veth(name)
                logger.info("GC removed host veth %s", name)
            except CniError as e:
                errors.append(e)
        return errors

    def status(self, args: skel.CmdArgs) -> None:
        conf = configuration(args)
        self._ipam(args, conf, "STATUS")()
        return None


def unserved_handlers(node_absent: bool) -> skel.Handlers:
    """The binaries' handlers, for a call tabby-node did not serve (bundle/entry.py). With
    no tabby-node listening an ADD minds its policy table (:func:`refuse_unserved_add`); one
    that is there but did not take the call (slow, another version) programs the pod's
    policy from its watch, so the pod is networked here."""
    return Plugin(policy_table=policy_table_present if node_absent else None).handlers()


#: The binaries' handlers when no tabby-node listens.
HANDLERS = unserved_handlers(True)
