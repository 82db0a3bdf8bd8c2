"""The configuration as DEL and GC read it (cni_config/teardown.py): every invalid field is
dropped to its default and listed, never a structural problem or GC's own input, and what
teardown derives from a dropped field is unknown rather than the default's (CONFORMANCE.md
DEL-9; docs/configuration.md "What DEL does with an invalid field").

The field tables (test_fields.py) run every documented bad value through both
binaries; this file pins the rule itself: which problems are dropped, the rules over several
fields, and which store and node a teardown may use.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import pytest

from cni_config.common import DatastoreSettings, RuleBroken, parse
from cni_config.teardown import Dropped, Teardown, Unknown, parse_for_teardown
from cni_plugin.config import PluginConf
from cni_protocol.errors import CniError
from ipam.config import IpamPluginConf


def plugin_conf(**top: Any) -> dict[str, Any]:
    ipam = {"type": "tabby-ipam", **top.pop("ipam", {})}
    return {"cniVersion": "1.1.0", "name": "net1", "nodename": "node-a", "ipam": ipam, **top}


def paths(read: Teardown[Any]) -> list[str]:
    return sorted(d.path for d in read.dropped)


def test_a_valid_configuration_drops_nothing() -> None:
    config = plugin_conf(mtu=1400, veth_prefix="tab", ipam={"data_dir": "/srv/ipam"})
    read = parse_for_teardown(PluginConf, config)
    assert read.dropped == ()
    assert read.conf == parse(PluginConf, config)


def test_each_invalid_field_is_dropped_to_its_default_and_listed() -> None:
    config = plugin_conf(
        mtu=65536,
        log_level="verbose",
        container_settings={"allow_ip_forwarding": "maybe"},
        ipam={"lock_timeout_seconds": 0},
    )
    with pytest.raises(CniError) as strict:
        parse(PluginConf, config)
    assert strict.value.code == 2
    read = parse_for_teardown(PluginConf, config)
    assert paths(read) == [
        "container_settings.allow_ip_forwarding",
        "ipam.lock_timeout_seconds",
        "log_level",
        "mtu",
    ]
    assert (read.conf.mtu, read.conf.log_level, read.conf.allow_ip_forwarding) == (
        1500,
        "info",
        False,
    )
    assert read.conf.ipam.lock_timeout_seconds == 30
    mtu = next(d for d in read.dropped if d.path == "mtu")
    assert mtu == Dropped("mtu", 65536, "expected 0 (auto) or an integer from 68 to 65535")
    assert str(mtu) == "mtu=65536 (expected 0 (auto) or an integer from 68 to 65535)"


def test_a_value_deep_in_a_list_drops_the_whole_field() -> None:
    read = parse_for_teardown(IpamPluginConf, plugin_conf(ipam={"ipv4_pools": ["10.99.0.0/33"]}))
    assert paths(read) == ["ipam.ipv4_pools"]
    assert read.conf.ipam.ipv4_pools == ["10.244.0.0/16"]


def test_the_input_is_not_modified() -> None:
    config = plugin_conf(mtu=65536)
    parse_for_teardown(PluginConf, config)
    assert config["mtu"] == 65536


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"container_settings": "yes"}, "container_settings must be an object"),
        ({"ipam": {"type": "../x"}}, "invalid ipam.type"),
        ({"ipam": {"type": ""}}, "invalid ipam.type"),
    ],
)
def test_a_structural_problem_fails_as_in_a_strict_parse(
    change: dict[str, Any], message: str
) -> None:
    config = {**plugin_conf(), **change}
    with pytest.raises(CniError) as strict:
        parse(PluginConf, config)
    with pytest.raises(CniError) as tolerant:
        parse_for_teardown(PluginConf, config)
    assert (tolerant.value.code, tolerant.value.msg) == (7, strict.value.msg)
    assert message in tolerant.value.msg


def test_a_structural_problem_wins_over_dropped_fields() -> None:
    config = {"cniVersion": "1.1.0", "name": "net1", "mtu": 65536}
    with pytest.raises(CniError) as e:
        parse_for_teardown(PluginConf, config)
    assert e.value.code == 7
    for model in (IpamPluginConf, PluginConf):
        with pytest.raises(CniError) as e:
            parse_for_teardown(model, {**plugin_conf(mtu=65536), "ipam": []})
        assert e.value.code == 7


@pytest.mark.parametrize(
    "attachments",
    [[{"containerID": 5, "ifname": "eth0"}], [{"containerID": "", "ifname": "eth0"}], "c1"],
)
@pytest.mark.parametrize("key", ["cni.dev/valid-attachments", "cni.dev/attachments"])
def test_gc_valid_attachments_are_never_dropped(key: str, attachments: Any) -> None:
    """What GC keeps is the call's own input: dropped, it would read as "no information"
    and hide the runtime's bug."""
    with pytest.raises(CniError) as e:
        parse_for_teardown(PluginConf, plugin_conf(**{key: attachments}))
    assert e.value.code == 2


