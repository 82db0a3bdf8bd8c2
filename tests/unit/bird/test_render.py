"""BIRD configuration rendering (bird.render) and its typed inputs.

Every configuration rendered here is also handed to ``bird -p`` (BIRD 2 parses and checks
it without starting), so a text that BIRD would refuse cannot pass.
"""

from __future__ import annotations

import dataclasses
import ipaddress
import random
import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest

from bird import (
    BirdConfig,
    BirdConfigError,
    BirdNode,
    Peer,
    PeerType,
    Pool,
    check_config,
    parse_protocol_name,
    protocol_name,
    render,
)

ip = ipaddress.ip_address
net = ipaddress.ip_network

V4 = ipaddress.IPv4Address
V6 = ipaddress.IPv6Address
N1, N2, N3 = V4("10.0.0.1"), V4("10.0.0.2"), V4("10.0.0.3")
V6_1, V6_2, V6_3 = V6("fd00::1"), V6("fd00::2"), V6("fd00::3")
POOL4, POOL6 = Pool(net("10.244.0.0/16")), Pool(net("fd10::/48"))

BIRD = shutil.which("bird") or shutil.which("bird", path="/usr/sbin:/usr/local/sbin")


@pytest.fixture
def bird_accepts(tmp_path: Path) -> Iterator[list[str]]:
    """Texts appended to the list are checked with ``bird -p`` at the end of the test."""
    texts: list[str] = []
    yield texts
    if BIRD is None:
        pytest.skip("bird (BIRD 2) is not installed: rendered text not checked by bird -p")
    for i, text in enumerate(texts):
        path = tmp_path / f"bird{i}.conf"
        path.write_text(text)
        check_config(str(path), BIRD)


def node(
    addr: ipaddress.IPv4Address,
    *,
    as_number: int = 64512,
    rr_cluster_id: ipaddress.IPv4Address | None = None,
) -> BirdNode:
    return BirdNode(f"node-{addr}", addr, as_number=as_number, rr_cluster_id=rr_cluster_id)


def section(text: str, header: str) -> str:
    """The block that starts with the line ``header`` (up to its closing brace)."""
    lines = text.splitlines()
    start = lines.index(header)
    end = lines.index("}", start)
    return "\n".join(lines[start : end + 1])


def mesh(own: ipaddress.IPv4Address, **kw: object) -> BirdConfig:
    peers = tuple(Peer(a, PeerType.MESH) for a in (N1, N2, N3) if a != own)
    return BirdConfig(
        node=node(own),
        peers=peers,
        pools=(POOL4,),
        blocks=(net(f"10.244.{own.packed[-1]}.0/26"),),
        **kw,  # type: ignore[arg-type]
    )


def test_full_mesh_one_session_per_node_passive_towards_higher_addresses(
    bird_accepts: list[str],
) -> None:
    text = render(mesh(N2))
    bird_accepts.append(text)
    assert section(text, "protocol bgp Mesh_10_0_0_1 from tabby_bgp4 {") == (
        "protocol bgp Mesh_10_0_0_1 from tabby_bgp4 {\n  neighbor 10.0.0.1 as 64512;\n}"
    )
    assert section(text, "protocol bgp Mesh_10_0_0_3 from tabby_bgp4 {") == (
        "protocol bgp Mesh_10_0_0_3 from tabby_bgp4 {\n"
        "  neighbor 10.0.0.3 as 64512;\n"
        "  passive on;\n"
        "}"
    )
    assert text.count("protocol bgp ") == 2
    # The two ends of every session disagree on who is passive: exactly one connects.
    for a, b in [(N1, N2), (N1, N3), (N2, N3)]:
        a_text, b_text = render(mesh(a)), render(mesh(b))
        a_passive = "passive on" in section(a_text, f"protocol bgp {_name(b)} from tabby_bgp4 {{")
        b_passive = "passive on" in section(b_text, f"protocol bgp {_name(a)} from tabby_bgp4 {{")
        assert a_passive != b_passive
        bird_accepts.append(a_text)

    template = section(text, "template bgp tabby_bgp4 {")
    for line in (
        "  local as 64512;",
        "  source address 10.0.0.2;",
        "  direct;",  # iBGP is multihop by default; `gateway direct` needs it
        "  graceful restart on;",
        "    gateway direct;",
        "    import filter tabby_import4;",
        "    export filter tabby_export4;",
    ):
        assert line in template.splitlines()
    assert "next hop self" not in text
    assert "router id 10.0.0.2;" in text


