"""Every documented configuration field refuses bad values, in both binaries (issue: one
declarative model, so that no field escapes validation).

The test walks docs/configuration.md's field tables: each documented field must have a row of cases
here (wrong type, empty, out of range, hostile), and every field the models know must be
documented. A field added later without validation or without documentation fails.

Each case runs an ADD in-process through the binary's real handlers (tabby with a fake
dataplane and IPAM that record calls; tabby-ipam over a temporary file store) and expects
code 2 naming the field (or 7 for a structural problem) and nothing done: no IPAM call, no
kernel call, no allocation.

The DEL and GC columns run every case again after a real ADD with the good configuration
(tabby as tabby-node runs it: tabby-ipam in-process over the temporary store, endpoints in
that store, a fake dataplane): DEL and GC succeed and remove everything that does not derive
from the bad field (TEARDOWN_NEEDS says what does), open no store but the one the
configuration names, and still fail on a structural problem (CONFORMANCE.md DEL-9).
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest

from cni_plugin import plugin
from cni_plugin.config import ContainerSettings, IpamRef, PluginConf
from cni_protocol import skel
from ipam import plugin as ipam_plugin
from ipam.config import IpamConf
from tests import REPO_ROOT as ROOT

#: Fields a table documents as free-form (docs/configuration.md says so): never a reason to fail.
FREE_FORM = {"capabilities"}
#: Reserved keys the runtime owns (CNI spec): tolerated in any shape, documented apart.
RESERVED = {"runtimeConfig", "args", "cni.dev/valid-attachments", "cni.dev/attachments"}

HOSTILE_STRINGS = ["../../etc/passwd", "a\u0000b", "x" * 5000, "é", "$(reboot)"]

# field -> list of (value, expected code). Dotted names are nested (section.field).
PLUGIN_CASES: dict[str, list[tuple[Any, int]]] = {
    "mtu": [("1500", 2), (True, 2), (1500.5, 2), (67, 2), (65536, 2), (-1, 2), (10**20, 2)],
    "veth_prefix": [
        (5, 2),
        ("", 2),
        ("toolong", 2),
        ("1ab", 2),
        ("a/b", 2),
        ("a b", 2),
        ("é", 2),
        ("a%", 2),
        (None, 2),
    ],
    "container_settings.allow_ip_forwarding": [(1, 2), ("maybe", 2), ("", 2), (None, 2)],
    "ipam.type": [(5, 7), ("", 7), ("../x", 7), ("/bin/sh", 7), (None, 7)],
}

#: Sections (objects holding the fields above): a section that is not an object is code 7.
SECTION_CASES: dict[str, list[tuple[Any, int]]] = {
    "container_settings": [("yes", 7), ([], 7)],
    "ipam": [("tabby-ipam", 7), ({}, 7), ([], 7)],
}

COMMON_CASES: dict[str, list[tuple[Any, int]]] = {
    "nodename": [
        (123, 2),
        ("", 2),
        ("a" * 300, 2),
        ("node:a", 2),
        ("a/b", 2),
        (" node-a ", 2),
        ("-leading", 2),
        *[(h, 2) for h in HOSTILE_STRINGS],
    ],
    "nodename_file": [(123, 2), ("", 2), ("relative/name", 2), ("/x\u0000y", 2), ([], 2)],
    "log_level": [(5, 2), ("", 2), ("verbose", 2), ("info\n", 2), (None, 2)],
    "log_file_path": [(123, 2), ("", 2), ("relative.log", 2), ("/x\u0000y", 2), (None, 2)],
}

IPAM_CASES: dict[str, list[tuple[Any, int]]] = {
    "assign_ipv4": [(1, 2), ("yes", 2), ("", 2), (None, 2)],
    "assign_ipv6": [(1, 2), ("yes", 2), ("", 2)],
    "ipv4_pools": [
        ("10.0.0.0/16", 2),
        ([5], 2),
        ([], 2),
        (["10.0.0.1/16"], 2),
        (["fd00::/48"], 2),
        (["10.0.0.0/16; rm -rf /"], 2),
        (["x" * 5000], 2),
    ],
    "ipv6_pools": [("fd00::/48", 2), ([5], 2), (["fd00::1/48"], 2), (["10.0.0.0/16"], 2)],
    "block_size_ipv4": [("26", 2), (26.0, 2), (True, 2), (19, 2), (33, 2), (None, 2)],
    "block_size_ipv6": [("122", 2), (115, 2), (129, 2)],
    "strict_affinity": [("maybe", 2), (1, 2)],
    "max_blocks_per_host": [(-1, 2), ("1", 2), (1.5, 2), (2**40, 2)],
    "reserved": [("10.0.0.1", 2), (["x"], 2), ([1], 2), (["10.0.0.0/33"], 2)],
    "datastore_type": [(5, 2), ("", 2), ("zk", 2), ("FILE", 2)],
    "data_dir": [(5, 2), ("", 2), ("relative", 2), ("/x\u0000y", 2)],
    "lock_timeout_seconds": [("30", 2), (0, 2), (-1, 2), (True, 2), (1e9, 2)],
    "gc_grace_seconds": [("1", 2), (-1, 2), (True, 2), (1e12, 2)],
    "etcd_endpoints": [
        (5, 2),
        ("", 2),
        ([], 2),
        (["127.0.0.1:2379"], 2),
        (["http://etcd"], 2),
        (["ftp://etcd:1"], 2),
        (["http://etcd:1/v3"], 2),
        (["http://user:pw@etcd:1"], 2),
    ],
    "etcd_prefix": [(5, 2), ("", 2), ("tabby", 2), ("/", 2), ("/a//b", 2)],
    "etcd_ca_cert_file": [(5, 2), ("", 2), ("relative.pem", 2)],
    "etcd_cert_file": [(5, 2), ("relative.pem", 2), ("/etc/tabby/cert.pem", 2)],  # no key
    "etcd_key_file": [(5, 2), ("relative.pem", 2), ("/etc/tabby/key.pem", 2)],  # no cert
    "etcd_watch_transport": [(5, 2), ("", 2), ("GRPC", 2), ("http", 2)],
    "etcd_watch_endpoints": [
        (5, 2),
        ("etcd:2379", 2),
        (["http://etcd"], 2),
        (["grpc://proxy:23790"], 2),
    ],
    "kubeconfig": [(5, 2), ("", 2), ("relative/kubeconfig", 2)],
}

#: The datastore settings: part of the ipam section, read by both binaries (tabby records
#: each attachment's WorkloadEndpoint in that datastore).
DATASTORE = (
    "datastore_type",
    "data_dir",
    "etcd_endpoints",
    "etcd_prefix",
    "etcd_ca_cert_file",
    "etcd_cert_file",
    "etcd_key_file",
    "etcd_watch_transport",
    "etcd_watch_endpoints",
    "kubeconfig",
    "lock_timeout_seconds",
)
PLUGIN_CASES.update({f"ipam.{k}": IPAM_CASES[k] for k in DATASTORE})

GC_CASES: list[tuple[Any, int]] = [
    ([{"containerID": 5, "ifname": "eth0"}], 2),
    ([{"containerID": "c1", "ifname": 5}], 2),
    ([{"containerID": "", "ifname": "eth0"}], 2),
    ([5], 7),
    ("c1", 2),
]


# -- docs/configuration.md's tables ---------------------------------------------------------


def doc_fields(heading: str) -> set[str]:
    """First-column field names of the table under ``heading`` (``a`` / ``b`` rows split)."""
    text = (ROOT / "docs" / "configuration.md").read_text()
    start = text.index(heading)
    table = []
    for line in text[start:].splitlines()[1:]:
        if line.startswith("#"):
            break
        if line.startswith("| `"):
            table.append(line)
    out: set[str] = set()
    for row in table:
        first = row.split("|")[1]
        out.update(re.findall(r"`([^`]+)`", first))
    return out


def model_fields(model: type[Any]) -> set[str]:
    return {f.alias or name for name, f in model.model_fields.items()}


def test_plugin_table_matches_the_model_and_the_cases() -> None:
    documented = doc_fields("### `tabby` fields")
    cased = set(PLUGIN_CASES) | set(COMMON_CASES)
    assert documented - FREE_FORM == cased, "every documented field needs cases, and back"
    known = model_fields(PluginConf) - set(SECTION_CASES)
    known |= {f"container_settings.{f}" for f in model_fields(ContainerSettings)}
    known |= {f"ipam.{f}" for f in model_fields(IpamRef)}
    undocumented = known - documented - RESERVED
    assert not undocumented, (
        f"fields the plugin reads but docs/configuration.md does not list: {undocumented}"
    )


def test_ipam_table_matches_the_model_and_the_cases() -> None:
    documented = doc_fields("### `tabby-ipam` fields")
    assert documented == set(IPAM_CASES), "every documented field needs cases, and back"
    assert model_fields(IpamConf) - {"type"} == documented


def test_readme_says_which_fields_are_free_form() -> None:
    text = (ROOT / "docs" / "configuration.md").read_text()
    for field in FREE_FORM:
        row = next(line for line in text.splitlines() if line.startswith(f"| `{field}`"))
        assert "free-form" in row


# -- running the cases ------------------------------------------------------------------------


class Recorder:
    """Fake dataplane and IPAM for tabby that record every call."""

    def __init__(self) -> None:
        self.calls: list[str] = []

    def start(self, ipam_type: str, command: str, args: skel.CmdArgs) -> plugin.Pending:
        self.calls.append(f"ipam {command}")
        return lambda: {"cniVersion": args.cni_version, "ips": [{"address": "10.1.0.2/32"}]}

    def setup(self, spec: Any, addresses: Any = None) -> Any:
        from dataplane.model import SetupResult

        if addresses is not None:
            addresses()
        self.calls.append("setup")
        return SetupResult(
            spec.host_ifname, "ee:ee:ee:ee:ee:ee", 2, spec.ifname, "02:00:00:00:00:01", 3, ()
        )

    def added(self, *a: Any) -> None:
        self.calls.append("endpoint added")

    def __getattr__(self, name: str) -> Any:
        def call(*a: Any, **k: Any) -> None:
            self.calls.append(name)

        return call


def _set(conf: dict[str, Any], dotted: str, value: Any) -> dict[str, Any]:
    out = json.loads(json.dumps(conf))
    *path, last = dotted.split(".")
    node = out
    for part in path:
        node = node.setdefault(part, {})
        if not isinstance(node, dict):
            return out
    node[last] = value
    return out


def _env(command: str = "ADD") -> dict[str, str]:
    return {
        "CNI_COMMAND": command,
        "CNI_CONTAINERID": "c1",
        "CNI_NETNS": "/run/netns/x",
        "CNI_IFNAME": "eth0",
        "CNI_PATH": "/nonexistent",
    }


def _base(tmp_path: Path) -> dict[str, Any]:
    return {
        "cniVersion": "1.1.0",
        "name": "net1",
        "type": "tabby",
        "nodename": "node-a",
        "log_file_path": str(tmp_path / "cni.log"),
        "ipam": {"type": "tabby-ipam", "data_dir": str(tmp_path / "ipam")},
    }


def _run_tabby(config: dict[str, Any], command: str = "ADD") -> tuple[int, Any, list[str]]:
    rec = Recorder()
    handlers = plugin.Plugin(dataplane=lambda: rec, ipam=rec, endpoints=rec).handlers()  # type: ignore[arg-type,return-value]
    rc, out = skel.run(
        handlers,
        _env(command),
        json.dumps(config).encode(),
        before_dispatch=plugin.configure_logging,
    )
    return rc, json.loads(out) if out.strip() else None, rec.calls


def _run_ipam(config: dict[str, Any], command: str = "ADD") -> tuple[int, Any]:
    rc, out = skel.run(
        ipam_plugin.HANDLERS,
        _env(command),
        json.dumps(config).encode(),
        before_dispatch=ipam_plugin.configure_logging,
    )
    return rc, json.loads(out) if out.strip() else None


def _refused(rc: int, out: Any, field: str, code: int) -> None:
    assert rc == 1, f"{field}: accepted ({out})"
    assert out["code"] == code, out
    if code == 2:
        shown = field.split(".")[-1]
        assert shown in out["msg"], out


def _held(data_dir: Path) -> list[str]:
    """The handle of every allocation in the file store at ``data_dir``."""
    if not (data_dir / "blocks").exists():
        return []
    from datastore.file import FileStore
    from ipam.core import Ipam

    store = FileStore(str(data_dir), lock_timeout=5)
    try:
        return sorted({o.handle_id for o in Ipam(store, "").allocations()})
    finally:
        store.close()


def _nothing_allocated(tmp_path: Path) -> None:
    assert _held(tmp_path / "ipam") == []


def _cases(table: dict[str, list[tuple[Any, int]]]) -> list[Any]:
    return [
        pytest.param(f, v, code, id=f"{f}={json.dumps(v)[:24]}")
        for f, cases in table.items()
        for v, code in cases
    ]


@pytest.mark.parametrize(
    ("field", "value", "code"), _cases({**PLUGIN_CASES, **SECTION_CASES, **COMMON_CASES})
)
def test_tabby_refuses(tmp_path: Path, field: str, value: Any, code: int) -> None:
    rc, out, calls = _run_tabby(_set(_base(tmp_path), field, value))
    _refused(rc, out, field, code)
    # An ADD starts its IPAM call before it validates (overlap, see Plugin.add): a refused
    # configuration then gives the addresses back. The kernel is never touched.
    assert calls in ([], ["ipam ADD", "pod_interface_present", "ipam DEL"]), calls


@pytest.mark.parametrize(
    ("field", "value", "code"),
    _cases({**COMMON_CASES, **{f"ipam.{k}": v for k, v in IPAM_CASES.items()}}),
)
def test_tabby_ipam_refuses(tmp_path: Path, field: str, value: Any, code: int) -> None:
    config = _base(tmp_path)
    if field == "ipam.ipv6_pools":
        config["ipam"]["assign_ipv6"] = True
    rc, out = _run_ipam(_set(config, field, value))
    _refused(rc, out, field, code)
    _nothing_allocated(tmp_path)


def test_the_base_configuration_is_accepted(tmp_path: Path) -> None:
    """The cases above fail because of their one field, not because of the base."""
    rc, out, calls = _run_tabby(_base(tmp_path))
    assert rc == 0, out
    assert calls[0] == "ipam ADD"
    rc, out = _run_ipam(_base(tmp_path))
    assert rc == 0, out


@pytest.mark.parametrize(("value", "code"), GC_CASES)
def test_gc_valid_attachments_are_validated_in_both(tmp_path: Path, value: Any, code: int) -> None:
    config = {**_base(tmp_path), "cni.dev/valid-attachments": value}
    rc, out, calls = _run_tabby(config, "GC")
    _refused(rc, out, "cni.dev/valid-attachments", code)
    assert calls == []
    rc, out = _run_ipam(config, "GC")
    _refused(rc, out, "cni.dev/valid-attachments", code)


def test_nodename_file_with_garbage_is_refused(tmp_path: Path) -> None:
    """A node-name file that holds no node name would put the pod's block on a node that
    does not exist: refused (code 2, the file named), in both binaries."""
    bad = tmp_path / "nodename"
    bad.write_text("not a node name!\n")
    config = {**_base(tmp_path), "nodename_file": str(bad)}
    del config["nodename"]
    rc, out = _run_ipam(config)
    assert (rc, out["code"]) == (1, 2)
    assert str(bad) in out["msg"]
    _nothing_allocated(tmp_path)


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("log_level", "DEBUG"),
        ("ipam.assign_ipv4", "true"),
        ("ipam.assign_ipv6", "false"),
        ("ipam.etcd_endpoints", "http://a:2379, https://b:2379"),
        ("ipam.reserved", []),
        ("capabilities", {"anything": "goes"}),
        ("runtimeConfig", "not an object"),
        ("args", ["not", "an", "object"]),
        ("mtu", 0),
    ],
)
def test_documented_leniencies(tmp_path: Path, field: str, value: Any) -> None:
    """What docs/configuration.md documents as accepted (Calico's string booleans, a comma-separated
    endpoint list, case-insensitive log levels, free-form and reserved keys)."""
    config = _set(_base(tmp_path), field, value)
    rc, out, _ = _run_tabby(config)
    assert rc == 0, out
    rc, out = _run_ipam(config)
    assert rc == 0, out


# -- the DEL and GC columns: the same cases, tolerated (CONFORMANCE.md DEL-9) ------------------

#: What a DEL or GC cannot do when the field is invalid, because it derives from the field
#: (with the base configuration: a file store, ``nodename`` given). It does all the rest.
#: ``host veth``: the veth's name (tabby looks for none, only the pod side); ``endpoint``: the
#: WorkloadEndpoint's key or store; ``release``: the store DEL releases from; ``gc``: the
#: store, node and grace tabby-ipam's GC needs.
TEARDOWN_NEEDS: dict[str, set[str]] = {
    "veth_prefix": {"host veth"},
    "nodename": {"endpoint", "gc"},
    "ipam.datastore_type": {"endpoint", "release", "gc"},
    "ipam.data_dir": {"endpoint", "release", "gc"},
    "ipam.gc_grace_seconds": {"gc"},
}


class TeardownRecorder(Recorder):
    """The Recorder, also remembering what teardown was asked to remove and listing the host
    veths GC is to judge."""

    def __init__(self) -> None:
        super().__init__()
        self.torn_down: list[tuple[str, str | None]] = []
        self.veths: list[Any] = []

    def teardown(self, netns: Any, ifname: str, host_ifname: str | None, *a: Any) -> None:
        self.calls.append("teardown")
        self.torn_down.append((ifname, host_ifname))

    def list_host_veths(self, prefix: str) -> list[Any]:
        self.calls.append("list_host_veths")
        return self.veths


class Node:
    """tabby as tabby-node runs it, over a temporary file store: tabby-ipam in-process
    (``tabby_node.server.InProcessIpam``), WorkloadEndpoints in the store, a fake dataplane
    (:class:`TeardownRecorder`). Every store a call opens is recorded: a DEL must never open
    one its configuration does not name."""

    def __init__(self, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
        import stores as datastore
        from tabby_node.server import InProcessIpam

        self.data_dir = str(tmp_path / "ipam")
        self.dp = TeardownRecorder()
        self.opened: list[str] = []
        real_open = datastore.open_store

        def recording_open(settings: Any) -> Any:
            self.opened.append(settings.data_dir if settings.datastore_type == "file" else "?")
            return real_open(settings)

        monkeypatch.setattr(datastore, "open_store", recording_open)
        self.handlers = plugin.Plugin(
            dataplane=lambda: self.dp,
            ipam=InProcessIpam(),
            validate_first=True,
        ).handlers()

    def run(self, config: dict[str, Any], command: str) -> tuple[int, Any]:
        rc, out = skel.run(
            self.handlers,
            _env(command),
            json.dumps(config).encode(),
            before_dispatch=plugin.configure_logging,
        )
        return rc, json.loads(out) if out.strip() else None

    def add(self, config: dict[str, Any]) -> str:
        """A real ADD with the good configuration; the host veth's name."""
        from dataplane.model import HostVeth

        rc, out = self.run(config, "ADD")
        assert rc == 0, out
        assert self.handles()
        assert self.endpoints()
        host = str(out["interfaces"][0]["name"])
        self.dp.veths = [HostVeth(host, 2, True, plugin.attachment_alias(_args(config)), ())]
        self.dp.calls.clear()
        self.opened.clear()
        return host

    def handles(self) -> list[str]:
        return _held(Path(self.data_dir))

    def endpoints(self) -> list[str]:
        return _listing(Path(self.data_dir) / "workloadendpoints")


