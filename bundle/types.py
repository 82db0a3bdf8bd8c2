"""The types every layer shares, defined once (standard library only, cheap to import).

Layer 0 with the version: the foundations (the CNI protocol, the stores), the IPAM core,
the resources, policy, the kernel side, the plugins and the programs all import them from
here, and nothing else defines them (tests/unit/repository/test_shared_types.py).

``IPAddress``, ``IPNetwork``, ``IPInterface``
    an IPv4 or IPv6 address, network or interface (address with its prefix), as the
    ``ipaddress`` module makes them.
``JSON``
    one JSON object as decoded at an edge (a CNI config or result, a Kubernetes object, a
    stored document before its model validates it): ``dict[str, Any]``.
"""

from __future__ import annotations

import ipaddress
from typing import Any, TypeAlias

IPAddress: TypeAlias = ipaddress.IPv4Address | ipaddress.IPv6Address
IPNetwork: TypeAlias = ipaddress.IPv4Network | ipaddress.IPv6Network
IPInterface: TypeAlias = ipaddress.IPv4Interface | ipaddress.IPv6Interface
JSON: TypeAlias = dict[str, Any]
