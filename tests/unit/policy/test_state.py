"""PolicyDataplane (``policy.state``) and the nft text it has sent (``policy.render``), with
a recording backend (no kernel, no root).

The kernel tier (tests/privileged/test_policy_nft.py) proves the text does what it should;
this proves which transactions are sent when: full replacement first, differences after,
nothing for an unchanged state, a full replacement when a difference is refused.
"""

from __future__ import annotations

import pytest

from dataplane.errors import NftError
from policy.engine import Endpoint, IRRule, NatConfig, PolicyChain
from policy.render import Renderer
from policy.state import PolicyDataplane
from tests import policy_truth_table as tt


class Recorder:
    name = "recorder"

    def __init__(self) -> None:
        self.sent: list[str] = []
        self.fail_next = 0

    def run(self, text: str) -> str:
        if self.fail_next:
            self.fail_next -= 1
            raise NftError("Error: No such file or directory")
        self.sent.append(text)
        return ""


def _dp() -> tuple[PolicyDataplane, Recorder]:
    rec = Recorder()
    dp = PolicyDataplane("node1", backend=rec, families=(4,), counter_reader=lambda t, names: [])
    return dp, rec


def test_first_sync_replaces_the_table_atomically_then_differences() -> None:
    dp, rec = _dp()
    st = tt.build_state(tt.CASES[2].steps[0])  # 3: x/a from x/b
    res = dp.sync(st)
    assert res.full
    lines = rec.sent[0].splitlines()
    assert lines[:3] == ["add table inet tabby", "delete table inet tabby", "add table inet tabby"]
    assert len(rec.sent) == 1
    assert not dp.sync(st).changed
    assert len(rec.sent) == 1  # nothing sent for an unchanged state
    # a pod elsewhere joins the selector: set elements only
    ep = Endpoint("x", "b2", "node2", "calib2", ("10.244.1.200",), "b2-eth0", (("pod", "b"),))
    res = dp.add_endpoint(ep)
    assert not res.full
    assert rec.sent[-1].strip().startswith("add element inet tabby a4-")
    assert "chain" not in rec.sent[-1]
    assert "10.244.1.200" in rec.sent[-1]
    dp.remove_endpoint("x", "b2-eth0")
    assert rec.sent[-1].strip().startswith("delete element inet tabby a4-")
    c = dp.counters
    assert (c.endpoints, c.policies, c.applies, c.full_applies) == (9, 1, 3, 1)
    assert c.backend == "recorder"


def test_a_local_pod_gets_its_chains_and_map_entries_in_one_transaction() -> None:
    dp, rec = _dp()
    dp.sync(tt.build_state(tt.Step((tt.DENY_INGRESS,), tt.everything)))
    ep = Endpoint("x", "new", "node1", "calinew", ("10.244.1.201",), "new-eth0")
    dp.add_endpoint(ep)
    text = rec.sent[-1]
    assert "add chain inet tabby to-calinew" in text
    assert "add chain inet tabby from-calinew" in text
    assert 'add element inet tabby wl-to { "calinew" : jump to-calinew }' in text
    assert "add rule inet tabby to-calinew jump pi-" in text
    # chains are created before the map entries that jump to them
    assert text.index("add chain inet tabby to-calinew") < text.index("wl-to")
    dp.remove_endpoint("x", "new-eth0")
    text = rec.sent[-1]
    assert text.index('delete element inet tabby wl-to { "calinew" }') < text.index(
        "delete chain inet tabby to-calinew"
    )


def test_a_changed_policy_flushes_and_refills_only_its_chain() -> None:
    dp, rec = _dp()
    dp.sync(tt.build_state(tt.CASES[14].steps[0]))  # 15: one policy
    dp.sync(tt.build_state(tt.CASES[14].steps[1]))  # 15: a second one
    text = rec.sent[-1]
    assert "flush chain inet tabby to-calixa" in text
    assert "add chain inet tabby pi-" in text
    assert 'meta l4proto tcp th dport 80 counter name "pkt-pi-' in text
    assert "table" not in text.split("inet tabby")[0]