def _name(addr: ipaddress.IPv4Address | ipaddress.IPv6Address) -> str:
    return protocol_name(Peer(addr, PeerType.MESH))


def test_kernel_protocol_learns_nothing_and_installs_blocks_and_bgp_routes_only(
    bird_accepts: list[str],
) -> None:
    text = render(mesh(N1, borrowed=(ip("10.244.2.5"),)))
    bird_accepts.append(text)
    assert section(text, "protocol kernel tabby_kernel4 {") == (
        "protocol kernel tabby_kernel4 {\n"
        "  ipv4 {\n"
        "    import none;\n"
        "    export filter tabby_to_kernel4;\n"
        "  };\n"
        "  learn off;\n"
        "  persist;\n"
        "  scan time 10;\n"
        "  graceful restart;\n"
        "}"
    )
    assert section(text, "filter tabby_to_kernel4 {") == (
        "filter tabby_to_kernel4 {\n"
        '  if proto = "tabby_blocks4" then accept;\n'
        "  if source != RTS_BGP then reject;\n"
        "  accept;\n"
        "}"
    )
    assert section(text, "protocol static tabby_blocks4 {") == (
        "protocol static tabby_blocks4 {\n  ipv4;\n  route 10.244.1.0/26 blackhole;\n}"
    )
    # device and direct ignore the pods' host veths
    assert '  interface "-cali*", "-kube-ipvs*", "*";' in section(
        text, "protocol device tabby_device {"
    )
    assert '  interface "-cali*", "-kube-ipvs*", "*";' in section(
        text, "protocol direct tabby_direct {"
    )
    assert "graceful restart wait 20;" in text


def test_borrowed_addresses_are_exported_but_never_installed(bird_accepts: list[str]) -> None:
    config = mesh(N1, borrowed=(ip("10.244.2.5"), ip("10.244.3.9")))
    text = render(config)
    bird_accepts.append(text)
    assert section(text, "protocol static tabby_borrowed4 {") == (
        "protocol static tabby_borrowed4 {\n"
        "  ipv4;\n"
        "  route 10.244.2.5/32 blackhole;\n"
        "  route 10.244.3.9/32 blackhole;\n"
        "}"
    )
    assert '"tabby_borrowed4" then accept' in section(text, "filter tabby_export4 {")
    assert "tabby_borrowed4" not in section(text, "filter tabby_to_kernel4 {")


def test_route_reflector_renders_clients_and_no_mesh(bird_accepts: list[str]) -> None:
    cluster = V4("224.0.0.1")  # Calico's usual style of cluster id; any IPv4 works
    reflector = BirdConfig(
        node=node(N1, rr_cluster_id=cluster),
        peers=(Peer(N2, PeerType.RR, rr_client=True), Peer(N3, PeerType.RR, rr_client=True)),
        pools=(POOL4,),
    )
    client = BirdConfig(node=node(N2), peers=(Peer(N1, PeerType.RR),), pools=(POOL4,))
    rr_text, client_text = render(reflector), render(client)
    bird_accepts += [rr_text, client_text]

    assert section(rr_text, "protocol bgp Rr_10_0_0_2 from tabby_bgp4 {") == (
        "protocol bgp Rr_10_0_0_2 from tabby_bgp4 {\n"
        "  neighbor 10.0.0.2 as 64512;\n"
        "  passive on;\n"
        "  rr client;\n"
        "  rr cluster id 224.0.0.1;\n"
        "}"
    )
    assert section(client_text, "protocol bgp Rr_10_0_0_1 from tabby_bgp4 {") == (
        "protocol bgp Rr_10_0_0_1 from tabby_bgp4 {\n  neighbor 10.0.0.1 as 64512;\n}"
    )
    assert "Mesh_" not in rr_text + client_text
    assert "rr client" not in client_text
    # The reflector passes on what its clients announced (pool routes learned over BGP).
    assert "  if source = RTS_BGP && net ~ TABBY_POOLS4 then accept;" in section(
        rr_text, "filter tabby_export4 {"
    )