def _listing(directory: Path) -> list[str]:
    return sorted(p.name for p in directory.rglob("*.json")) if directory.exists() else []


def _args(config: dict[str, Any]) -> skel.CmdArgs:
    return skel.build_args(_env(), json.dumps(config).encode())


def _tolerated(rc: int, out: Any, field: str) -> None:
    assert (rc, out) == (0, None), f"{field}: {out}"


def _only_the_named_store(node: Node, needs: set[str]) -> None:
    """Either the store the configuration names, or none at all: never the default's."""
    if "release" in needs:
        assert node.opened == [], node.opened
    assert set(node.opened) <= {node.data_dir}, node.opened


@pytest.mark.parametrize(
    ("field", "value", "code"), _cases({**PLUGIN_CASES, **SECTION_CASES, **COMMON_CASES})
)
def test_tabby_del_tolerates(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, field: str, value: Any, code: int
) -> None:
    """DEL column: after a real ADD with the good configuration, a DEL whose configuration
    has the field's bad value succeeds and removes what does not depend on the field; a
    structural problem (code 7) still fails, and touches nothing."""
    node = Node(tmp_path, monkeypatch)
    good = _base(tmp_path)
    host = node.add(good)
    rc, out = node.run(_set(good, field, value), "DEL")
    if code == 7:
        assert (rc, out["code"]) == (1, 7), out
        assert node.dp.calls == []
        assert node.opened == []
        assert node.handles()
        assert node.endpoints()
        return
    _tolerated(rc, out, field)
    needs = TEARDOWN_NEEDS.get(field, set())
    assert node.dp.torn_down == [("eth0", None if "host veth" in needs else host)]
    assert bool(node.endpoints()) is ("endpoint" in needs), node.endpoints()
    assert bool(node.handles()) is ("release" in needs), node.handles()
    _only_the_named_store(node, needs)


