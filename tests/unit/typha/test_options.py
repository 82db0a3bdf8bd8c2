"""tabby-typha's flags, and tabby-node's flags that put it behind typha."""

from __future__ import annotations

import pytest

from cni_protocol.errors import CniError
from fanout.client import parse_endpoints
from tabby_node.options import parse as node_parse
from tabby_node.typha import addresses_of
from typha.options import parse

ETCD = ["--datastore-type", "etcdv3", "--etcd-endpoints", "http://127.0.0.1:2379"]


def test_typha_needs_mutual_tls_or_says_plaintext() -> None:
    with pytest.raises(CniError, match="mutual TLS"):
        parse(ETCD, env={})
    options, settings = parse([*ETCD, "--plaintext"], env={})
    assert options.plaintext
    assert settings.datastore_type == "etcdv3"
    options, _ = parse(
        [*ETCD, "--ca-file", "/a", "--cert-file", "/b", "--key-file", "/c"],
        env={"TABBY_TYPHA_CLIENT_CN": "tabby-node, other", "TABBY_TYPHA_PORT": "6000"},
    )
    assert options.client_cns == ("tabby-node", "other")
    assert options.port == 6000


def test_typha_serves_a_cluster_datastore() -> None:
    with pytest.raises(CniError, match="cluster datastore"):
        parse(["--datastore-type", "file", "--plaintext"], env={})


def test_node_reads_from_typha_when_told() -> None:
    options, _ = node_parse([], env={})
    assert not options.typha
    options, _ = node_parse([], env={"TABBY_TYPHA_ENDPOINTS": "10.0.0.1:5473,typha"})
    assert options.typha
    assert parse_endpoints(options.typha_endpoints) == ["10.0.0.1:5473", "typha:5473"]
    options, _ = node_parse(["--typha-service", "kube-system/tabby-typha"], env={})
    assert options.typha


@pytest.mark.parametrize(
    ("argv", "why"),
    [
        (["--typha-endpoints", "a:1", "--typha-service", "kube-system/t"], "not both"),
        (["--typha-endpoints", "a:99999"], "host:port"),
        (["--typha-service", "nope"], "NAMESPACE/NAME"),
        (["--typha-endpoints", "a:1", "--typha-ca-file", "/ca"], "go together"),
    ],
)
def test_node_typha_flags_refused(argv: list[str], why: str) -> None:
    with pytest.raises(CniError, match=why):
        node_parse(argv, env={})


def test_a_services_endpoints() -> None:
    endpoints = {
        "subsets": [
            {
                "addresses": [{"ip": "10.1.0.4"}, {"ip": "fd00::4"}],
                "notReadyAddresses": [{"ip": "10.1.0.5"}],
                "ports": [{"name": "metrics", "port": 9093}, {"name": "typha", "port": 5473}],
            }
        ]
    }
    assert addresses_of(endpoints) == ["10.1.0.4:5473", "[fd00::4]:5473"]
    assert addresses_of({}) == []
