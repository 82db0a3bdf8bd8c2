"""Result conversion between the canonical 1.1.0 shape and every version (CHN-1, CHN-2, ADD-3
of cni_protocol/CONFORMANCE.md)."""

from __future__ import annotations

import copy
from typing import Any

import pytest

from cni_protocol import types
from cni_protocol.errors import CniError
from tests.conftest import ALL_SPEC_VERSIONS

CANON: dict[str, Any] = {
    "interfaces": [
        {"name": "cali0123456789a", "mac": "ee:ee:ee:ee:ee:ee", "mtu": 1500},
        {"name": "eth0", "mac": "02:00:00:00:00:01", "sandbox": "/run/netns/p", "mtu": 1500},
    ],
    "ips": [
        {"address": "10.244.0.5/32", "gateway": "169.254.1.1", "interface": 1},
        {"address": "fd00:10:244::5/128", "gateway": "fe80::ecee:eeff:feee:eeee", "interface": 1},
    ],
    "routes": [
        {"dst": "169.254.1.1/32", "scope": 253},
        {"dst": "0.0.0.0/0", "gw": "169.254.1.1"},
        {"dst": "::/0", "gw": "fe80::ecee:eeff:feee:eeee"},
    ],
    "dns": {"nameservers": ["10.96.0.10"]},
}


@pytest.mark.parametrize("version", ALL_SPEC_VERSIONS)
def test_render_shape_per_version(version: str) -> None:
    """CONFORMANCE.md "Versions" / ADD-3: version field only before 1.0.0; 1.1.0 fields only
    at 1.1.0."""
    out = types.render(copy.deepcopy(CANON), version)
    assert out["cniVersion"] == version
    legacy = version in ("0.3.0", "0.3.1", "0.4.0")
    for ip in out["ips"]:
        if legacy:
            assert ip["version"] == ("6" if ":" in ip["address"] else "4")
        else:
            assert "version" not in ip
    has11 = version == "1.1.0"
    assert ("mtu" in out["interfaces"][0]) is has11
    assert ("scope" in out["routes"][0]) is has11
    assert out["dns"] == CANON["dns"]


@pytest.mark.parametrize("version", ALL_SPEC_VERSIONS)
def test_round_trip_keeps_addresses_gateways_routes(version: str) -> None:
    """CHN-2: going to a version and back keeps addresses, gateways and routes."""
    back = types.canonical(types.render(copy.deepcopy(CANON), version), version)
    assert [(i["address"], i["gateway"], i["interface"]) for i in back["ips"]] == [
        (i["address"], i["gateway"], i["interface"]) for i in CANON["ips"]
    ]
    assert [(r["dst"], r.get("gw")) for r in back["routes"]] == [
        (r["dst"], r.get("gw")) for r in CANON["routes"]
    ]
    assert all("version" not in ip for ip in back["ips"])


def test_legacy_version_field_must_match_family() -> None:
    bad = {"ips": [{"address": "10.0.0.1/32", "version": "6"}]}
    with pytest.raises(CniError) as e:
        types.canonical(bad, "0.4.0")
    assert e.value.code == 6


@pytest.mark.parametrize(
    "bad",
    [
        {"ips": [{"address": "10.0.0.1"}]},
        {"ips": [{"address": "nope/32"}]},
        {"ips": [{"address": "10.0.0.1/32", "interface": 3}]},
        {"ips": [{"address": "10.0.0.1/32", "gateway": "x"}]},
        {"routes": [{"dst": "0.0.0.0/0", "gw": "bad"}]},
        {"ips": "x"},
        [],
    ],
)
def test_malformed_results_are_decode_errors(bad: Any) -> None:
    with pytest.raises(CniError) as e:
        types.canonical(bad, "1.0.0")
    assert e.value.code == 6


def test_unknown_keys_pass_through() -> None:
    """ADD-4: a chained result keeps what we do not understand."""
    out = types.canonical({"ips": [], "x-extra": 1}, "1.0.0")
    assert out["x-extra"] == 1
    assert types.render(out, "1.0.0")["x-extra"] == 1


def test_prev_result_uses_its_own_version_or_the_configs() -> None:
    """CHN-1."""
    conf = {"prevResult": {"ips": [{"address": "10.0.0.1/32", "version": "4"}]}}
    assert types.prev_result(conf, "0.4.0") == {"ips": [{"address": "10.0.0.1/32"}]}
    conf2 = {
        "prevResult": {"cniVersion": "0.4.0", "ips": [{"address": "10.0.0.1/32", "version": "4"}]}
    }
    assert types.prev_result(conf2, "1.0.0") == {"ips": [{"address": "10.0.0.1/32"}]}
    assert types.prev_result({}, "1.0.0") is None
    assert types.prev_result({"prevResult": {}}, "1.0.0") is None
