"""The ``tabby`` plugin's verbs: delegate addressing to IPAM, wire the pod, report.

ADD: IPAM ADD (exec'd from CNI_PATH, identical stdin) -> dataplane setup -> result. If
anything fails after IPAM succeeded, the dataplane is rolled back and IPAM DEL runs before
the error is reported (ADD-5). DEL: local teardown first and always, then IPAM DEL always
(DEL-2, DEL-3, DEL-7). CHECK compares the kernel with prevResult and forwards to IPAM.
GC removes host veths of this network whose attachment is not valid, then forwards.
"""

from __future__ import annotations

import ipaddress
import logging
import threading
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

from cni_plugin.cni import conf as c
from cni_plugin.cni import invoke, log, skel, types
from cni_plugin.cni.errors import CniError, Code
from cni_plugin.config import PluginConf

if TYPE_CHECKING:
    from types import ModuleType

logger = logging.getLogger("tabby.plugin")
Address = ipaddress.IPv4Address | ipaddress.IPv6Address

IPV4_GATEWAY = "169.254.1.1"
SCOPE_LINK = 253


def configure_logging(args: skel.CmdArgs) -> None:
    log.configure_for_call(args.config, args.command, args.container_id, args.ifname)


def dataplane() -> ModuleType:
    """The kernel side, imported only when a verb needs it (pyroute2 is ~110 ms)."""
    from cni_plugin import dataplane as dp

    return dp


# tabby-node installs a runner that serves tabby-ipam in-process (same handlers, same
# stdin and env, so identical results); per thread, because it serves calls concurrently.
IpamRunner = Callable[[str, str, bytes, Mapping[str, str]], "tuple[int, bytes] | None"]
_runner = threading.local()


@contextmanager
def ipam_runner(runner: IpamRunner) -> Iterator[None]:
    _runner.fn = runner
    try:
        yield
    finally:
        _runner.fn = None


def start_ipam(
    args: skel.CmdArgs, conf: PluginConf, command: str
) -> Callable[[], dict[str, Any] | None]:
    """Start the delegated IPAM call; the returned function waits for its result."""
    runner: IpamRunner | None = getattr(_runner, "fn", None)
    if runner is not None:
        env = invoke.delegate_env(args.env, command)
        served = runner(conf.ipam_type, command, args.stdin, env)
        if served is not None:
            rc, out = served
            return lambda: invoke.parse_output(conf.ipam_type, command, rc, out)
    return invoke.start_plugin(conf.ipam_type, command, args.stdin, args.env, args.path).result


def call_ipam(args: skel.CmdArgs, conf: PluginConf, command: str) -> dict[str, Any] | None:
    return start_ipam(args, conf, command)()


def _preload_dataplane() -> None:
    """Import the netlink side (pyroute2, ~60 ms) now, e.g. while IPAM runs in its process."""
    get = getattr(dataplane(), "get_dataplane", None)
    if get is not None:
        get()


def _ipam_del_quietly(args: skel.CmdArgs, conf: PluginConf) -> None:
    try:
        call_ipam(args, conf, "DEL")
    except CniError as e:
        logger.error("rollback: IPAM DEL failed: %s", e)


def _mac_capability(config: dict[str, Any]) -> str | None:
    mac = c.runtime_value(config, "mac")
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


def _addresses(result: dict[str, Any]) -> list[Address]:
    return [ipaddress.ip_interface(ip["address"]).ip for ip in result.get("ips", [])]


def host_ifname(args: skel.CmdArgs, conf: PluginConf) -> str:
    name: str = dataplane().host_veth_name(
        conf.veth_prefix, args.network, args.container_id, args.ifname
    )
    return name


def cmd_add(args: skel.CmdArgs) -> dict[str, Any]:
    conf = PluginConf(args.config)
    mac = _mac_capability(args.config)
    prev = types.prev_result(args.config, args.cni_version) or {}
    pending = start_ipam(args, conf, "ADD")
    try:
        _preload_dataplane()  # overlaps the IPAM process (2 cores: ~40 ms off every ADD)
    except BaseException:
        try:
            pending()
        finally:
            _ipam_del_quietly(args, conf)
        raise
    raw = pending()
    try:
        ipam_result = types.canonical(raw or {}, args.cni_version)
        addresses = _addresses(ipam_result)
        if not addresses:
            raise CniError(
                Code.DELEGATE_FAILED,
                f"{conf.ipam_type} returned no IP addresses",
                "ADD-8: a result without addresses is an error",
            )
        dp = dataplane()
        done = dp.setup(setup_spec(args, conf, addresses, mac))
    except BaseException:
        # Whatever failed after IPAM succeeded: the dataplane cleaned itself up; give the
        # addresses back before reporting (ADD-5). BaseException: also on SIGTERM/Ctrl-C.
        _ipam_del_quietly(args, conf)
        raise
    logger.info(
        "added %s on %s (host veth %s)",
        ", ".join(map(str, addresses)),
        args.netns,
        done.host_ifname,
    )
    return types.render(
        build_result(args, conf, prev, ipam_result, addresses, done), args.cni_version
    )