@pytest.mark.parametrize(
    ("ipam", "dropped"),
    [
        ({"ipv4_pools": []}, ["ipam.ipv4_pools"]),
        ({"assign_ipv4": True, "ipv4_pools": []}, ["ipam.assign_ipv4", "ipam.ipv4_pools"]),
        ({"assign_ipv4": False, "assign_ipv6": False}, ["ipam.assign_ipv4", "ipam.assign_ipv6"]),
        ({"assign_ipv6": True, "ipv6_pools": []}, ["ipam.assign_ipv6", "ipam.ipv6_pools"]),
        ({"etcd_cert_file": "/etc/tabby/cert.pem"}, ["ipam.etcd_cert_file"]),
        # a field error first; the rule is checked once the fields are valid, then dropped too
        ({"block_size_ipv4": 40, "ipv4_pools": []}, ["ipam.block_size_ipv4", "ipam.ipv4_pools"]),
    ],
)
def test_a_broken_rule_drops_the_fields_it_reads(ipam: dict[str, Any], dropped: list[str]) -> None:
    read = parse_for_teardown(IpamPluginConf, plugin_conf(ipam=ipam))
    assert paths(read) == dropped
    assert read.conf.ipam == parse(IpamPluginConf, plugin_conf()).ipam


def test_every_rule_over_several_fields_names_them() -> None:
    """A rule that raised a plain ValueError could not be dropped: each names its fields."""
    for config in (
        {"etcd_key_file": "/k.pem"},
        {"assign_ipv4": False},
    ):
        try:
            IpamPluginConf.model_validate(plugin_conf(ipam=config))
        except Exception as e:
            broken = e.errors()[0]["ctx"]["error"]  # type: ignore[attr-defined]
            assert isinstance(broken, RuleBroken)
            assert set(broken.fields) >= set(config)
        else:  # pragma: no cover
            pytest.fail(f"{config} accepted")


# -- what teardown derives from a dropped field -----------------------------------------------


@pytest.mark.parametrize(
    ("ipam", "known"),
    [
        ({"data_dir": "relative"}, False),
        ({"datastore_type": "zk"}, False),
        ({"datastore_type": "FILE"}, False),
        ({"etcd_prefix": "tabby"}, True),  # the file store does not use it
        ({"etcd_endpoints": ["127.0.0.1:2379"]}, True),
        ({"etcd_cert_file": "/c.pem"}, True),
        ({"lock_timeout_seconds": -1}, True),  # how long to wait, not which store
        ({"datastore_type": "etcdv3", "etcd_prefix": "tabby"}, False),
        ({"datastore_type": "etcdv3", "etcd_endpoints": ["127.0.0.1:2379"]}, False),
        ({"datastore_type": "etcdv3", "etcd_ca_cert_file": "ca.pem"}, False),
        ({"datastore_type": "etcdv3", "etcd_key_file": "/k.pem"}, False),
        ({"datastore_type": "etcdv3", "data_dir": "relative"}, True),
        ({"datastore_type": "etcdv3", "lock_timeout_seconds": 0}, True),
    ],
)
@pytest.mark.parametrize("model", [PluginConf, IpamPluginConf])
def test_the_store_is_the_one_named_or_none(
    model: type[PluginConf] | type[IpamPluginConf], ipam: dict[str, Any], known: bool
) -> None:
    """Never the default store in place of an invalid one: a release there would be a
    release from a store the configuration does not name."""
    read = parse_for_teardown(model, plugin_conf(ipam=ipam))
    assert read.dropped
    if known:
        store = read.store(read.conf.ipam)
        assert store.datastore_type == ipam.get("datastore_type", "file")
    else:
        with pytest.raises(Unknown) as e:
            read.store(read.conf.ipam)
        assert "ipam." in str(e.value)


def test_store_location_fields_follow_the_type() -> None:
    assert DatastoreSettings().location_fields() == ("datastore_type", "data_dir")
    etcd = DatastoreSettings(datastore_type="etcdv3").location_fields()
    assert "data_dir" not in etcd
    assert {"etcd_endpoints", "etcd_prefix"} <= set(etcd)
    assert "lock_timeout_seconds" not in etcd


def test_the_node_is_the_one_named_or_none(tmp_path: Path) -> None:
    good_file = tmp_path / "nodename"
    good_file.write_text("node-b\n")
    garbage = tmp_path / "garbage"
    garbage.write_text("not a node name!\n")

    def node(**top: Any) -> str:
        config = {k: v for k, v in plugin_conf(**top).items() if v is not None}
        read = parse_for_teardown(IpamPluginConf, config)
        return read.node_name(read.conf)

    assert node(nodename_file="relative") == "node-a"  # nodename given: the file is unused
    assert node(nodename=None, nodename_file=str(good_file)) == "node-b"
    for bad in (
        {"nodename": "node:a"},
        {"nodename": "node:a", "nodename_file": str(good_file)},
        {"nodename": None, "nodename_file": "relative"},
        {"nodename": None, "nodename_file": str(garbage)},
    ):
        with pytest.raises(Unknown):
            node(**bad)


def test_need_names_the_dropped_field() -> None:
    read = parse_for_teardown(PluginConf, plugin_conf(veth_prefix="1ab", mtu=0))
    read.need("mtu")
    with pytest.raises(Unknown) as e:
        read.need("veth_prefix", "mtu")
    assert str(e.value).startswith("invalid veth_prefix='1ab'")


def test_warn_logs_one_warning_per_dropped_field(caplog: pytest.LogCaptureFixture) -> None:
    read = parse_for_teardown(PluginConf, plugin_conf(mtu=65536, log_level="verbose"))
    logger = logging.getLogger("test.teardown")
    with caplog.at_level(logging.WARNING, logger="test.teardown"):
        read.warn(logger, "DEL")
    assert [r.levelno for r in caplog.records] == [logging.WARNING] * 2
    assert any("DEL ignores invalid mtu=65536" in r.getMessage() for r in caplog.records)
