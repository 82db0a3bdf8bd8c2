"""tabby-ipam's CNI adapter (ipam/plugin.py) in-process over a temporary file store: the
request decoding (specific IPs, pod-annotation pools), the verbs, and the mapping of the IPAM
core's errors to CNI codes at the edge. Rule IDs: cni_protocol/CONFORMANCE.md."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from cni_protocol import skel
from ipam import cni_codes
from ipam import plugin as ipam_plugin
from ipam.core import (
    AddressUnavailable,
    DatastoreError,
    InvalidConfig,
    Ipam,
    LockTimeout,
    NoAddressAvailable,
    RevisionConflict,
    StoreCorrupt,
    StoreUnavailable,
)

NET = "net1"
ANN = "io.kubernetes.cri.pod-annotations"


class Call:
    def __init__(self, tmp_path: Path) -> None:
        self.data_dir = tmp_path / "ipam"
        self.ipam: dict[str, Any] = {
            "type": "tabby-ipam",
            "data_dir": str(self.data_dir),
            "ipv4_pools": ["10.1.0.0/24"],
            "ipv6_pools": ["fd01::/120"],
            "block_size_ipv4": 28,
            "block_size_ipv6": 124,
        }

    def conf(self, **extra: Any) -> dict[str, Any]:
        ipam = {**self.ipam, **extra.pop("ipam", {})}
        return {
            "cniVersion": "1.1.0",
            "name": NET,
            "type": "tabby",
            "nodename": "node-a",
            "log_file_path": str(self.data_dir.parent / "cni.log"),
            "ipam": ipam,
            **extra,
        }

    def __call__(
        self, command: str, conf: dict[str, Any] | None = None, cid: str = "c1", **env: str
    ) -> tuple[int, Any]:
        base = {
            "CNI_COMMAND": command,
            "CNI_CONTAINERID": cid,
            "CNI_NETNS": "/run/netns/x",
            "CNI_IFNAME": "eth0",
            "CNI_PATH": "/opt/cni/bin",
            **env,
        }
        rc, out = skel.run(
            ipam_plugin.HANDLERS,
            base,
            json.dumps(conf or self.conf()).encode(),
            before_dispatch=ipam_plugin.configure_logging,
        )
        return rc, json.loads(out) if out.strip() else None

    def ips(self, out: dict[str, Any]) -> list[str]:
        return [ip["address"] for ip in out["ips"]]


@pytest.fixture
def call(tmp_path: Path) -> Call:
    return Call(tmp_path)


def test_add_returns_ips_only_and_del_releases(call: Call) -> None:
    rc, out = call("ADD")
    assert rc == 0, out
    assert set(out) == {"cniVersion", "ips"}
    (addr,) = call.ips(out)
    assert addr.startswith("10.1.0.")
    assert addr.endswith("/32")
    rc, again = call("ADD")
    assert call.ips(again) == [addr], "a repeated ADD gets what it has (ADD-7)"
    assert call("DEL") == (0, None)
    assert call("DEL") == (0, None), "DEL is idempotent (DEL-1)"
    rc, out = call("ADD", cid="c2")
    assert rc == 0


def test_dual_stack_all_or_nothing(call: Call) -> None:
    rc, out = call("ADD", call.conf(ipam={"assign_ipv6": True}))
    assert rc == 0, out
    v4, v6 = call.ips(out)
    assert v4.endswith("/32")
    assert v6.endswith("/128")
    assert v6.startswith("fd01::")


@pytest.mark.parametrize(
    ("where", "expected"),
    [
        ("runtimeConfig", "10.1.0.7/32"),
        ("args", "10.1.0.8/32"),
        ("cni_args", "10.1.0.9/32"),
    ],
)
def test_specific_ips_in_priority_order(call: Call, where: str, expected: str) -> None:
    """runtimeConfig.ips > args.cni.ips > CNI_ARGS IP= (IPM-12): each source beats the
    lower ones that are present too."""
    conf = call.conf(args={"cni": {"ips": ["10.1.0.8"]}})
    env = {"CNI_ARGS": "IP=10.1.0.9"}
    if where == "runtimeConfig":
        conf["runtimeConfig"] = {"ips": ["10.1.0.7/24"]}
    if where == "cni_args":
        del conf["args"]
    rc, out = call("ADD", conf, **env)
    assert rc == 0, out
    assert call.ips(out) == [expected]


def test_runtime_config_ips_only_when_declared(call: Call) -> None:
    """CAP-3: a capability the plugin did not declare is not consumed."""
    conf = call.conf(capabilities={"mac": True}, runtimeConfig={"ips": ["10.1.0.7"]})
    rc, out = call("ADD", conf)
    assert rc == 0
    assert call.ips(out) != ["10.1.0.7/32"]
    conf["capabilities"] = {"ips": True}
    rc, out = call("ADD", conf, cid="c2")
    assert call.ips(out) == ["10.1.0.7/32"]


def test_specific_ip_taken_is_102_and_allocates_nothing(call: Call) -> None:
    conf = call.conf(runtimeConfig={"ips": ["10.1.0.7"]})
    assert call("ADD", conf)[0] == 0
    rc, out = call("ADD", conf, cid="c2")
    assert (rc, out["code"]) == (1, 102)
    assert call("DEL", cid="c2") == (0, None)


@pytest.mark.parametrize("bad", [["not-an-ip"], "10.1.0.7", [7]])
def test_bad_specific_ips_are_code_7(call: Call, bad: Any) -> None:
    rc, out = call("ADD", call.conf(runtimeConfig={"ips": bad}))
    assert (rc, out["code"]) == (1, 7)


@pytest.mark.parametrize("prefix", ["tabby.io", "cni.projectcalico.org"])
def test_pod_annotation_pools_and_addresses(call: Call, prefix: str) -> None:
    """Pod annotations (and Calico's aliases) choose pools or addresses per pod."""
    conf = call.conf(ipam={"ipv4_pools": ["10.1.0.0/24", "10.2.0.0/24"]})
    conf["runtimeConfig"] = {ANN: {f"{prefix}/ipv4pools": '["10.2.0.0/24"]'}}
    rc, out = call("ADD", conf)
    assert rc == 0, out
    assert call.ips(out)[0].startswith("10.2.0.")
    conf["runtimeConfig"] = {ANN: {f"{prefix}/ipAddrs": '["10.1.0.33"]'}}
    rc, out = call("ADD", conf, cid="c2")
    assert call.ips(out) == ["10.1.0.33/32"]


@pytest.mark.parametrize(
    "annotations",
    [
        {"tabby.io/ipv4pools": "not json"},
        {"tabby.io/ipv4pools": '{"a": 1}'},
        {"tabby.io/ipv4pools": '["fd00::/64"]'},
        {"tabby.io/ipv4pools": '["x"]'},
        {"tabby.io/ipAddrs": '["x"]'},
    ],
)
def test_bad_pod_annotations_are_code_7(call: Call, annotations: dict[str, str]) -> None:
    rc, out = call("ADD", call.conf(runtimeConfig={ANN: annotations}))
    assert (rc, out["code"]) == (1, 7)


def test_check_compares_the_handle_with_prev_result(call: Call) -> None:
    rc, out = call("ADD")
    prev = {"cniVersion": "1.1.0", "ips": out["ips"]}
    assert call("CHECK", call.conf(prevResult=prev)) == (0, None)
    other = {"cniVersion": "1.1.0", "ips": [{"address": "10.1.0.250/32"}]}
    rc, err = call("CHECK", call.conf(prevResult=other))
    assert (rc, err["code"]) == (1, 3)
    call("DEL")
    rc, err = call("CHECK", call.conf(prevResult=prev))
    assert (rc, err["code"]) == (1, 3)
    rc, err = call("CHECK")
    assert (rc, err["code"]) == (1, 7), "CHECK needs prevResult"


def test_gc_releases_what_is_not_valid(call: Call) -> None:
    for cid in ("c1", "c2", "c3"):
        assert call("ADD", cid=cid)[0] == 0
    valid = [{"containerID": "c2", "ifname": "eth0"}]
    conf = call.conf(**{"cni.dev/valid-attachments": valid})
    assert call("GC", conf, cid="") == (0, None)
    from datastore.file import FileStore

    held = Ipam(FileStore(str(call.data_dir)), "").allocations()
    assert [o.handle_id for o in held] == [f"{NET}:c2:eth0"]
    assert call("GC", call.conf(), cid="") == (0, None), "absent key deletes nothing"


def test_status(call: Call) -> None:
    assert call("STATUS", cid="") == (0, None)
    full = call.conf(ipam={"ipv4_pools": ["10.9.0.0/30"], "block_size_ipv4": 30})
    for cid in ("a", "b", "c", "d"):
        call("ADD", full, cid=cid)
    rc, out = call("STATUS", full, cid="")
    assert (rc, out["code"]) == (1, 50)
    rc, out = call("STATUS", call.conf(ipam={"block_size_ipv4": 99}), cid="")
    assert (rc, out["code"]) == (1, 50), "an unusable configuration cannot serve ADD"


def test_pool_exhausted_is_100(call: Call) -> None:
    small = call.conf(ipam={"ipv4_pools": ["10.9.0.0/30"], "block_size_ipv4": 30})
    codes = [call("ADD", small, cid=f"c{i}") for i in range(5)]
    assert [rc for rc, _ in codes[:4]] == [0, 0, 0, 0]
    assert (codes[4][0], codes[4][1]["code"]) == (1, 100)


@pytest.mark.parametrize(
    ("error", "code"),
    [
        (InvalidConfig("x"), 7),
        (NoAddressAvailable("x"), 100),
        (AddressUnavailable("x"), 102),
        (RevisionConflict("x"), 11),
        (StoreCorrupt("/p", "bad"), 101),
        (StoreUnavailable("/p", "ro"), 11),
        (LockTimeout("/p", "held"), 11),
        (DatastoreError("x"), 999),
    ],
)
def test_core_errors_get_their_codes_at_the_edge(error: DatastoreError, code: int) -> None:
    """The core's errors know nothing of CNI; the adapter's table maps them."""
    err = cni_codes.to_cni_error(error)
    assert err.code == code
    assert str(error) in err.details


def test_every_core_error_class_is_mapped() -> None:
    import ipam.core.errors as errors

    classes = [
        c
        for c in vars(errors).values()
        if isinstance(c, type) and issubclass(c, DatastoreError) and c not in (DatastoreError,)
    ]
    for cls in classes:
        assert any(k in cni_codes.CODES for k in cls.__mro__), cls


def test_corrupt_index_is_101_naming_the_file(call: Call) -> None:
    """DEL finds the attachment's addresses through its node's index: an unreadable index
    (or block) is code 101, naming the file."""
    call("ADD")
    index = next((call.data_dir / "affinities").iterdir())
    index.write_text("{truncated")
    rc, out = call("DEL")
    assert (rc, out["code"]) == (1, 101)
    assert str(index) in out["details"]


def test_del_lets_the_pod_go_when_the_api_refuses_the_credentials(
    call: Call, tmp_path: Path
) -> None:
    """After an uninstall (the plugins' token revoked) a DEL answers 0 and says what it left
    for the controllers' GC; an ADD is refused with code 7, naming the refusal."""
    from tests.kube_fake import fake_api, write_kubeconfig

    with fake_api() as (fake, url):
        kubeconfig = write_kubeconfig(str(tmp_path / "kubeconfig"), url)
        conf = call.conf(
            ipam={"datastore_type": "kubernetes", "kubeconfig": kubeconfig, "ipv6_pools": []}
        )
        rc, out = call("ADD", conf)
        assert rc == 0, out
        fake.unauthorized = True
        log_before = (tmp_path / "cni.log").read_text()
        assert call("DEL", conf) == (0, None)
        logged = (tmp_path / "cni.log").read_text()[len(log_before) :]
        assert "refused tabby's credentials (401" in logged
        assert "leak" in logged
        rc, out = call("ADD", conf, cid="c2")
        assert rc == 1
        assert out["code"] == 7
        assert "refused tabby's credentials (401" in out["details"]