@pytest.mark.parametrize(
    ("field", "value", "code"), _cases({**PLUGIN_CASES, **SECTION_CASES, **COMMON_CASES})
)
def test_tabby_gc_tolerates(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, field: str, value: Any, code: int
) -> None:
    """GC column: with every attachment stale (an empty valid list), a GC whose configuration
    has the field's bad value removes the host veth and (through tabby-ipam) the allocation,
    except what depends on the field."""
    node = Node(tmp_path, monkeypatch)
    good = {**_base(tmp_path), "cni.dev/valid-attachments": []}
    host = node.add(good)
    rc, out = node.run(_set(good, field, value), "GC")
    if code == 7:
        assert (rc, out["code"]) == (1, 7), out
        assert node.dp.calls == []
        assert node.handles()
        return
    _tolerated(rc, out, field)
    needs = TEARDOWN_NEEDS.get(field, set())
    removed = [c for c in node.dp.calls if c == "delete_host_veth"]
    assert removed == ([] if "host veth" in needs else ["delete_host_veth"]), host
    assert bool(node.handles()) is ("gc" in needs), node.handles()
    _only_the_named_store(node, needs)


def _ipam_good(tmp_path: Path, field: str) -> dict[str, Any]:
    config = _base(tmp_path)
    if field == "ipam.ipv6_pools":
        config["ipam"]["assign_ipv6"] = True
    return config