def test_explicit_global_and_node_peers_and_ebgp(bird_accepts: list[str]) -> None:
    config = BirdConfig(
        node=node(N2, as_number=64513),
        peers=(
            Peer(ip("10.0.0.254"), PeerType.GLOBAL, as_number=65000, name="tor"),
            Peer(N3, PeerType.NODE, as_number=64513),
            Peer(N1, PeerType.MESH, as_number=64513),
        ),
        pools=(POOL4,),
    )
    text = render(config)
    bird_accepts.append(text)
    assert section(text, "protocol bgp Global_10_0_0_254 from tabby_bgp4 {") == (
        "protocol bgp Global_10_0_0_254 from tabby_bgp4 {\n"
        '  description "tor";\n'
        "  neighbor 10.0.0.254 as 65000;\n"  # eBGP: another AS
        "}"
    )
    # explicit peers are never passive (the far end may be a router that waits too)
    assert section(text, "protocol bgp Node_10_0_0_3 from tabby_bgp4 {") == (
        "protocol bgp Node_10_0_0_3 from tabby_bgp4 {\n  neighbor 10.0.0.3 as 64513;\n}"
    )
    assert "  local as 64513;" in text.splitlines()
    # order: mesh, rr, global, node; then by address
    names = [line.split()[2] for line in text.splitlines() if line.startswith("protocol bgp ")]
    assert names == ["Mesh_10_0_0_1", "Global_10_0_0_254", "Node_10_0_0_3"]


def test_ipip_pools_route_through_tunl0_onlink(bird_accepts: list[str]) -> None:
    ipip = Pool(net("10.245.0.0/16"), ipip=True)
    text = render(dataclasses.replace(mesh(N1), pools=(POOL4, ipip)))
    bird_accepts.append(text)
    assert "define TABBY_IPIP_POOLS4 = [ 10.245.0.0/16+ ];" in text
    assert "define TABBY_POOLS4 = [ 10.244.0.0/16+, 10.245.0.0/16+ ];" in text
    assert section(text, "filter tabby_to_kernel4 {") == (
        "filter tabby_to_kernel4 {\n"
        '  if proto = "tabby_blocks4" then accept;\n'
        "  if source != RTS_BGP then reject;\n"
        "  if net ~ TABBY_IPIP_POOLS4 then {\n"
        "    # IP-in-IP pool: via the peer's underlay address, through tunl0.\n"
        "    ip tabby_nexthop = gw;\n"
        '    ifname = "tunl0";\n'
        "    onlink = true;\n"
        "    gw = tabby_nexthop;\n"
        "  }\n"
        "  accept;\n"
        "}"
    )
    assert "tunl0" not in render(mesh(N1))
    with pytest.raises(ValueError, match="IPv4 only"):
        Pool(net("fd10::/48"), ipip=True)


