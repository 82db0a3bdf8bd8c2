"""Render a :class:`~bird.model.BirdConfig` into BIRD 2 configuration text.

Plain string code, no template engine: the text is a fixed skeleton with a few loops, and
the decisions (passive side, reflector clients, which families) are Python either way.
The output is a pure function of the (normalised, sorted) inputs: no timestamps, no dict
order, so the agent reloads BIRD only when the text differs.

What the configuration does (facts measured with BIRD 2.0.12):

* ``tabby_blocks4/6``: a blackhole per block affine to the node; ``tabby_borrowed4/6``: a
  /32 (/128) per address held in another node's block. Both are exported to every peer.
* ``tabby_kernel4/6`` (the kernel protocol) learns nothing (the CNI plugin's ``dev cali…``
  /32 routes are never re-exported) and installs into the main table: the node's own
  blackholes and every route learned over BGP, via the announcing peer's underlay address
  (``gateway direct``; iBGP needs ``direct;`` for that, else it is multihop), through
  ``tunl0`` onlink for IP-in-IP pools. Never the borrowed statics: on this node the pod's
  own route delivers. ``persist``: routes stay when BIRD stops.
* Graceful restart: peers keep this node's routes while its BIRD restarts; a BIRD started
  with ``-R`` (the supervisor does so when a BIRD ran in its run directory before, e.g.
  after a crash) keeps its kernel routes until its peers have re-sent theirs, but at most
  ``graceful restart wait`` seconds; meanwhile it sends the kernel no updates at all, so a
  peer that is down would hold them back for BIRD's default of 240 s.
* Peers: one protocol per :class:`~bird.model.Peer`, named
  ``<Type>_<address with . and : as _>`` (``Mesh_10_0_0_2``, ``Rr_fd00__2``), which
  :func:`parse_protocol_name` reverses for ``node status``. Mesh and reflector sessions are
  ``passive`` on the side whose own address sorts lower, so only one side connects.
* ``device``/``direct`` ignore ``cali*`` interfaces (thousands of pod veths are none of
  BIRD's business); direct routes are exported nowhere.
* Routes from peers are accepted only inside the configured pools.
"""

from __future__ import annotations

import ipaddress

from bird.model import BirdConfig, Peer, PeerType
from bundle.types import IPAddress

#: The IP-in-IP tunnel device (routes of ipip pools go through it, onlink).
IPIP_DEVICE = "tunl0"
#: Seconds a BIRD started with ``-R`` waits for its peers before it syncs the kernel anyway.
GRACEFUL_RESTART_WAIT = 20
#: Interfaces BIRD's device and direct protocols never look at.
IGNORED_INTERFACES = ("cali*", "kube-ipvs*")
#: BIRD's time format for ``show protocols`` and ``show status`` (parsed by control.py):
#: no spaces, microseconds, numeric UTC offset.
TIME_FORMAT = "%Y-%m-%dT%H:%M:%S.%6f%z"

_TYPE_PREFIX = {
    PeerType.MESH: "Mesh",
    PeerType.RR: "Rr",
    PeerType.GLOBAL: "Global",
    PeerType.NODE: "Node",
}
_PREFIX_TYPE = {prefix: kind for kind, prefix in _TYPE_PREFIX.items()}

_LOG = {
    "debug": ("log stderr all;", "debug protocols all;"),
    "info": (
        "log stderr { info, remote, warning, error, auth, fatal, bug, trace };",
        "debug protocols { states };",
    ),
    "warning": ("log stderr { warning, error, auth, fatal, bug };", "debug protocols off;"),
    "error": ("log stderr { error, fatal, bug };", "debug protocols off;"),
}


def protocol_name(peer: Peer) -> str:
    """The BIRD protocol name of ``peer``'s session (a valid BIRD symbol)."""
    token = str(peer.address).replace(".", "_").replace(":", "_")
    return f"{_TYPE_PREFIX[peer.type]}_{token}"


def parse_protocol_name(name: str) -> tuple[PeerType, IPAddress] | None:
    """Reverse :func:`protocol_name`; None for any other protocol (kernel, static, ...)."""
    prefix, sep, token = name.partition("_")
    kind = _PREFIX_TYPE.get(prefix)
    if kind is None or not sep or not token:
        return None
    for candidate in (token.replace("_", "."), token.replace("_", ":")):
        try:
            return kind, ipaddress.ip_address(candidate)
        except ValueError:
            continue
    return None


def is_passive(config: BirdConfig, peer: Peer) -> bool:
    """Mesh and reflector sessions: only the side with the lower address connects (both
    sides compute the same answer), so graceful restart never races two connections."""
    if peer.type not in (PeerType.MESH, PeerType.RR):
        return False
    own = config.node.address(peer.address.version)
    assert own is not None  # BirdConfig checked it
    return int(peer.address) > int(own)  # same family (BirdConfig checked)


def _net_set(nets: list[str]) -> str:
    return "[ " + ", ".join(f"{n}+" for n in nets) + " ]"


def _static(name: str, channel: str, routes: list[str], what: str) -> list[str]:
    lines = [f"# {what}", f"protocol static {name} {{", f"  {channel};"]
    lines += [f"  route {r} blackhole;" for r in routes]
    lines += ["}", ""]
    return lines


