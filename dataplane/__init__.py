"""The kernel: what tabby makes in it and reads back, and nothing else.

* the pod's data path (``linux.py``): veth pair, addresses, /32 and /128 routes, sysctls,
  in the pod's network namespace (``netns.py``) and the host's;
* the node's VXLAN/IP-in-IP routing (``overlay.py``, ``overlay_model.py``,
  ``rtnl_routing.py``) and what the node is (``nodeinfo.py``);
* nftables: a script applied as one transaction (``nft.py``: libnftables by ctypes, or the
  ``nft`` CLI), a table's counters read and zeroed, NFLOG and trace events
  (``nfnetlink.py``), a packet traced (``nfttrace.py``);
* rtnetlink over tabby's own transport (``rtnl.py``, ``rtnl_routing.py``: pyroute2 for the
  message formats only, loaded lazily by ``lazy_pyroute2.py``);
* the data types and the ``Dataplane`` protocol the plugin is given (``model.py``), the
  names of what tabby makes in the kernel (``names.py``) and the errors (``errors.py``).

The dataplane applies what it is given: it knows no CNI (its callers choose what an error
means: the ``tabby`` plugin's CNI codes are in ``cni_plugin.cni_codes``), no policy (the
policy state, the nft text and what a trace says are in ``policy``), no configuration and
no datastore.

Importing this package costs nothing: every name below is loaded on first use (PEP 562),
and pyroute2 (~110 ms) only when a function that talks netlink runs. Keep it that way: the
CNI binary is a new process per call, so start-up cost is the product's headline number.

Public API (all from ``dataplane``):

* ``setup(SetupSpec) -> SetupResult``: build the pod's data path (rolls back on failure).
* ``teardown(netns_path, ifname, host_ifname, addresses=None)``: idempotent removal.
* ``check(SetupSpec, ExpectedState | None)``: raise ``CheckMismatch`` on the first mismatch.
* ``list_host_veths(prefix) -> list[HostVeth]``, ``delete_host_veth(name)``: for GC.
* ``host_veth_name(prefix, network, container_id, ifname)``, ``validate_veth_prefix``.
* ``get_dataplane() -> Dataplane``: the Linux implementation, as a ``Dataplane`` protocol.
* Data: ``SetupSpec``, ``SetupResult``, ``ExpectedState``, ``PodRoute``, ``HostVeth``.
* Errors (``errors.py``; ``nodeinfo.AutodetectError`` too), all a ``DataplaneError``:
  ``NetNSNotFound`` (the namespace is gone), ``InvalidNetNS`` (not a network namespace, or
  the caller's own), ``InvalidVethPrefix``, ``InterfaceConflict`` (a name tabby wants is
  taken by what is not its own), ``NetlinkFailure``, ``SysctlFailure``, ``CheckMismatch``,
  ``NftError``.

"Host" is the network namespace of the *calling thread*; the pod namespace is only ever
entered by short-lived worker threads, so the caller's namespace never changes.
"""

from __future__ import annotations

import sys

# Not `from typing import TYPE_CHECKING`: importing typing costs ~10 ms in a fresh process,
# and this package must stay free to import. mypy treats any `TYPE_CHECKING` name as true.
TYPE_CHECKING = False
if TYPE_CHECKING:
    from dataplane.errors import (
        CheckMismatch,
        DataplaneError,
        InterfaceConflict,
        InvalidNetNS,
        InvalidVethPrefix,
        NetlinkFailure,
        NetNSNotFound,
        NftError,
        SysctlFailure,
    )
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

__all__ = [
    "DEFAULT_VETH_PREFIX",
    "HOST_VETH_MAC",
    "IPV4_GATEWAY",
    "IPV6_GATEWAY",
    "SCOPE_LINK",
    "SCOPE_UNIVERSE",
    "CheckMismatch",
    "Dataplane",
    "DataplaneError",
    "ExpectedState",
    "HostVeth",
    "InterfaceConflict",
    "InvalidNetNS",
    "InvalidVethPrefix",
    "NetNSNotFound",
    "NetlinkFailure",
    "NftError",
    "PodRoute",
    "SetupResult",
    "SetupSpec",
    "SysctlFailure",
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
    **dict.fromkeys(
        (
            "CheckMismatch",
            "DataplaneError",
            "InterfaceConflict",
            "InvalidNetNS",
            "InvalidVethPrefix",
            "NetNSNotFound",
            "NetlinkFailure",
            "NftError",
            "SysctlFailure",
        ),
        "errors",
    ),
}


if not TYPE_CHECKING:  # hidden from mypy, so a misspelt name is still a type error

    def __getattr__(name: str) -> object:
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