def test_dual_stack_renders_ipv6_sessions_blocks_and_kernel(bird_accepts: list[str]) -> None:
    config = BirdConfig(
        node=BirdNode("a", N1, V6_1),
        peers=(
            Peer(N2, PeerType.MESH),
            Peer(V6_2, PeerType.MESH),
            Peer(V6_3, PeerType.MESH),
        ),
        pools=(POOL4, POOL6),
        blocks=(net("10.244.1.0/26"), net("fd10::1:0/122")),
        borrowed=(ip("fd10::2:5"),),
    )
    text = render(config)
    bird_accepts.append(text)
    assert section(text, "protocol bgp Mesh_fd00__2 from tabby_bgp6 {") == (
        "protocol bgp Mesh_fd00__2 from tabby_bgp6 {\n"
        "  neighbor fd00::2 as 64512;\n"
        "  passive on;\n"
        "}"
    )
    assert "  source address fd00::1;" in section(text, "template bgp tabby_bgp6 {")
    assert "  route fd10::1:0/122 blackhole;" in section(text, "protocol static tabby_blocks6 {")
    assert "  route fd10::2:5/128 blackhole;" in section(text, "protocol static tabby_borrowed6 {")
    assert "    export filter tabby_to_kernel6;" in section(text, "protocol kernel tabby_kernel6 {")
    assert "define TABBY_POOLS6 = [ fd10::/48+ ];" in text
    assert "  ipv6;" in section(text, "protocol direct tabby_direct {")

    # Without an IPv6 underlay address: no IPv6 half at all (its blocks cannot be announced).
    v4_only = BirdConfig(
        node=node(N1),
        peers=(Peer(N2, PeerType.MESH),),
        pools=(POOL4, POOL6),
        blocks=(net("10.244.1.0/26"), net("fd10::1:0/122")),
    )
    v4_text = render(v4_only)
    bird_accepts.append(v4_text)
    assert "ipv6" not in v4_text
    assert "fd10" not in v4_text
    with pytest.raises(ValueError, match="no IPv6 underlay"):
        BirdConfig(node=node(N1), peers=(Peer(V6_2, PeerType.MESH),))


def test_same_inputs_render_byte_identical_text_in_any_order() -> None:
    peers = [
        Peer(N3, PeerType.MESH),
        Peer(ip("10.0.0.9"), PeerType.GLOBAL, as_number=65000),
        Peer(V6_2, PeerType.MESH),
        Peer(N2, PeerType.MESH),
    ]
    blocks = [net("10.244.1.0/26"), net("fd10::1:0/122"), net("10.244.7.0/26")]
    borrowed = [ip("10.244.2.5"), ip("fd10::2:5"), ip("10.244.2.4")]
    pools = [POOL6, POOL4, Pool(net("10.245.0.0/16"), ipip=True)]

    def build(seed: int) -> BirdConfig:
        rnd = random.Random(seed)
        return BirdConfig(
            node=BirdNode("a", N1, V6_1),
            peers=tuple(rnd.sample(peers, len(peers))),
            pools=tuple(rnd.sample(pools, len(pools))),
            blocks=tuple(rnd.sample(blocks, len(blocks)) + blocks[:1]),  # a duplicate too
            borrowed=tuple(rnd.sample(borrowed, len(borrowed))),
        )

    configs = [build(seed) for seed in range(8)]
    texts = {render(c) for c in configs}
    assert len(texts) == 1
    assert all(c == configs[0] for c in configs)
    text = texts.pop()
    assert text == render(configs[0])
    assert text.endswith("}\n")
    assert "\n\n\n" not in text
    assert text.index("route 10.244.1.0/26") < text.index("route 10.244.7.0/26")
    assert text.index("route 10.244.2.4/32") < text.index("route 10.244.2.5/32")


@pytest.mark.parametrize("severity", ["debug", "info", "warning", "error"])
def test_log_severity(severity: str, bird_accepts: list[str]) -> None:
    text = render(mesh(N1, log_severity=severity))
    bird_accepts.append(text)
    log_line = next(line for line in text.splitlines() if line.startswith("log "))
    assert log_line.startswith("log stderr ")
    assert ("info" in log_line or log_line == "log stderr all;") == (severity in ("debug", "info"))
    with pytest.raises(ValueError, match="log_severity"):
        mesh(N1, log_severity="loud")


