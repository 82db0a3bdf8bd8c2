"""BIRD's configuration rendered from names others choose: the node's name (a comment) and
each peer's (the BGPPeer's or the peer node's name: a protocol's ``description``). tabby's
BIRD model has no passwords or communities; every other rendered value is an address, a
network or a number, typed before it gets here.

Property: for any name, the model refuses it (``ValueError``, what tabby-node logs and
skips a peer for) or the rendered text, read as BIRD's lexer reads it (:func:`tokens`),
has exactly the structure of the text rendered with a benign name: the name stays inside
its comment or its string. ``bird -p`` parses such texts (the privileged tier:
tests/privileged/test_fuzz_rendered.py).

Input bytes (atheris): the node's name, NUL, the peer's name (UTF-8 with surrogateescape:
what a name read from outside may hold).
"""

from __future__ import annotations

import ipaddress
import re

from hypothesis import strategies as st

from bird import BirdConfig, BirdNode, Peer, PeerType, render
from tests.fuzz import hostile

BENIGN = "name"

#: BIRD 2's lexer, as far as structure goes: a string is "..." without a newline; a
#: comment runs from # to the end of the line, or from /* to */; else words and symbols.
_TOKEN = re.compile(r'"[^"\n]*"|#[^\n]*|/\*.*?\*/|[A-Za-z0-9_.:/+-]+|\S', re.DOTALL)


def tokens(text: str) -> list[str]:
    """The text's tokens, each string and comment as a placeholder (its content is what
    may differ)."""
    out = []
    for tok in _TOKEN.findall(text):
        if tok.startswith('"'):
            out.append('"…"')
        elif tok.startswith(("#", "/*")):
            out.append("#…")
        else:
            out.append(tok)
    return out


def config(node_name: str, peer_name: str) -> BirdConfig:
    node = BirdNode(
        node_name,
        ipaddress.IPv4Address("192.168.1.1"),
        ipaddress.IPv6Address("fd00::1"),
        rr_cluster_id=ipaddress.IPv4Address("1.0.0.1"),
    )
    peers = (
        Peer(ipaddress.ip_address("192.168.1.2"), PeerType.MESH, name=peer_name),
        Peer(ipaddress.ip_address("fd00::2"), PeerType.RR, rr_client=True, name=peer_name),
        Peer(ipaddress.ip_address("10.9.9.9"), PeerType.GLOBAL, 65001, name=peer_name),
    )
    return BirdConfig(node=node, peers=peers)


_BENIGN_TOKENS: dict[bool, list[str]] = {}


def check_names(node_name: str, peer_name: str) -> str | None:
    """The rendered text, or None when the model refused a name."""
    try:
        text = render(config(node_name, peer_name))
    except ValueError:
        return None
    named = bool(peer_name)  # an empty name has no description
    if named not in _BENIGN_TOKENS:
        _BENIGN_TOKENS[named] = tokens(render(config(BENIGN, BENIGN if named else "")))
    text.encode("utf-8")  # what the supervisor writes; a lone surrogate would fail there
    assert tokens(text) == _BENIGN_TOKENS[named], (node_name, peer_name)
    return text


def fuzz_one(data: bytes) -> None:
    node, _, peer = data.decode("utf-8", "surrogateescape").partition("\0")
    check_names(node or BENIGN, peer)


names = st.one_of(
    hostile.texts, st.sampled_from(['x"; } protocol static evil { ', "a */ b", "a\u2028b"])
)


if __name__ == "__main__":
    from tests.fuzz.runner import main

    main(fuzz_one, ["bird"])
