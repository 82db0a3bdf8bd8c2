"""The nftables ruleset rendered from names and labels others choose: a NetworkPolicy's
name, namespace, selectors and port names, the labels and named ports of Pods, the names
and host interfaces of WorkloadEndpoints, each as the datastore holds it.

Property: with one such string replaced by a hostile one, the full ruleset
(``policy.render``) is well-formed: every line is one ``add``/``delete`` command; outside
its quoted strings the text holds only nft's words and symbols (no ``#``, quote or control:
nothing starts a comment or opens a string); a quoted string holds no quote; a comment fits
nft's limit of 128 bytes (a longer one fails the whole transaction, and with it the node's
policy). And either the document is refused (the index skips it, as tabby-node does) or the
value changes nothing but the ruleset's quoted strings and hash-made names: the skeleton is
that of the ruleset with a plain placeholder in the same slot. ``nft -c`` accepts such
rulesets (the privileged tier: tests/privileged/test_fuzz_rendered.py).

Input bytes (atheris): the first byte picks the slot (:data:`SLOTS`), the rest is the
string (UTF-8 with surrogateescape).
"""

from __future__ import annotations

import copy
import re

from hypothesis import strategies as st

from datastore.base import Doc
from policy import engine, inputs
from policy.render import Renderer, Snapshot
from resources.index import POLICY, POOLS, Index
from tests.fuzz import hostile, silenced
from tests.policy_truth_table import peer, pol, rule, sel, tcp
from tests.unit.policy.world import NODE, PolicyWorld

#: nft's longest comment (NFTNL_UDATA_COMMENT_MAXLEN), in bytes; stated here, not taken
#: from policy.render, so that the property does not trust what it checks.
MAX_COMMENT = 128
#: A policy naming a port by name, allowing pods by label, from a namespace by label.
POLICY_UNDER_TEST = pol(
    "web-from-b",
    sel(pod="a"),
    ingress=(rule(peer(sel(pod="b"), sel(ns="x")), ports=(tcp("serve-80-tcp"), tcp(81))),),
)
KEY = POLICY_UNDER_TEST.key

#: (kind, key, path): the strings others choose, where the datastore holds them.
SLOTS: tuple[tuple[str, str, tuple[str | int, ...]], ...] = (
    ("networkpolicy", KEY, ("metadata", "name")),
    ("networkpolicy", KEY, ("metadata", "namespace")),
    ("networkpolicy", KEY, ("spec", "podSelector", "matchLabels", "pod")),
    ("networkpolicy", KEY, ("spec", "ingress", 0, "from", 0, "podSelector", "matchLabels", "pod")),
    ("networkpolicy", KEY, ("spec", "ingress", 0, "ports", 0, "port")),
    ("pod", "x/a", ("metadata", "labels", "pod")),
    ("pod", "x/b", ("metadata", "labels", "pod")),
    ("pod", "x/a", ("spec", "containers", 0, "ports", 0, "name")),
    ("pod", "x/a", ("spec", "containers", 0, "name")),
    ("namespace", "x", ("metadata", "labels", "ns")),
    ("workloadendpoint", "x/a-eth0", ("metadata", "name")),
    ("workloadendpoint", "x/a-eth0", ("spec", "hostInterface")),
    ("workloadendpoint", "x/a-eth0", ("spec", "pod")),
    ("workloadendpoint", "x/b-eth0", ("metadata", "labels", "pod")),
)

_STRING = re.compile(r'"[^"\n]*"')
#: What nft text holds outside its strings: words, numbers, addresses and nft's symbols;
#: never "#" (a comment), a quote (a string) or a control character.
_OUTSIDE = re.compile(r"^[A-Za-z0-9_./:@$*,;{}()=!<>&|^+ -]*$")
#: A value may show outside a string only when it is made of these (a name in a chain's,
#: a set's or a counter's name, an address, a port).
_PLAIN = re.compile(r"^[A-Za-z0-9_.-]*$")
_HASH = re.compile(r"\b[0-9a-f]{4,}\b")
#: A plain value no slot holds: what a hostile value's ruleset is compared with.
PLACEHOLDER = "zzfuzzplain"


def _world() -> dict[str, dict[str, Doc]]:
    return PolicyWorld([POLICY_UNDER_TEST]).docs


def ruleset(docs: dict[str, dict[str, Doc]]) -> tuple[str, bool]:
    """The full ruleset of the world's node, and whether every document was accepted."""
    index = Index((*POLICY, POOLS))
    with silenced():
        index.replace(docs)
    state, nat = inputs.PolicyInputs().convert(index.snapshot())
    text = Renderer().full(Snapshot(engine.compute(state, NODE, (4, 6)), nat))
    return text, not index._bad


def check_text(text: str) -> None:
    """The ruleset is well-formed (see the module's docstring)."""
    for line in text.splitlines():
        assert line.startswith(("add ", "delete ")), line
        for string in _STRING.findall(line):
            if f"comment {string}" in line:
                assert len(string[1:-1].encode()) <= MAX_COMMENT, ("comment too long", line)
        assert _OUTSIDE.match(_STRING.sub("STR", line)), line


def skeleton(text: str) -> list[str]:
    """The ruleset's commands with every quoted string and every hash-derived name part
    abstracted, sorted (the renderer orders objects by those names)."""
    return sorted(_HASH.sub("H", _STRING.sub("STR", line)) for line in text.splitlines())


def with_value(slot: int, value: str) -> dict[str, dict[str, Doc]]:
    docs = _world()
    kind, key, path = SLOTS[slot % len(SLOTS)]
    doc = docs[kind][key]
    data = copy.deepcopy(doc.data)
    holder: object = data
    for step in path[:-1]:
        holder = holder[step]  # type: ignore[index]
    holder[path[-1]] = value  # type: ignore[index]
    docs[kind][key] = Doc(data, doc.revision + 1000)
    return docs


def check_slot(slot: int, value: str) -> None:
    """The ruleset with ``value`` in ``slot`` is well-formed; a value that is not plain and
    was accepted changes nothing but quoted strings and names made of hashes: its
    ruleset's skeleton is the one with a plain placeholder in the slot."""
    text, accepted = ruleset(with_value(slot, value))
    check_text(text)
    if accepted and not _PLAIN.match(value):
        base, base_accepted = ruleset(with_value(slot, PLACEHOLDER))
        if base_accepted:
            assert skeleton(text) == skeleton(base), (SLOTS[slot % len(SLOTS)], value)


def fuzz_one(data: bytes) -> None:
    if data:
        check_slot(data[0], data[1:].decode("utf-8", "surrogateescape"))


slots = st.integers(0, len(SLOTS) - 1)
values = st.one_of(
    hostile.texts,
    st.sampled_from(["a" * 63, "x" * 253, "é" * 60, "a.b-c_d", "cali0000000000a", "eth0"]),
)


if __name__ == "__main__":
    from tests.fuzz.runner import main

    check_text(ruleset(_world())[0])  # the models and the engine, loaded
    main(fuzz_one, ["policy", "resources", "datastore"])
