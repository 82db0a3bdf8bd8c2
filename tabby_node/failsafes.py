"""The failsafe ports tabby-node programs for the node's host endpoints: those configured
(``--failsafe-inbound-host-ports`` / ``--failsafe-outbound-host-ports``, Calico's defaults)
and tabby-node's own needs, derived from its configuration when it starts: its datastore's
endpoints (etcd) or API server (Kubernetes), tabby-typha's endpoints, BGP (TCP 179 both
ways with the ``bird`` backend) and VXLAN (UDP 4789 both ways, unless the backend is
``none``), so that no host-endpoint policy can cut the node off them. IP-in-IP (protocol 4)
is not a port: a host-endpoint policy must allow it from the other nodes.
"""

from __future__ import annotations

import ipaddress
import logging
import socket
import urllib.parse
from collections.abc import Callable, Iterable

from cni_config.common import DatastoreSettings
from dataplane.overlay_model import VXLAN_PORT
from policy.calico import FailsafePort, Failsafes, parse_failsafe_ports
from tabby_node.options import NodeOptions

log = logging.getLogger("tabby.node")

Resolver = Callable[[str], list[str]]


def _resolve(host: str) -> list[str]:
    try:
        infos = socket.getaddrinfo(host, None, proto=socket.IPPROTO_TCP)
    except OSError:
        return []
    return sorted({str(info[4][0]) for info in infos})


def _split(url: str) -> tuple[str, int] | None:
    """``scheme://host:port`` or ``host:port`` as (host, port); None without a port."""
    parts = urllib.parse.urlsplit(url if "//" in url else f"//{url}")
    try:
        port = parts.port
    except ValueError:
        return None
    if parts.hostname is None:
        return None
    if port is None:
        port = {"https": 443, "http": 80}.get(parts.scheme)
    return (parts.hostname, port) if port is not None else None


def _to(endpoints: Iterable[str], resolve: Resolver) -> list[FailsafePort]:
    """Outbound failsafe ports to each endpoint's addresses (a name resolved now)."""
    out = []
    for url in endpoints:
        split = _split(url)
        if split is None:
            continue
        host, port = split
        try:
            addrs = [str(ipaddress.ip_address(host))]
        except ValueError:
            addrs = resolve(host)
            if not addrs:
                log.warning("failsafe: %s does not resolve now; not added", host)
        for a in addrs:
            out.append(FailsafePort("tcp", port, a))
    return out


def own_needs(
    options: NodeOptions,
    settings: DatastoreSettings,
    *,
    api_server: str | None = None,
    resolve: Resolver = _resolve,
) -> tuple[list[FailsafePort], list[FailsafePort]]:
    """(inbound, outbound) failsafe ports tabby-node itself needs: the datastore's
    endpoints (``api_server`` in Kubernetes mode: the server tabby-node talks to),
    tabby-typha's, BGP with the ``bird`` backend, VXLAN unless the backend is ``none``."""
    inbound: list[FailsafePort] = []
    outbound: list[FailsafePort] = []
    if settings.datastore_type == "etcdv3":
        outbound += _to([*settings.etcd_endpoints, *settings.etcd_watch_endpoints], resolve)
    if settings.datastore_type == "kubernetes" and api_server:
        outbound += _to([api_server], resolve)
    if options.typha_endpoints:
        from fanout.client import parse_endpoints

        outbound += _to(parse_endpoints(options.typha_endpoints), resolve)
    if options.typha_service:  # its endpoints come and go: typha's port, to anywhere
        from fanout import DEFAULT_PORT

        outbound.append(FailsafePort("tcp", DEFAULT_PORT))
    if options.backend == "bird":
        inbound.append(FailsafePort("tcp", 179))
        outbound.append(FailsafePort("tcp", 179))
    if options.backend != "none":  # VXLAN between nodes (a pool may ask for it under bird)
        inbound.append(FailsafePort("udp", VXLAN_PORT))
        outbound.append(FailsafePort("udp", VXLAN_PORT))
    return inbound, outbound


def node_failsafes(
    options: NodeOptions,
    settings: DatastoreSettings,
    *,
    api_server: str | None = None,
    resolve: Resolver = _resolve,
) -> Failsafes:
    """The configured failsafe ports and tabby-node's own needs."""
    configured = Failsafes(
        parse_failsafe_ports(options.failsafe_inbound_host_ports),
        parse_failsafe_ports(options.failsafe_outbound_host_ports),
    )
    inbound, outbound = own_needs(options, settings, api_server=api_server, resolve=resolve)
    return configured.plus(inbound, outbound)


__all__ = ["node_failsafes", "own_needs"]