def build_result(
    args: skel.CmdArgs,
    conf: PluginConf,
    prev: dict[str, Any],
    ipam_result: dict[str, Any],
    addresses: list[Address],
    done: Any,
) -> dict[str, Any]:
    """Both interfaces, the IPs on the container side, the routes actually programmed."""
    interfaces = list(prev.get("interfaces", []))
    interfaces.append({"name": done.host_ifname, "mac": done.host_mac, "mtu": conf.mtu})
    interfaces.append(
        {"name": args.ifname, "mac": done.container_mac, "mtu": conf.mtu, "sandbox": args.netns}
    )
    idx = len(interfaces) - 1
    ips = list(prev.get("ips", []))
    for a in addresses:
        gw = IPV4_GATEWAY if a.version == 4 else str(dataplane().IPV6_GATEWAY)
        ips.append({"address": f"{a}/{a.max_prefixlen}", "gateway": gw, "interface": idx})
    routes = list(prev.get("routes", []))
    for r in done.routes:
        route: dict[str, Any] = {"dst": str(r.dst)}
        if r.gw is not None:
            route["gw"] = str(r.gw)
        if r.scope == SCOPE_LINK:
            route["scope"] = SCOPE_LINK
        routes.append(route)
    out: dict[str, Any] = {**prev, "interfaces": interfaces, "ips": ips, "routes": routes}
    dns = ipam_result.get("dns") or prev.get("dns")
    if dns:
        out["dns"] = dns
    return out


def setup_spec(
    args: skel.CmdArgs, conf: PluginConf, addresses: list[Address], mac: str | None
) -> Any:
    """What the dataplane builds (ADD) or verifies (CHECK) for this attachment."""
    return dataplane().SetupSpec(
        netns_path=args.netns,
        ifname=args.ifname,
        host_ifname=host_ifname(args, conf),
        addresses=addresses,
        mtu=conf.mtu,
        mac=mac,
        allow_ip_forwarding=conf.allow_ip_forwarding,
        alias=attachment_alias(args),
    )


def attachment_alias(args: skel.CmdArgs) -> str:
    """Recorded on the host veth (IFLA_IFALIAS) so GC and tabbyctl can tell whose it is."""
    return f"tabby:{args.network}:{args.container_id}:{args.ifname}"


def cmd_del(args: skel.CmdArgs) -> None:
    conf = PluginConf(args.config, for_teardown=True)
    prev = None
    try:
        prev = types.prev_result(args.config, args.cni_version)
    except CniError as e:  # a bad cached result must not block cleanup (DEL-4)
        logger.warning("ignoring unusable prevResult: %s", e)
    local_error: CniError | None = None
    try:
        dataplane().teardown(
            args.netns or None,
            args.ifname,
            host_ifname(args, conf),
            _addresses(prev) if prev else None,
        )
    except CniError as e:
        logger.error("local teardown failed: %s", e)
        local_error = e
    # IPAM DEL always, even when local cleanup failed or the netns is gone (DEL-3).
    call_ipam(args, conf, "DEL")
    logger.info("deleted (netns %s)", args.netns or "-")
    if local_error is not None:
        raise local_error
    return None


def cmd_check(args: skel.CmdArgs) -> None:
    conf = PluginConf(args.config)
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
    dp = dataplane()
    spec = setup_spec(args, conf, addresses, None)
    # Compare against prevResult (the final result: a later plugin may have changed the
    # MAC, CHK-4), not against what ADD printed.
    # The pod routes to expect are those prevResult says were programmed: a second
    # attachment of the same pod skips the default routes the first one owns.
    listed = {(r.get("dst"), r.get("gw") or None) for r in prev.get("routes", [])}
    routes = [
        r
        for r in dp.default_pod_routes(addresses)
        if (str(r.dst), str(r.gw) if r.gw is not None else None) in listed
    ]
    # IPAM's CHECK runs (in its own process) while the kernel is inspected here; the
    # dataplane's error, if any, is the one reported, as when they ran one after the other.
    pending = start_ipam(args, conf, "CHECK")
    try:
        dp.check(spec, dp.ExpectedState(container_mac=pod_if.get("mac"), routes=routes))
    except BaseException:
        try:
            pending()
        except Exception as e:  # reported second: logged only
            logger.info("IPAM CHECK also failed: %s", e)
        raise
    pending()
    return None


def cmd_gc(args: skel.CmdArgs) -> None:
    """Remove this network's host veths whose attachment is not valid; forward to IPAM.

    Keeps going after individual failures and reports them together (GC-5).
    """
    conf = PluginConf(args.config, for_teardown=True)
    valid = c.valid_attachments(args.config)
    errors: list[CniError] = []
    if valid is not None:
        dp = dataplane()
        keep = {
            dp.host_veth_name(conf.veth_prefix, args.network, cid, ifname) for cid, ifname in valid
        }
        mine = f"tabby:{args.network}:"
        try:
            stale = [
                v.name
                for v in dp.list_host_veths(conf.veth_prefix)
                if v.alias.startswith(mine) and v.name not in keep
            ]
        except CniError as e:
            errors.append(e)
            stale = []
        for name in stale:
            try:
                dp.delete_host_veth(name)
                logger.info("GC removed host veth %s", name)
            except CniError as e:
                errors.append(e)
    try:
        call_ipam(args, conf, "GC")  # GC-6: always forwarded, with the same stdin
    except CniError as e:
        errors.append(e)
    if errors:
        first = errors[0]
        raise CniError(first.code, first.msg, "; ".join(str(e) for e in errors))
    return None


def cmd_status(args: skel.CmdArgs) -> None:
    conf = PluginConf(args.config, for_teardown=True)
    call_ipam(args, conf, "STATUS")
    return None


HANDLERS = skel.Handlers(add=cmd_add, delete=cmd_del, check=cmd_check, gc=cmd_gc, status=cmd_status)
