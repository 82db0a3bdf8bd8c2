"""tabby-node's view from tabby-typha (``--typha-endpoints``/``--typha-service``): the sync
source the watcher reads instead of the datastore's watch (``fanout.client.TyphaSync``).
Writes (IPAM, registration, endpoints) still go to the datastore: typha serves reads only."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from fanout.client import ClientTls, TyphaSync, parse_endpoints

if TYPE_CHECKING:
    from bundle.types import JSON
    from tabby_node.options import NodeOptions

log = logging.getLogger("tabby.node")


def source(
    options: NodeOptions, node: str, kubeconfig: str | None, problems: dict[str, str]
) -> TyphaSync:
    """The typha client ``options`` configure (``options.typha`` is true); while typha
    cannot be read, ``problems["typha"]`` says why (readiness)."""
    tls = None
    if options.typha_ca_file is not None:
        assert options.typha_cert_file is not None
        assert options.typha_key_file is not None
        tls = ClientTls(
            _read(options.typha_ca_file),
            _read(options.typha_cert_file),
            _read(options.typha_key_file),
            options.typha_cn,
        )
    if options.typha_endpoints:
        return TyphaSync(parse_endpoints(options.typha_endpoints), node, tls, problems=problems)
    assert options.typha_service is not None
    service = options.typha_service
    return TyphaSync(lambda: service_endpoints(service, kubeconfig), node, tls, problems=problems)


def service_endpoints(service: str, kubeconfig: str | None) -> list[str]:
    """``host:port`` of the ready addresses of the Kubernetes Service ``NAMESPACE/NAME``
    (its v1 Endpoints; the port named ``typha``, else the first); [] when the API cannot
    say (the client tries again after its back-off)."""
    from stores.kube.client import ApiError, KubeClient, KubeConfig

    namespace, _, name = service.partition("/")
    try:
        client = KubeClient(KubeConfig.load(kubeconfig), timeout=5.0, agent="tabby-node")
    except (ApiError, OSError, ValueError) as e:
        log.warning("typha service %s: %s", service, e)
        return []
    try:
        endpoints = client.get(f"/api/v1/namespaces/{namespace}/endpoints/{name}")
    except (ApiError, OSError, ValueError) as e:
        log.warning("typha service %s: %s", service, e)
        return []
    finally:
        client.close()
    return addresses_of(endpoints)


def addresses_of(endpoints: JSON) -> list[str]:
    out = []
    for subset in endpoints.get("subsets") or ():
        ports = subset.get("ports") or []
        named = [p for p in ports if p.get("name") == "typha"] or ports[:1]
        if not named or not isinstance(named[0].get("port"), int):
            continue
        port = named[0]["port"]
        for address in subset.get("addresses") or ():
            ip = address.get("ip")
            if isinstance(ip, str) and ip:
                out.append(f"[{ip}]:{port}" if ":" in ip else f"{ip}:{port}")
    return out


def _read(path: str) -> bytes:
    with open(path, "rb") as f:
        return f.read()