def _family(config: BirdConfig, v: int) -> list[str]:
    """Everything of one address family: sets, statics, filters, kernel, BGP template."""
    ch = f"ipv{v}"
    own = config.node.address(v)
    assert own is not None
    pools = [p for p in config.pools if p.cidr.version == v]
    pool_nets = [str(p.cidr) for p in pools]
    ipip_nets = [str(p.cidr) for p in pools if p.ipip]
    blocks = [str(b) for b in config.blocks if b.version == v]
    host = 32 if v == 4 else 128
    borrowed = [f"{a}/{host}" for a in config.borrowed if a.version == v]
    blocks_proto, borrowed_proto = f"tabby_blocks{v}", f"tabby_borrowed{v}"

    out = [f"# ---- IPv{v} ----", ""]
    if pool_nets:
        out += [f"define TABBY_POOLS{v} = {_net_set(pool_nets)};"]
    if ipip_nets:
        out += [f"define TABBY_IPIP_POOLS{v} = {_net_set(ipip_nets)};"]
    if pool_nets:
        out += [""]
    out += _static(blocks_proto, ch, blocks, "Blocks affine to this node: a blackhole each.")
    out += _static(
        borrowed_proto,
        ch,
        borrowed,
        "Addresses this node holds in other nodes' blocks: exported, never installed here.",
    )

    out += [
        "# Into the kernel: this node's blackholes and what peers announced, nothing else.",
        f"filter tabby_to_kernel{v} {{",
        f'  if proto = "{blocks_proto}" then accept;',
        "  if source != RTS_BGP then reject;",
    ]
    if ipip_nets:
        out += [
            f"  if net ~ TABBY_IPIP_POOLS{v} then {{",
            f"    # IP-in-IP pool: via the peer's underlay address, through {IPIP_DEVICE}.",
            "    ip tabby_nexthop = gw;",
            f'    ifname = "{IPIP_DEVICE}";',
            "    onlink = true;",
            "    gw = tabby_nexthop;",
            "  }",
        ]
    out += ["  accept;", "}", ""]

    out += ["# From peers: routes inside the IP pools only.", f"filter tabby_import{v} {{"]
    if pool_nets:
        out += [f"  if net ~ TABBY_POOLS{v} then accept;"]
    out += ["  reject;", "}", ""]

    out += [
        "# To peers: this node's blocks and borrowed addresses; pool routes learned over BGP",
        "# (reflected to route reflector clients, passed on to eBGP peers).",
        f"filter tabby_export{v} {{",
        f'  if proto = "{blocks_proto}" || proto = "{borrowed_proto}" then accept;',
    ]
    if pool_nets:
        out += [f"  if source = RTS_BGP && net ~ TABBY_POOLS{v} then accept;"]
    out += ["  reject;", "}", ""]

    out += [
        f"protocol kernel tabby_kernel{v} {{",
        f"  {ch} {{",
        "    import none;",
        f"    export filter tabby_to_kernel{v};",
        "  };",
        "  learn off;",
        "  persist;",
        "  scan time 10;",
        "  graceful restart;",
        "}",
        "",
        f"template bgp tabby_bgp{v} {{",
        f"  local as {config.node.as_number};",
        f"  source address {own};",
        "  direct;",
        "  graceful restart on;",
        "  connect delay time 2;",
        "  connect retry time 5;",
        "  error wait time 5, 30;",
        f"  {ch} {{",
        "    gateway direct;",
        f"    import filter tabby_import{v};",
        f"    export filter tabby_export{v};",
        "  };",
        "}",
        "",
    ]
    return out


def _peer(config: BirdConfig, peer: Peer) -> list[str]:
    out = [f"protocol bgp {protocol_name(peer)} from tabby_bgp{peer.address.version} {{"]
    if peer.name:
        out += [f'  description "{peer.name}";']
    out += [f"  neighbor {peer.address} as {peer.as_number};"]
    if is_passive(config, peer):
        out += ["  passive on;"]
    if peer.rr_client:
        out += ["  rr client;", f"  rr cluster id {config.node.rr_cluster_id};"]
    out += ["}", ""]
    return out


def render(config: BirdConfig) -> str:
    """The BIRD 2 configuration text for ``config`` (deterministic)."""
    node = config.node
    log_line, debug_line = _LOG[config.log_severity]
    ignored = ", ".join(f'"-{pattern}"' for pattern in IGNORED_INTERFACES)
    out = [
        f"# BIRD 2 configuration of tabby-node for node {node.name}.",
        "# Generated: tabby-node rewrites it on every change and reloads BIRD; edits are lost.",
        "",
        f"router id {node.ipv4};",
        log_line,
        debug_line,
        f'timeformat base "{TIME_FORMAT}";',
        f'timeformat protocol "{TIME_FORMAT}";',
        f"graceful restart wait {GRACEFUL_RESTART_WAIT};",
        "",
        "protocol device tabby_device {",
        "  scan time 10;",
        f'  interface {ignored}, "*";',
        "}",
        "",
        "# Connected networks, for BIRD's own view; exported nowhere.",
        "protocol direct tabby_direct {",
        *(f"  ipv{v};" for v in config.versions),
        f'  interface {ignored}, "*";',
        "}",
        "",
    ]
    for v in config.versions:
        out += _family(config, v)
    if config.peers:
        out += ["# ---- BGP peers ----", ""]
    for peer in config.peers:
        out += _peer(config, peer)
    while out and out[-1] == "":
        out.pop()
    return "\n".join(out) + "\n"
