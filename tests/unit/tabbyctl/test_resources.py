"""tabbyctl apply / get / delete / datastore migrate through click's CliRunner.

No root needed: the store is a private file store under ``tmp_path``, named by a conflist
given with ``--conf``; the TABBY_* datastore variables are cleared so the host's environment
cannot point the commands elsewhere.
"""

from __future__ import annotations

import copy
import json
import uuid
from pathlib import Path
from typing import Any

import pytest
import yaml  # type: ignore[import-untyped, unused-ignore]
from click.testing import Result

from datastore.base import KINDS
from datastore.file import FileStore
from ipam.core import AssignRequest, Ipam, handle_id
from resources import wep
from resources.storage import BY_KIND, validate
from tests.unit.resources.test_models import VALID
from tests.unit.tabbyctl.helpers import invoke, without_datastore_environment

ORDER = ["IPPool", "BGPConfiguration", "BGPPeer", "Node", "Namespace", "Pod", "NetworkPolicy"]


class Ctl:
    def __init__(self, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
        without_datastore_environment(monkeypatch)
        self.tmp = tmp_path
        self.data_dir = tmp_path / "ipam"
        self.conf = tmp_path / "10-tabby.conflist"
        self.conf.write_text(
            json.dumps(
                {
                    "cniVersion": "1.0.0",
                    "name": "net1",
                    "plugins": [
                        {
                            "type": "tabby",
                            "nodename": "node-a",
                            "ipam": {
                                "type": "tabby-ipam",
                                "data_dir": str(self.data_dir),
                                "lock_timeout_seconds": 5,
                            },
                        }
                    ],
                }
            )
        )

    def run(self, *args: str, input: str | None = None) -> Result:
        return invoke(["--conf", str(self.conf), *args], input=input)

    def ok(self, *args: str, input: str | None = None) -> str:
        result = self.run(*args, input=input)
        assert result.exit_code == 0, (result.stdout, result.stderr)
        assert result.stderr == ""
        return result.stdout

    def fails(self, *args: str, input: str | None = None) -> str:
        """The one-line error of a command that must fail (exit 1, nothing on stdout)."""
        result = self.run(*args, input=input)
        assert result.exit_code == 1, (result.stdout, result.stderr)
        assert result.stdout == ""
        lines = result.stderr.splitlines()
        assert len(lines) == 1, lines
        assert lines[0].startswith("Error: ")
        return lines[0][len("Error: ") :]

    def file(self, name: str, docs: list[Any] | str) -> str:
        path = self.tmp / name
        if isinstance(docs, str):
            path.write_text(docs)
        else:
            path.write_text(yaml.safe_dump_all(docs, sort_keys=False))
        return str(path)

    def store(self) -> FileStore:
        return FileStore(str(self.data_dir), lock_timeout=5)

    def everything(self) -> dict[tuple[str, str], Any]:
        store = self.store()
        return {(k, key): d.data for k in KINDS for key, d in store.list(k)}


@pytest.fixture
def ctl(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Ctl:
    return Ctl(tmp_path, monkeypatch)


def where(kind: str) -> list[str]:
    meta = VALID[kind]["metadata"]
    ns = meta.get("namespace")
    return [meta["name"], *(["-n", ns] if ns else [])]


# -- round trip ----------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", sorted(VALID))
def test_round_trip_every_kind(ctl: Ctl, kind: str) -> None:
    path = ctl.file("one.yaml", [VALID[kind]])
    name = VALID[kind]["metadata"]["name"]
    assert ctl.ok("apply", "-f", path) == f"{kind}/{name} created\n"
    got = yaml.safe_load(ctl.ok("get", kind.lower(), *where(kind), "-o", "yaml"))
    assert got["apiVersion"] == VALID[kind]["apiVersion"]
    assert got["kind"] == kind
    assert got["metadata"]["name"] == name
    assert int(got["metadata"]["resourceVersion"]) > 0
    expected = validate(BY_KIND[kind], VALID[kind]).wire()  # with defaults, as get shows
    assert got.get("spec") == expected.get("spec")
    assert got["metadata"].get("labels") == expected["metadata"].get("labels")
    as_json = json.loads(ctl.ok("get", kind.lower(), *where(kind), "-o", "json"))
    assert as_json == got
    listing = json.loads(ctl.ok("get", kind.lower(), "-o", "json"))
    assert listing["kind"] == "List"
    assert listing["items"] == [got]
    table = ctl.ok("get", kind.lower()).splitlines()
    assert len(table) == 2
    assert "NAME" in table[0].split()
    assert name in table[1].split()
    # what get shows applies back unchanged
    again = ctl.file("again.yaml", [got])
    assert ctl.ok("apply", "-f", again) == f"{kind}/{name} unchanged\n"
    assert ctl.ok("delete", kind.lower(), *where(kind)) == f"{kind}/{name} deleted\n"
    assert "not found" in ctl.fails("get", kind.lower(), *where(kind))
    assert ctl.everything() == {}


def test_apply_a_file_of_every_kind_then_get_it_back(ctl: Ctl) -> None:
    docs = [VALID[k] for k in ORDER]
    out = ctl.ok("apply", "-f", ctl.file("all.yaml", docs))
    assert out.splitlines() == [f"{k}/{VALID[k]['metadata']['name']} created" for k in ORDER]
    shown = []
    for kind in ORDER:
        shown.append(yaml.safe_load(ctl.ok("get", kind, *where(kind), "-o", "yaml")))
    out = ctl.ok("apply", "-f", ctl.file("shown.yaml", shown))
    assert out.splitlines() == [f"{k}/{VALID[k]['metadata']['name']} unchanged" for k in ORDER]
    out = ctl.ok("delete", "-f", ctl.file("all.yaml", docs))
    assert out.splitlines() == [f"{k}/{VALID[k]['metadata']['name']} deleted" for k in ORDER]
    assert ctl.everything() == {}


def test_json_files_and_standard_input(ctl: Ctl) -> None:
    as_list = {"apiVersion": "v1", "kind": "List", "items": [VALID["Namespace"], VALID["Pod"]]}
    path = ctl.file("list.json", json.dumps(as_list))
    assert ctl.ok("apply", "-f", path).splitlines() == [
        "Namespace/shop created",
        "Pod/web-0 created",
    ]
    array = json.dumps([VALID["BGPPeer"]])
    assert ctl.ok("apply", "-f", "-", input=array) == "BGPPeer/tor created\n"
    single = json.dumps(VALID["Node"])
    assert ctl.ok("apply", "-f", "-", input=single) == "Node/node-a created\n"
    stream = yaml.safe_dump_all([VALID["IPPool"], None, VALID["NetworkPolicy"]])
    assert ctl.ok("apply", "-f", "-", input=stream).splitlines() == [
        "IPPool/pool-a created",
        "NetworkPolicy/allow-web created",
    ]


def test_timestamps_stay_strings(ctl: Ctl) -> None:
    text = (
        "apiVersion: v1\nkind: Namespace\n"
        "metadata: {name: shop, creationTimestamp: 2020-01-01T00:00:00Z}\n"
    )
    ctl.ok("apply", "-f", "-", input=text)
    got = json.loads(ctl.ok("get", "ns", "shop", "-o", "json"))
    assert isinstance(got["metadata"]["creationTimestamp"], str)


# -- errors --------------------------------------------------------------------------------------


def bad_policy() -> dict[str, Any]:
    doc = copy.deepcopy(VALID["NetworkPolicy"])
    doc["metadata"]["name"] = "deny-all"
    doc["spec"]["ingress"][0]["ports"][0]["port"] = 70000
    return doc


def test_a_bad_document_fails_the_whole_file(ctl: Ctl) -> None:
    path = ctl.file("two.yaml", [VALID["Namespace"], bad_policy()])
    error = ctl.fails("apply", "-f", path)
    assert error == (
        "NetworkPolicy/deny-all: spec.ingress[0].ports[0].port: Invalid value: 70000: "
        "must be between 1 and 65535, inclusive"
    )
    assert ctl.everything() == {}


def test_a_document_without_a_name_is_counted(ctl: Ctl) -> None:
    nameless = {"apiVersion": "v1", "kind": "Pod", "metadata": {"labels": {"a": "b"}}}
    error = ctl.fails("apply", "-f", ctl.file("x.yaml", [VALID["Namespace"], nameless]))
    assert error == "document 2: metadata.name: Required value: name is required"
    assert ctl.everything() == {}


@pytest.mark.parametrize(
    ("content", "message"),
    [
        ("kind: [unclosed\n", "not YAML or JSON"),
        ('{"kind": "Pod",,}', "not YAML or JSON"),
        ("key: value\n  bad indent: x\n", "not YAML or JSON"),
        ("just some words\n", "not YAML or JSON resource documents"),
        ("", "no documents"),
        ("---\n---\n", "no documents"),
    ],
)
def test_files_that_are_not_resources(ctl: Ctl, content: str, message: str) -> None:
    assert message in ctl.fails("apply", "-f", ctl.file("x.txt", content))
    assert ctl.everything() == {}


def test_binary_and_missing_files(ctl: Ctl) -> None:
    path = ctl.tmp / "x.bin"
    path.write_bytes(b"\xff\xfe\x00\x01binary")
    assert "not YAML or JSON" in ctl.fails("apply", "-f", str(path))
    assert "cannot read" in ctl.fails("apply", "-f", str(ctl.tmp / "missing.yaml"))


def test_resource_version_conflict(ctl: Ctl) -> None:
    ctl.ok("apply", "-f", ctl.file("ns.yaml", [VALID["Namespace"]]))
    got = yaml.safe_load(ctl.ok("get", "ns", "shop", "-o", "yaml"))
    got["metadata"]["labels"]["team"] = "b"
    ctl.ok("apply", "-f", ctl.file("v2.yaml", [got]))
    got["metadata"]["labels"]["team"] = "c"
    error = ctl.fails("apply", "-f", ctl.file("v3.yaml", [got]))
    assert error.startswith("Namespace/shop: the object has been modified")
    shown = json.loads(ctl.ok("get", "ns", "shop", "-o", "json"))
    assert shown["metadata"]["labels"]["team"] == "b"


def test_merge_through_apply(ctl: Ctl) -> None:
    ctl.ok("apply", "-f", ctl.file("node.yaml", [VALID["Node"]]))
    patch = {
        "apiVersion": "tabby.io/v1",
        "kind": "Node",
        "metadata": {"name": "node-a", "labels": {"zone": "z"}},
    }
    assert ctl.ok("apply", "-f", ctl.file("p.yaml", [patch])) == "Node/node-a configured\n"
    got = json.loads(ctl.ok("get", "node", "node-a", "-o", "json"))
    assert got["metadata"]["labels"] == {"rack": "a", "zone": "z"}
    assert got["spec"]["ipv4Address"] == "192.168.1.5/24"


def test_get_and_delete_errors(ctl: Ctl) -> None:
    assert "unknown resource kind 'services'" in ctl.fails("get", "services")
    assert ctl.fails("get", "pod", "nope") == "Pod 'nope' not found in namespace default"
    assert ctl.fails("delete", "ns", "nope") == "Namespace 'nope' not found"
    assert ctl.ok("delete", "ns", "nope", "--ignore-not-found") == ""
    result = ctl.run("delete")
    assert result.exit_code == 2  # usage
    result = ctl.run("apply")
    assert result.exit_code == 2
    result = ctl.run("get", "pods", "-o", "wide")
    assert result.exit_code == 2


def test_delete_file_is_all_or_nothing(ctl: Ctl) -> None:
    ctl.ok("apply", "-f", ctl.file("a.yaml", [VALID["Namespace"], VALID["Pod"]]))
    both = ctl.file("b.yaml", [VALID["Namespace"], VALID["NetworkPolicy"], VALID["Pod"]])
    assert (
        ctl.fails("delete", "-f", both) == "NetworkPolicy 'allow-web' not found in namespace shop"
    )
    assert len(ctl.everything()) == 2
    out = ctl.ok("delete", "-f", both, "--ignore-not-found")
    assert out.splitlines() == ["Namespace/shop deleted", "Pod/web-0 deleted"]
    assert ctl.everything() == {}


# -- kinds and output ----------------------------------------------------------------------------

ALIASES = {
    "IPPool": ["ippool", "ippools", "IPPool"],
    "Node": ["node", "nodes"],
    "BGPConfiguration": ["bgpconfiguration", "bgpconfigurations"],
    "BGPPeer": ["bgppeer", "bgppeers"],
    "NetworkPolicy": ["networkpolicy", "networkpolicies", "netpol"],
    "Namespace": ["namespace", "namespaces", "ns"],
    "Pod": ["pod", "pods"],
    "WorkloadEndpoint": ["workloadendpoint", "workloadendpoints", "wep"],
}


def test_kind_aliases(ctl: Ctl) -> None:
    ctl.ok("apply", "-f", ctl.file("all.yaml", [VALID[k] for k in VALID]))
    for kind, aliases in ALIASES.items():
        for alias in aliases:
            got = json.loads(ctl.ok("get", alias, "-o", "json"))
            assert [i["kind"] for i in got["items"]] == [kind], alias
            one = json.loads(ctl.ok("get", alias, *where(kind), "-o", "json"))
            assert one["kind"] == kind


def test_tables(ctl: Ctl) -> None:
    assert ctl.ok("get", "pods") == "no pods found\n"
    assert ctl.ok("get", "netpol", "-n", "x") == "no networkpolicies found in namespace x\n"
    assert json.loads(ctl.ok("get", "pods", "-o", "json")) == {
        "apiVersion": "v1",
        "kind": "List",
        "items": [],
    }
    ctl.ok("apply", "-f", ctl.file("all.yaml", [VALID[k] for k in VALID]))
    rows = {
        "ippools": ["NAME  CIDR", "pool-a  10.50.0.0/16  26  -  Always  false  false  all()"],
        "netpol": ["NAMESPACE  NAME", "shop  allow-web  app=web  Ingress,Egress"],
        "pods": ["NAMESPACE  NAME", "shop  web-0  app=web  http:80/TCP"],
        "ns": ["NAME  LABELS", "shop  kubernetes.io/metadata.name=shop,team=a"],
        "bgppeers": ["NAME  PEER IP", "tor  192.0.2.1  65000  -  -  rack == 'a'"],
        "bgpconfiguration": ["NAME  ASN", "default  64513  false  Info"],
        "nodes": [
            "NAME  BACKEND",
            "node-a  vxlan  192.168.1.5/24  fd00::5/64  64600  224.0.0.1  rack=a",
        ],
        "wep": [
            "NAMESPACE  NAME",
            "shop  node--a-k8s-web--0-eth0  node-a  web-0  eth0  cali0123456789a",
        ],
    }
    for kind, (header, row) in rows.items():
        lines = [" ".join(line.split()) for line in ctl.ok("get", kind).splitlines()]
        squeezed_header = " ".join(header.split())
        assert lines[0].startswith(squeezed_header), (kind, lines)
        assert lines[1].startswith(" ".join(row.split())), (kind, lines)


# -- WorkloadEndpoints ---------------------------------------------------------------------------


def add_endpoint(ctl: Ctl, pod: str = "web-0") -> str:
    return wep.write_endpoint(
        ctl.store(),
        namespace="shop",
        node="node-a",
        pod=pod,
        container_id="c1",
        interface="eth0",
        host_interface="cali0123456789a",
        ip_networks=["10.50.0.7/32"],
    )


def wep_labels(ctl: Ctl) -> list[dict[str, str]]:
    items = json.loads(ctl.ok("get", "wep", "-o", "json"))["items"]
    return [i["metadata"].get("labels", {}) for i in items]


def test_endpoint_labels_pod_applied_before_the_add(ctl: Ctl) -> None:
    ctl.ok("apply", "-f", ctl.file("pod.yaml", [VALID["Pod"]]))
    add_endpoint(ctl)
    assert wep_labels(ctl) == [{"app": "web"}]
    table = ctl.ok("get", "wep").splitlines()
    assert table[1].split()[-1] == "app=web"


def test_endpoint_labels_pod_applied_after_the_add(ctl: Ctl) -> None:
    key = add_endpoint(ctl)
    assert wep_labels(ctl) == [{}]
    ctl.ok("apply", "-f", ctl.file("pod.yaml", [VALID["Pod"]]))
    assert wep_labels(ctl) == [{"app": "web"}]  # the Pod's, as every reader sees them
    doc = ctl.store().get(wep.KIND, key)
    assert doc is not None
    assert doc.data["metadata"]["labels"] == {}  # what its ADD stored: the Pod's write is one
    ctl.ok("delete", "pod", "web-0", "-n", "shop")
    assert wep_labels(ctl) == [{}]


# -- delete node --release-blocks ----------------------------------------------------------------


def test_delete_node_release_blocks(ctl: Ctl) -> None:
    ctl.ok(
        "apply",
        "-f",
        ctl.file("x.yaml", [VALID["IPPool"], {**VALID["Node"], "metadata": {"name": "node-b"}}]),
    )
    ipam = Ipam(ctl.store(), "node-b")
    hid = handle_id("net1", "c1", "eth0")
    ipam.assign(AssignRequest(hid, attrs={"node": "node-b"}, v4_pools=["10.50.0.0/16"]))
    assert ctl.store().list("block")
    out = ctl.ok("delete", "node", "node-b", "--release-blocks").splitlines()
    assert out[0] == "Node/node-b deleted"
    assert out[1].startswith("node node-b: released 1 address(es)")
    assert ipam.get_handle(hid) == []
    assert ctl.store().list("block") == []
    # a node already gone: still releases (nothing left here)
    assert ctl.ok("delete", "node", "node-b", "--release-blocks").startswith(
        "node node-b: released 0"
    )
    result = ctl.run("delete", "pod", "x", "--release-blocks")
    assert result.exit_code == 2


# -- datastore migrate ---------------------------------------------------------------------------


def test_migrate_to_a_file_store(ctl: Ctl) -> None:
    ctl.ok("apply", "-f", ctl.file("all.yaml", [VALID[k] for k in VALID]))
    Ipam(ctl.store(), "node-a").assign(
        AssignRequest(handle_id("net1", "c1", "eth0"), v4_pools=["10.50.0.0/16"])
    )
    target = ctl.tmp / "target"
    out = ctl.ok("datastore", "migrate", "--to", "file", "--to-data-dir", str(target)).splitlines()
    assert out[-1] == f"copied {len(ctl.everything())} documents to file store {target}"
    assert "workloadendpoint   1" in out
    copied = FileStore(str(target), lock_timeout=5)
    assert {(k, key): d.data for k in KINDS for key, d in copied.list(k)} == ctl.everything()
    assert "already holds tabby data" in ctl.fails(
        "datastore", "migrate", "--to", "file", "--to-data-dir", str(target)
    )
    assert ctl.run("datastore", "migrate", "--to", "file").exit_code == 2
    assert ctl.run("datastore", "migrate", "--to", "consul").exit_code == 2


@pytest.mark.etcd
def test_migrate_to_etcd(ctl: Ctl, etcd1: Any) -> None:
    from datastore.etcd.store import EtcdStore

    ctl.ok("apply", "-f", ctl.file("all.yaml", [VALID[k] for k in VALID]))
    hid = handle_id("net1", "c1", "eth0")
    [held] = Ipam(ctl.store(), "node-a").assign(AssignRequest(hid, v4_pools=["10.50.0.0/16"]))
    prefix = f"/test-{uuid.uuid4().hex[:12]}"
    endpoints = ",".join(etcd1.endpoints)
    target = ["--to", "etcdv3", "--etcd-endpoints", endpoints, "--etcd-prefix", prefix]
    out = ctl.ok("datastore", "migrate", *target).splitlines()
    assert (
        out[-1] == f"copied {len(ctl.everything())} documents to etcd {endpoints} prefix {prefix}"
    )
    store = EtcdStore(etcd1.endpoints, prefix=prefix, lock_timeout=5, lock_dir=str(ctl.tmp))
    try:
        copied = {(k, key): d.data for k in KINDS for key, d in store.list(k)}
        assert copied == ctl.everything()
        assert [a.ip for a in Ipam(store, "node-a").get_handle(hid)] == [held.ip]
    finally:
        store.close()
    # tabbyctl reads it back from etcd through the datastore flags
    flags = ["--datastore-type", "etcdv3", "--etcd-endpoints", endpoints, "--etcd-prefix", prefix]
    shown = json.loads(ctl.ok(*flags, "get", "netpol", "-o", "json"))
    assert [i["metadata"]["name"] for i in shown["items"]] == ["allow-web"]
    assert "already holds tabby data" in ctl.fails("datastore", "migrate", *target)


# -- found by fuzzing (tests/fuzz/apply_yaml.py) -------------------------------------------


@pytest.mark.parametrize(
    ("text", "error"),
    [
        ("[" * 5000, "nested too deeply"),
        ("a: " + "[" * 5000, "nested too deeply"),
        (
            "apiVersion: tabby.io/v1\nkind: IPPool\nmetadata: &m {name: p, labels: *m}\n"
            "spec: {cidr: 10.0.0.0/16}\n",
            "a YAML alias inside its own anchor",
        ),
        (
            "a: &a [x, x, x, x, x, x, x, x, x, x]\n"
            + "".join(
                f"{n}: &{n} [{', '.join(['*' + p] * 10)}]\n"
                for p, n in zip("abcdef", "bcdefg", strict=True)
            )
            + "kind: IPPool\n",
            "more than 1,000,000 values",
        ),
    ],
    ids=["deep-json", "deep-yaml", "alias-cycle", "alias-bomb"],
)
def test_a_file_that_would_exhaust_the_stack_or_memory_is_refused(
    ctl: Ctl, text: str, error: str
) -> None:
    """A file nested past the parsers' stack, or holding itself through a YAML alias, made
    tabbyctl apply end in a RecursionError traceback; aliases of aliases (a "billion
    laughs", 10**7 values here) would be walked by the models and the store. Each is one
    line now."""
    assert error in ctl.fails("apply", "-f", ctl.file("bad.yaml", text))
