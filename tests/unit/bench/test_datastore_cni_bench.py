"""datastore_cni_bench reads tabby-node's per-call numbers from its /metrics: the names and
labels the node exports (``tabby_node.metrics``), read back per verb; and --throughput's
accounting of the machine (its busy share, the plugin processes' CPU)."""

from __future__ import annotations

import pytest

from bench.cni.datastore_cni_bench import (
    busy_share,
    busy_text,
    client_cpu,
    cpu_text,
    machine_cpu,
    parse_node_calls,
)
from tabby_node.metrics import Metrics


def test_node_calls_are_read_per_verb_from_the_nodes_own_exposition() -> None:
    m = Metrics()
    for ipam, netlink, server in ((0.004, 0.003, 0.001), (0.006, 0.005, 0.003)):
        phases = {
            "ipam": ipam,
            "netlink": netlink + 0.010,  # beside ipam: only its wait is on the call's path
            "netlink_wait": netlink,
            "endpoint_wait": 0.0005,
            "server": server,
        }
        m.cni_request("ADD", 0, b"{}", 0.02, phases, cpu=0.010)
    m.cni_request("DEL", 0, b"", 0.03, {"ipam": 0.002, "server": 0.001}, cpu=0.009)
    _, body = m.exposition("text/plain")
    got = parse_node_calls(body.decode())
    assert set(got) == {"ADD", "DEL"}  # verbs never served are left out
    add = got["ADD"]
    assert add["n"] == 2
    assert add["cpu"] == pytest.approx(10.0)
    assert add["ipam"] == pytest.approx(5.0)
    assert add["netlink_wait"] == pytest.approx(4.0)
    assert add["endpoint_wait"] == pytest.approx(0.5)
    assert add["server"] == pytest.approx(2.0)
    assert "netlink_wait" not in got["DEL"]
    assert cpu_text(add, "ADD") == "10.0 ok"
    assert cpu_text(got["DEL"], "DEL") == "9.0 no"
    assert cpu_text(None, "ADD") == "-"
    # an older tabby-node: its calls counted, nothing of the rest
    older = "\n".join(
        line for line in body.decode().splitlines() if "tabby_cni_requests_total" in line
    )
    assert parse_node_calls(older) == {"ADD": {"n": 2.0}, "DEL": {"n": 1.0}}
    assert cpu_text(parse_node_calls(older)["ADD"], "ADD") == "-"


def test_busy_share_is_the_busy_part_of_the_cpu_time_between_two_readings() -> None:
    assert busy_share((100.0, 400.0), (250.0, 600.0)) == 0.75
    assert busy_share((1.0, 5.0), (1.0, 5.0)) is None  # no time between them: no share
    assert busy_text(0.754) == "75%"
    assert busy_text(None) == "-"
    busy, total = machine_cpu()  # this machine's /proc/stat: busy is a part of the total
    assert 0 <= busy <= total


def test_client_cpu_is_the_cpu_p50_of_the_labels_add() -> None:
    report = {"stats": {"ptp": {"ADD": {"cpu_p50": 12.5}, "DEL": {"cpu_p50": 9.0}}}}
    assert client_cpu(report, "ptp") == 12.5
    assert client_cpu(report, "node-file") is None
    assert client_cpu({}, "ptp") is None
