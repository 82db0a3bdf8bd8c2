"""CNI result objects: one canonical (1.1.0) shape inside, converted only at the edges.

Results are plain JSON-shaped dicts (they are read from and written to JSON and nothing
else; plain dicts keep start-up cheap). ``canonical`` turns any supported version's result
into the 1.1.0 shape, validating it; ``render`` turns the canonical shape into the
request's version (CONFORMANCE.md "Versions", CHN-2, ADD-3).
"""

from __future__ import annotations

import ipaddress

from bundle.types import JSON, IPAddress, IPInterface

from . import version as ver
from .errors import CniError, Code

# Fields that exist only from 1.1.0 on (CONFORMANCE.md "Versions").
_IFACE_11 = ("mtu", "socketPath", "pciID")
_ROUTE_11 = ("mtu", "advmss", "priority", "table", "scope")


def _bad(msg: str, details: str) -> CniError:
    return CniError(Code.DECODE_FAILURE, msg, details)


def _cidr(value: object, where: str) -> IPInterface:
    if not isinstance(value, str) or "/" not in value:
        raise _bad("invalid result", f"{where}: {value!r} is not an address in CIDR form")
    try:
        return ipaddress.ip_interface(value)
    except ValueError:
        raise _bad("invalid result", f"{where}: {value!r} is not an address in CIDR form") from None


def _ip(value: object, where: str) -> IPAddress:
    try:
        return ipaddress.ip_address(str(value))
    except ValueError:
        raise _bad("invalid result", f"{where}: {value!r} is not an IP address") from None


def canonical(raw: object, version: str) -> JSON:
    """Parse a result of ``version`` (a prevResult or a delegate's answer) into 1.1.0 shape.

    The legacy ``ips[].version`` is checked against the address family and dropped.
    Unknown keys are kept, so a result passes through chained plugins unharmed.
    """
    if not isinstance(raw, dict):
        raise _bad("invalid result", f"result is {type(raw).__name__}, not an object")
    legacy = ver.is_legacy(version)
    out: JSON = {k: v for k, v in raw.items() if k != "cniVersion"}
    interfaces = raw.get("interfaces") or []
    if not isinstance(interfaces, list) or not all(isinstance(i, dict) for i in interfaces):
        raise _bad("invalid result", "interfaces must be a list of objects")
    out["interfaces"] = [dict(i) for i in interfaces]
    ips = raw.get("ips") or []
    if not isinstance(ips, list):
        raise _bad("invalid result", "ips must be a list")
    out["ips"] = [_canonical_ip(n, ip, legacy, len(interfaces)) for n, ip in enumerate(ips)]
    routes = raw.get("routes") or []
    if not isinstance(routes, list):
        raise _bad("invalid result", "routes must be a list")
    for n, r in enumerate(routes):
        if not isinstance(r, dict):
            raise _bad("invalid result", f"routes[{n}] is not an object")
        _cidr(r.get("dst"), f"routes[{n}].dst")
        if r.get("gw"):
            _ip(r["gw"], f"routes[{n}].gw")
    out["routes"] = [dict(r) for r in routes]
    if not out["interfaces"]:
        del out["interfaces"]
    if not out["routes"]:
        del out["routes"]
    if not out.get("dns"):
        out.pop("dns", None)
    return out


def _canonical_ip(n: int, ip: object, legacy: bool, interfaces: int) -> JSON:
    """``ips[n]`` of a result checked (``legacy``: its ``version`` against the address
    family; ``interface``: an index into the ``interfaces`` interfaces), without
    ``version``."""
    if not isinstance(ip, dict):
        raise _bad("invalid result", f"ips[{n}] is not an object")
    addr = _cidr(ip.get("address"), f"ips[{n}].address")
    entry = {k: v for k, v in ip.items() if k != "version"}
    if legacy and "version" in ip and ip["version"] != str(addr.version):
        raise _bad(
            "invalid result",
            f"ips[{n}].version {ip['version']!r} does not match {ip.get('address')}",
        )
    if "gateway" in ip and ip["gateway"] not in (None, ""):
        _ip(ip["gateway"], f"ips[{n}].gateway")
    idx = ip.get("interface")
    if idx is not None and (not isinstance(idx, int) or not 0 <= idx < interfaces):
        raise _bad("invalid result", f"ips[{n}].interface {idx!r} is out of range")
    return entry


def render(result: JSON, version: str) -> JSON:
    """The canonical result in the shape of ``version``, with ``cniVersion`` set (GEN-8)."""
    out: JSON = {"cniVersion": version}
    pre11 = not ver.at_least(version, "1.1.0")
    legacy = ver.is_legacy(version)
    for key, value in result.items():
        if key == "cniVersion":
            continue
        if key == "interfaces":
            value = [{k: v for k, v in i.items() if not (pre11 and k in _IFACE_11)} for i in value]
        elif key == "routes":
            value = [{k: v for k, v in r.items() if not (pre11 and k in _ROUTE_11)} for r in value]
        elif key == "ips":
            ips = []
            for ip in value:
                entry = dict(ip)
                if legacy:
                    entry["version"] = str(ipaddress.ip_interface(ip["address"]).version)
                ips.append(entry)
            value = ips
        elif key == "dns" and not value:
            continue
        out[key] = value
    out.setdefault("ips", [])
    return out


def prev_result(config: JSON, version: str) -> JSON | None:
    """The config's prevResult in canonical shape (CHN-1), or None when absent or empty."""
    raw = config.get("prevResult")
    if not raw:
        return None
    if isinstance(raw, dict) and raw.get("cniVersion") not in (None, ""):
        version = str(raw["cniVersion"])
        if version not in ver.SUPPORTED_VERSIONS:
            raise CniError(
                Code.INCOMPATIBLE_VERSION,
                "unsupported prevResult version",
                f"prevResult cniVersion {version!r}",
            )
    return canonical(raw, version)