def test_empty_config_is_valid(bird_accepts: list[str]) -> None:
    """A node alone (no peers, no pools, no blocks yet) still runs a valid BIRD."""
    text = render(BirdConfig(node=node(N1)))
    bird_accepts.append(text)
    assert "protocol bgp" not in text
    assert section(text, "filter tabby_import4 {") == "filter tabby_import4 {\n  reject;\n}"


def test_protocol_names_round_trip() -> None:
    for kind in PeerType:
        for addr in (N1, ip("192.168.100.254"), V6_2, ip("2001:db8:0:1::a:b"), ip("fd00::")):
            name = protocol_name(Peer(addr, kind))
            assert name.replace("_", "").isalnum()
            assert name[0].isalpha()
            assert len(name) <= 64
            assert parse_protocol_name(name) == (kind, addr)
    for other in ("tabby_kernel4", "tabby_device", "Mesh", "Mesh_", "Mesh_x_y", "Foo_10_0_0_1"):
        assert parse_protocol_name(other) is None


@pytest.mark.parametrize(
    ("build", "message"),
    [
        (lambda: BirdConfig(node=node(N1), peers=(Peer(N1, PeerType.MESH),)), "own address"),
        (
            lambda: BirdConfig(
                node=node(N1), peers=(Peer(N2, PeerType.MESH), Peer(N2, PeerType.GLOBAL))
            ),
            "given twice",
        ),
        (
            lambda: BirdConfig(node=node(N1), peers=(Peer(N2, PeerType.RR, rr_client=True),)),
            "rr_cluster_id",
        ),
        (
            lambda: BirdConfig(
                node=node(N1, rr_cluster_id=V4("1.1.1.1")),
                peers=(Peer(N2, PeerType.RR, as_number=65000, rr_client=True),),
            ),
            "iBGP",
        ),
        (lambda: Peer(N2, PeerType.MESH, as_number=0), "AS number"),
        (lambda: Peer(ip("0.0.0.0"), PeerType.MESH), "usable"),
        (lambda: BirdNode('a"b', N1), "quotes"),
        (lambda: BirdNode("a", N1, V6("fe80::1")), "global"),
        (
            lambda: BirdConfig(
                node=node(N1),
                pools=(Pool(net("10.0.0.0/8")), Pool(net("10.0.0.0/8"), ipip=True)),
            ),
            "different modes",
        ),
    ],
)
def test_inputs_are_checked(build: object, message: str) -> None:
    assert callable(build)
    with pytest.raises((ValueError, TypeError), match=message):
        build()


def test_peer_given_twice_identically_is_one_session() -> None:
    config = BirdConfig(node=node(N1), peers=(Peer(N2, PeerType.MESH), Peer(N2, PeerType.MESH)))
    assert len(config.peers) == 1


def test_check_config_reports_birds_message(tmp_path: Path) -> None:
    if BIRD is None:
        pytest.skip("bird (BIRD 2) is not installed")
    path = tmp_path / "bad.conf"
    path.write_text(render(BirdConfig(node=node(N1))) + "protocol bgp {\n")
    with pytest.raises(BirdConfigError) as info:
        check_config(str(path), BIRD)
    assert str(path) in info.value.message
    assert "error" in info.value.message.lower()


@pytest.mark.parametrize(
    "name", ["n\udcffode", "a\tb", "a\x85b", "a\u2028b", "a\\b", 'a"b', "a\rb"]
)
def test_names_that_are_not_printable_text_are_refused(name: str) -> None:
    """Found by fuzzing (tests/fuzz/bird_render.py): a lone surrogate (an undecodable
    byte of a name read from outside) passed the model and failed only when the supervisor
    wrote the file (UnicodeEncodeError); other line ends and controls passed too. A name is
    printable text without quotes or backslashes."""
    with pytest.raises(ValueError, match="not printable"):
        BirdNode(name, ipaddress.IPv4Address("10.0.0.1"))
    with pytest.raises(ValueError, match="not printable"):
        Peer(ipaddress.IPv4Address("10.0.0.2"), PeerType.MESH, name=name)