def _ipam_handles(tmp_path: Path) -> list[str]:
    return _held(tmp_path / "ipam")


@pytest.mark.parametrize(
    ("field", "value", "code"),
    _cases({**COMMON_CASES, **{f"ipam.{k}": v for k, v in IPAM_CASES.items()}}),
)
def test_tabby_ipam_del_tolerates(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, field: str, value: Any, code: int
) -> None:
    """DEL column of tabby-ipam: after a real ADD, a DEL with the field's bad value releases
    the allocation by its handle, unless the field says which store it is in."""
    good = _ipam_good(tmp_path, field)
    assert _run_ipam(good)[0] == 0
    assert _ipam_handles(tmp_path)
    node = Node(tmp_path, monkeypatch)  # records the stores opened
    rc, out = _run_ipam(_set(good, field, value), "DEL")
    _tolerated(rc, out, field)
    needs = TEARDOWN_NEEDS.get(field, set())
    assert bool(_ipam_handles(tmp_path)) is ("release" in needs)
    _only_the_named_store(node, needs)


@pytest.mark.parametrize(
    ("field", "value", "code"),
    _cases({**COMMON_CASES, **{f"ipam.{k}": v for k, v in IPAM_CASES.items()}}),
)
def test_tabby_ipam_gc_tolerates(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, field: str, value: Any, code: int
) -> None:
    """GC column of tabby-ipam: every attachment stale; the allocation is released unless the
    store, the node or the grace it would be judged by comes from the bad field."""
    good = {**_ipam_good(tmp_path, field), "cni.dev/valid-attachments": []}
    assert _run_ipam(good)[0] == 0
    node = Node(tmp_path, monkeypatch)
    rc, out = _run_ipam(_set(good, field, value), "GC")
    _tolerated(rc, out, field)
    needs = TEARDOWN_NEEDS.get(field, set())
    assert bool(_ipam_handles(tmp_path)) is ("gc" in needs)
    if "gc" in needs:
        assert node.opened == []
    assert set(node.opened) <= {node.data_dir}


