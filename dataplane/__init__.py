"""The kernel side of the ``tabby`` plugin: veth pair, addresses, routes and sysctls.

Importing this package costs nothing: every name below is loaded on first use (PEP 562),
and pyroute2 (~110 ms) only when a function that talks netlink runs. Keep it that way: the
CNI binary is a new process per call, so start-up cost is the product's headline number.

Public API (all from ``dataplane``):

* ``setup(SetupSpec) -> SetupResult``: build the pod's data path (rolls back on failure).
* ``teardown(netns_path, ifname, host_ifname, addresses=None)``: idempotent removal.
* ``check(SetupSpec, ExpectedState | None)``: raise ``CniError`` on the first mismatch.
* ``list_host_veths(prefix) -> list[HostVeth]``, ``delete_host_veth(name)``: for GC.
* ``host_veth_name(prefix, network, container_id, ifname)``, ``validate_veth_prefix``.
* ``get_dataplane() -> Dataplane``: the Linux implementation, as a ``Dataplane`` protocol.
* Data: ``SetupSpec``, ``SetupResult``, ``ExpectedState``, ``PodRoute``, ``HostVeth``;
  errors ``NetNSNotFound`` (code 3; DEL treats it as success) and ``InvalidNetNS`` (code 8).

"Host" is the network namespace of the *calling thread*; the pod namespace is only ever
entered by short-lived worker threads, so the caller's namespace never changes.
This package knows nothing about CNI results or IPAM.
"""

from __future__ import annotations

import sys

# Not `from typing import TYPE_CHECKING`: importing typing costs ~10 ms in a fresh process,
# and this package must stay free to import. mypy treats any `TYPE_CHECKING` name as true.
TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Any

    from dataplane.linux import (
        check,
        delete_host_veth,
        list_host_veths,
        pod_interface_present,
        setup,
        teardown,
    )
    from dataplane.model import (
        DEFAULT_VETH_PREFIX,
        HOST_VETH_MAC,
        IPV4_GATEWAY,
        IPV6_GATEWAY,
        SCOPE_LINK,
        SCOPE_UNIVERSE,
        Dataplane,
        ExpectedState,
        HostVeth,
        PodRoute,
        SetupResult,
        SetupSpec,
        default_pod_routes,
    )
    from dataplane.names import host_veth_name, validate_veth_prefix
    from dataplane.netns import InvalidNetNS, NetNSNotFound

__all__ = [
    "DEFAULT_VETH_PREFIX",
    "HOST_VETH_MAC",
    "IPV4_GATEWAY",
    "IPV6_GATEWAY",
    "SCOPE_LINK",
    "SCOPE_UNIVERSE",
    "Dataplane",
    "ExpectedState",
    "HostVeth",
    "InvalidNetNS",
    "NetNSNotFound",
    "PodRoute",
    "SetupResult",
    "SetupSpec",
    "check",
    "default_pod_routes",
    "delete_host_veth",
    "get_dataplane",
    "host_veth_name",
    "list_host_veths",
    "pod_interface_present",
    "setup",
    "teardown",
    "validate_veth_prefix",
]

# name -> submodule that defines it; loaded on first attribute access.
_LAZY = {
    **dict.fromkeys(
        (
            "check",
            "delete_host_veth",
            "list_host_veths",
            "pod_interface_present",
            "setup",
            "teardown",
        ),
        "linux",
    ),
    **dict.fromkeys(
        (
            "DEFAULT_VETH_PREFIX",
            "HOST_VETH_MAC",
            "IPV4_GATEWAY",
            "IPV6_GATEWAY",
            "SCOPE_LINK",
            "SCOPE_UNIVERSE",
            "Dataplane",
            "ExpectedState",
            "HostVeth",
            "PodRoute",
            "SetupResult",
            "SetupSpec",
            "default_pod_routes",
        ),
        "model",
    ),
    **dict.fromkeys(("host_veth_name", "validate_veth_prefix"), "names"),
    **dict.fromkeys(("InvalidNetNS", "NetNSNotFound"), "netns"),
}


if not TYPE_CHECKING:  # hidden from mypy, so a misspelt name is still a type error

    def __getattr__(name: str) -> Any:
        module = _LAZY.get(name)
        if module is None:
            raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
        qualified = f"{__name__}.{module}"
        __import__(qualified)
        value = getattr(sys.modules[qualified], name)
        globals()[name] = value  # later lookups skip __getattr__
        return value


def __dir__() -> list[str]:
    return sorted(__all__)


def get_dataplane() -> Dataplane:
    """The Linux data path (loads pyroute2)."""
    from dataplane import linux

    return linux
