"""Configurations already validated (cni_config.known): the values rebuilt without pydantic
are the models' values, only a valid configuration is ever kept, a kept one is read back
without importing pydantic, and anything doubtful sends the call to the models."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from pydantic import BaseModel

from cni_config import known
from cni_config.common import Attachment, CommonConf, DatastoreSettings
from cni_config.values import (
    AttachmentValues,
    CommonValues,
    DatastoreValues,
    Values,
)
from cni_plugin import plugin
from cni_plugin.config import ContainerSettings, IpamRef, PluginConf
from cni_plugin.values import ContainerSettingsValues, IpamRefValues, PluginValues
from cni_protocol import skel
from cni_protocol.errors import CniError
from ipam import plugin as ipam_plugin
from ipam.config import IpamConf, IpamPluginConf
from ipam.values import IpamPluginValues, IpamValues
from tests import REPO_ROOT as ROOT

PAIRS: list[tuple[type[BaseModel], type[Values]]] = [
    (Attachment, AttachmentValues),
    (DatastoreSettings, DatastoreValues),
    (CommonConf, CommonValues),
    (ContainerSettings, ContainerSettingsValues),
    (IpamRef, IpamRefValues),
    (PluginConf, PluginValues),
    (IpamConf, IpamValues),
    (IpamPluginConf, IpamPluginValues),
]


def declared(values: type[Values]) -> set[str]:
    """The fields a values class declares (its annotations and its bases')."""
    names: set[str] = set()
    for cls in values.__mro__:
        names |= set(vars(cls).get("__annotations__", {}))
    return names - {"NESTED"}


@pytest.mark.parametrize(("model", "values"), PAIRS, ids=[p[0].__name__ for p in PAIRS])
def test_values_declare_exactly_the_models_fields(
    model: type[BaseModel], values: type[Values]
) -> None:
    assert issubclass(model, values)
    assert declared(values) == set(model.model_fields)
    for name, info in model.model_fields.items():
        sub = info.annotation
        if isinstance(sub, type) and issubclass(sub, BaseModel):
            # a nested section is rebuilt as the values class its model inherits
            assert issubclass(sub, values.NESTED[name]), name
        else:
            assert name not in values.NESTED, name


RICH = {
    "cniVersion": "1.1.0",
    "name": "rich",
    "type": "tabby",
    "nodename": "node-a",
    "log_level": "DEBUG",
    "log_file_path": "/tmp/x/cni.log",
    "mtu": 0,
    "veth_prefix": "tb",
    "container_settings": {"allow_ip_forwarding": "true"},
    "capabilities": {"mac": True, "ips": True},
    "runtimeConfig": {"mac": "02:00:00:00:00:01", "ips": ["10.9.0.5/24"]},
    "args": {"cni": {"ips": ["10.9.0.6"]}},
    "prevResult": {"cniVersion": "1.1.0", "ips": []},
    "ipam": {
        "type": "tabby-ipam",
        "datastore_type": "etcdv3",
        "etcd_endpoints": "http://127.0.0.1:2379/, https://e2:2379",
        "etcd_prefix": "/x/",
        "etcd_cert_file": "/c",
        "etcd_key_file": "/k",
        "lock_timeout_seconds": 7,
        "assign_ipv6": "true",
        "ipv4_pools": [" 10.9.0.0/16"],
        "ipv6_pools": ["fd00:9::/48"],
        "block_size_ipv4": 28,
        "strict_affinity": True,
        "max_blocks_per_host": 4,
        "reserved": ["10.9.0.1", "10.9.0.0/30"],
        "gc_grace_seconds": 30,
    },
}


def configs() -> list[dict[str, Any]]:
    out = [RICH, {"cniVersion": "1.0.0", "name": "n", "type": "tabby", "ipam": {"type": "x"}}]
    for path in (ROOT / "conf-examples/10-tabby.conflist", ROOT / "bench/cni/conf/tabby.conflist"):
        doc = json.loads(path.read_text())
        for p in doc["plugins"]:
            if p["type"] == "tabby":
                out.append({"cniVersion": doc["cniVersion"], "name": doc["name"], **p})
    return out


def tree(obj: Any, values: type[Values]) -> dict[str, Any]:
    """Every declared field of ``obj`` (nested sections as trees)."""
    out: dict[str, Any] = {}
    for name in sorted(declared(values)):
        value = getattr(obj, name)
        sub = values.NESTED.get(name)
        out[name] = tree(value, sub) if sub is not None else value
    return out


def behaviour(conf: Any) -> list[Any]:
    """What the plugins call on a configuration besides its fields."""
    out: list[Any] = [
        conf.node_name(),
        conf.node_name_fields(),
        conf.valid_attachment_set(),
        conf.runtime_value("mac"),
        conf.runtime_value("ips"),
        conf.args_ips(),
        conf.ipam.describe(),
        conf.ipam.location_fields(),
    ]
    if isinstance(conf, PluginValues):
        out += [conf.ipam_type, conf.allow_ip_forwarding, conf.effective_mtu("/nonexistent")]
    if isinstance(conf, IpamPluginValues):
        out += [conf.ipam.reserved_networks]
    return out


@pytest.mark.parametrize("index", range(4))
@pytest.mark.parametrize(
    ("model", "values"), [(PluginConf, PluginValues), (IpamPluginConf, IpamPluginValues)]
)
def test_rebuilt_values_equal_the_models(
    index: int, model: type[BaseModel], values: type[Values], monkeypatch: pytest.MonkeyPatch
) -> None:
    config = configs()[index]
    if model is IpamPluginConf:
        config = {**config, "ipam": {k: v for k, v in config["ipam"].items() if k != "type"}}
    made = model.model_validate(config)
    known.remember(values, config, made.model_dump())
    got = known.lookup(values, config)
    assert got is not None
    assert type(got) is values
    assert tree(got, values) == tree(made, values)
    assert behaviour(got) == behaviour(made)
    # the per-call keys are the call's own, not the first call's
    other = {**config, "runtimeConfig": {"mac": "02:00:00:00:00:02"}, "args": None}
    again = known.lookup(values, other)
    assert again is not None
    assert tree(again, values) == tree(model.model_validate(other), values)


def _args(command: str, config: dict[str, Any]) -> skel.CmdArgs:
    return skel.CmdArgs(
        command=command,
        container_id="c1",
        netns="/run/netns/p1",
        ifname="eth0",
        args="",
        path=["/opt/cni/bin"],
        stdin=json.dumps(config).encode(),
        config=config,
        cni_version=str(config["cniVersion"]),
        env={},
    )


def entries(cache: Path) -> list[str]:
    return sorted(os.listdir(cache)) if cache.exists() else []


def test_only_a_valid_configuration_is_kept(config_cache: Path) -> None:
    bad = {**RICH, "mtu": 65536}
    for command in ("ADD", "CHECK", "STATUS"):
        with pytest.raises(CniError):
            plugin.configuration(_args(command, bad))
    read = plugin.teardown_configuration(_args("DEL", bad))
    assert [d.path for d in read.dropped] == ["mtu"]
    assert entries(config_cache) == []
    plugin.configuration(_args("ADD", RICH))
    ipam_plugin.configuration(_args("ADD", RICH))
    kept = entries(config_cache)
    assert len(kept) == 2  # one per plugin: their values differ
    assert (config_cache.stat().st_mode & 0o777) == 0o700
    # a DEL that drops nothing is the same configuration: nothing new
    plugin.teardown_configuration(_args("DEL", RICH))
    assert entries(config_cache) == kept


def test_gc_attachment_lists_are_never_kept(config_cache: Path) -> None:
    config = {**RICH, "cni.dev/valid-attachments": [{"containerID": "c", "ifname": "eth0"}]}
    plugin.teardown_configuration(_args("GC", config))
    assert entries(config_cache) == []
    assert known.key(PluginValues, config) is None


def test_doubtful_entries_are_misses(config_cache: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    made = PluginConf.model_validate(RICH)
    known.remember(PluginValues, RICH, made.model_dump())
    assert known.lookup(PluginValues, RICH) is not None
    assert known.lookup(IpamPluginValues, RICH) is None  # another plugin's values
    assert known.lookup(PluginValues, {**RICH, "mtu": 1400}) is None  # another configuration
    (name,) = entries(config_cache)
    (config_cache / name).write_text('{"values": "PluginValues", "data": [')
    assert known.lookup(PluginValues, RICH) is None  # damaged
    known.remember(PluginValues, RICH, made.model_dump())
    assert (config_cache / name).read_text().startswith('{"values": "PluginValues", "data": [')
    monkeypatch.setattr(known, "_fingerprint", ["other code"])
    (config_cache / name).unlink()
    known.remember(PluginValues, RICH, made.model_dump())
    monkeypatch.setattr(known, "_fingerprint", ["newer code"])
    assert known.lookup(PluginValues, RICH) is None  # validated by other code
    monkeypatch.setenv(known.CACHE_ENV, "off")
    assert known.lookup(PluginValues, RICH) is None


_PROBE = """
import json, sys
from cni_protocol import skel
from cni_plugin import plugin
from ipam import plugin as ipam_plugin
from cni_protocol.errors import CniError
config = json.loads(sys.argv[1])
out = []
def args(command):
    return skel.CmdArgs(command=command, container_id="c1", netns="/run/netns/p1",
        ifname="eth0", args="", path=[], stdin=b"", config=config,
        cni_version="1.1.0", env={})
try:
    for command in ("ADD", "CHECK", "DEL"):
        conf = plugin.configuration(args(command))
        iconf = ipam_plugin.configuration(args(command))
        out.append([type(conf).__name__, conf.mtu, conf.ipam.etcd_endpoints,
                    conf.runtime_value("mac"), type(iconf).__name__, iconf.ipam.ipv4_pools,
                    iconf.ipam.block_size_ipv4])
except CniError as e:
    out.append([int(e.code), e.msg])
print(json.dumps({"pydantic": "pydantic" in sys.modules, "out": out}))
"""


def probe(config: dict[str, Any], cache: Path) -> dict[str, Any]:
    env = {**os.environ, known.CACHE_ENV: str(cache)}
    proc = subprocess.run(
        [sys.executable, "-c", _PROBE, json.dumps(config)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        check=True,
    )
    result: dict[str, Any] = json.loads(proc.stdout)
    return result


def test_a_kept_configuration_is_read_without_pydantic(config_cache: Path) -> None:
    first = probe(RICH, config_cache)
    assert first["pydantic"] is True  # the first call validates, and keeps
    assert len(entries(config_cache)) == 2
    other = {**RICH, "runtimeConfig": {"mac": "02:00:00:00:00:09"}, "prevResult": None}
    second = probe(other, config_cache)
    assert second["pydantic"] is False
    assert first["out"][0][0] == "PluginConf"
    assert second["out"][0][0] == "PluginValues"
    for a, b in zip(first["out"], second["out"], strict=True):
        assert a[1:3] == b[1:3]
        assert a[5:] == b[5:]
        assert (a[3], b[3]) == ("02:00:00:00:00:01", "02:00:00:00:00:09")
    # an invalid configuration is refused by the models, as without the cache
    bad = probe({**RICH, "ipam": {**RICH["ipam"], "block_size_ipv4": 40}}, config_cache)
    assert bad["pydantic"] is True
    code, message = bad["out"][0]
    assert code == 2
    assert "ipam.block_size_ipv4" in message