def test_the_teardown_needs_name_fields_of_the_tables() -> None:
    assert set(TEARDOWN_NEEDS) <= set(PLUGIN_CASES) | set(COMMON_CASES) | {
        f"ipam.{k}" for k in IPAM_CASES
    }


@pytest.mark.parametrize(
    ("stdin", "code"),
    [
        (b"not json", 6),
        (b'{"cniVersion": "1.1.0", "type": "tabby", "ipam": {"type": "tabby-ipam"}}', 7),
        (b'{"cniVersion": "1.1.0", "name": "net1", "type": "tabby"}', 7),
        (b'{"cniVersion": "1.1.0", "name": "net1", "ipam": {"data_dir": "/tmp/x"}}', 7),
        (b'{"cniVersion": "1.1.0", "name": "net1", "ipam": "tabby-ipam"}', 7),
    ],
    ids=["not-json", "no-name", "no-ipam", "no-ipam-type", "ipam-not-an-object"],
)
def test_structural_problems_still_fail_del(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, stdin: bytes, code: int
) -> None:
    """The configuration names no plugin or network: DEL fails with the code ADD has."""
    node = Node(tmp_path, monkeypatch)
    rc, out = skel.run(node.handlers, _env("DEL"), stdin, before_dispatch=plugin.configure_logging)
    assert (rc, json.loads(out)["code"]) == (1, code)
    assert node.dp.calls == []
    assert node.opened == []