def test_a_refused_difference_falls_back_to_a_full_replacement() -> None:
    dp, rec = _dp()
    dp.sync(tt.build_state(tt.Step((), tt.everything)))
    rec.fail_next = 1
    res = dp.sync(tt.build_state(tt.Step((tt.DENY_ALL,), tt.everything)))
    assert res.full
    assert rec.sent[-1].startswith("add table inet tabby\ndelete table")
    assert dp.counters.apply_errors == 1
    rec.fail_next = 2
    with pytest.raises(NftError):
        dp.sync(tt.build_state(tt.Step((), tt.everything)))
    assert dp.counters.apply_errors == 3


def test_endpoint_calls_need_a_first_sync() -> None:
    dp, _ = _dp()
    with pytest.raises(RuntimeError, match="first sync"):
        dp.add_endpoint(Endpoint("x", "a", "node1", "calia", ("10.0.0.1",)))
    with pytest.raises(RuntimeError, match="first sync"):
        dp.remove_endpoint("x", "a")
    with pytest.raises(RuntimeError, match="no state"):
        dp.explain(("x", "a"), ("x", "b"))


def test_rule_text() -> None:
    r = Renderer(visibility=False)
    ing = PolicyChain("pi-1", "x/p", "ingress", ())
    egr = PolicyChain("pe-1", "x/p", "egress", ())
    assert r.rule(ing, IRRule(4, "a4-s", "tcp", ((80, 80), (90, 99)), None, "c")) == (
        "add rule inet tabby pi-1 ip saddr @a4-s meta l4proto tcp"
        ' th dport { 80, 90-99 } accept comment "c"'
    )
    assert r.rule(egr, IRRule(6, "a6-s", "udp", (), "n6-dns", "c")) == (
        "add rule inet tabby pe-1 ip6 daddr @a6-s meta l4proto udp"
        ' ip6 daddr . meta l4proto . th dport @n6-dns accept comment "c"'
    )
    assert r.rule(egr, IRRule(None, None, "sctp", (), None, 'a"b')) == (
        'add rule inet tabby pe-1 meta l4proto sctp accept comment "a_b"'
    )
    with pytest.raises(ValueError, match="prefix"):
        Renderer(prefix="ca li")
    with pytest.raises(ValueError, match="table"):
        Renderer(table="a b")


def test_nat_switch_replaces_and_pool_changes_are_elements() -> None:
    dp, rec = _dp()
    st = tt.build_state(tt.Step((), tt.everything))
    dp.sync(st)
    dp.sync(st, NatConfig((("10.244.0.0/16", True),)))
    assert rec.sent[-1].startswith("add table")  # NAT switched on: full
    assert "masquerade" in rec.sent[-1]
    dp.sync(st, NatConfig((("10.244.0.0/16", True), ("10.9.0.0/16", False))))
    assert rec.sent[-1].strip() == "add element inet tabby pools4 { 10.9.0.0/16 }"


# -- found by fuzzing (tests/fuzz/nft_render.py) -------------------------------------------


@pytest.mark.parametrize(
    "text",
    ["x/" + "p" * 253 + " ingress[0]", "é" * 100 + ": no egress policy", 'a"b\\c\n' * 40],
)
def test_comments_fit_nft_s_limit_and_keep_their_end(text: str) -> None:
    """nft refuses a comment over 128 bytes ("comment too long") and with it the whole
    transaction: a NetworkPolicy named with 253 characters (a valid name) left every
    node without its policy table. A long comment keeps its start and its end."""
    from policy.render import MAX_COMMENT, comment_text

    got = comment_text(text)
    assert len(got.encode()) <= MAX_COMMENT
    assert got.endswith(text[-10:].replace('"', "_").replace("\\", "_").replace("\n", "_"))
    assert '"' not in got
    assert "\\" not in got
    assert got.isprintable()
    assert comment_text("x/web ingress[0]") == "x/web ingress[0]"
