"""The daemons' and tabbyctl's datastore settings (``cni_config.resolve``): a bad setting is
one clean error naming where it came from, also for a rule over several settings."""

from __future__ import annotations

import argparse

import pytest

from cni_config.resolve import add_datastore_flags, daemon_datastore, resolve_datastore
from cni_protocol.errors import CniError


def _ns(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_datastore_flags(parser)
    return parser.parse_args(list(argv))


def test_a_bad_flag_is_named_as_the_flag() -> None:
    with pytest.raises(CniError) as info:
        daemon_datastore(_ns("--datastore-type", "etcdv3", "--etcd-endpoints", "ftp://x"), {}, None)
    assert "--etcd-endpoints" in info.value.msg


@pytest.mark.parametrize("where", ["flags", "env"])
def test_a_rule_over_several_settings_is_an_error_not_a_crash(where: str) -> None:
    """A client certificate without its key: the model's own rule, located nowhere."""
    if where == "flags":
        ns = _ns(
            "--datastore-type", "etcdv3", "--etcd-endpoints", "http://127.0.0.1:1",
            "--etcd-cert-file", "/tmp/cert.pem",
        )  # fmt: skip
        env: dict[str, str] = {}
    else:
        ns = _ns("--datastore-type", "etcdv3")
        env = {"TABBY_ETCD_CERT_FILE": "/tmp/cert.pem"}
    with pytest.raises(CniError) as info:
        daemon_datastore(ns, env, None)
    assert "etcd_key_file" in info.value.msg
    assert ("--etcd-cert-file" if where == "flags" else "TABBY_ETCD_CERT_FILE") in (
        info.value.details or ""
    )


def test_resolve_names_a_conflist_field_by_its_path() -> None:
    with pytest.raises(CniError) as info:
        resolve_datastore({"datastore_type": "etcdv3", "etcd_endpoints": "ftp://x"})
    assert "ipam.etcd_endpoints" in info.value.msg
