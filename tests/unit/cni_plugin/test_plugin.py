"""tabby's verbs with a fake dataplane and a fake IPAM (the ADD, DEL, CHECK, STATUS, GC, IPAM
delegation and chaining rules of cni_protocol/CONFORMANCE.md)."""

from __future__ import annotations

import dataclasses
import errno
import ipaddress
import json
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from cni_plugin import plugin
from cni_protocol import phases, skel
from cni_protocol.errors import CniError
from dataplane.errors import (
    CheckMismatch,
    InterfaceConflict,
    InvalidNetNS,
    InvalidVethPrefix,
    NetlinkFailure,
    NetNSNotFound,
    SysctlFailure,
)
from dataplane.names import host_veth_name
from tests.conftest import ALL_SPEC_VERSIONS

V6GW = ipaddress.IPv6Address("fe80::ecee:eeff:feee:eeee")


class FakeDataplane:
    """Implements the ``Dataplane`` protocol the plugin is given (no kernel); it fails as
    the kernel's does, with the dataplane's errors."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, Any]] = []
        self.fail_setup: Exception | None = None
        #: raised by setup before it asks for the addresses (the namespace cannot be opened)
        self.fail_open: Exception | None = None
        self.fail_teardown: Exception | None = None
        self.fail_check: Exception | None = None
        self.fail_list: Exception | None = None
        self.fail_delete: Exception | None = None
        self.veths: list[Any] = []
        self.live = False

    def setup(self, spec: Any, addresses: Any = None) -> Any:
        # As the kernel's: the addresses are asked for while the pair is made, and a
        # failure of the pair or its configuration comes after.
        if self.fail_open:
            raise self.fail_open
        if addresses is not None:
            spec = dataclasses.replace(spec, addresses=tuple(addresses()))
        self.calls.append(("setup", spec))
        if self.fail_setup:
            raise self.fail_setup
        routes = []
        if any(a.version == 4 for a in spec.addresses):
            routes.append(
                SimpleNamespace(dst=ipaddress.ip_network("169.254.1.1/32"), gw=None, scope=253)
            )
            routes.append(
                SimpleNamespace(
                    dst=ipaddress.ip_network("0.0.0.0/0"),
                    gw=ipaddress.ip_address("169.254.1.1"),
                    scope=0,
                )
            )
        if any(a.version == 6 for a in spec.addresses):
            routes.append(SimpleNamespace(dst=ipaddress.ip_network("::/0"), gw=V6GW, scope=0))
        return SimpleNamespace(
            host_ifname=spec.host_ifname,
            host_mac="ee:ee:ee:ee:ee:ee",
            container_mac="02:11:22:33:44:55",
            routes=routes,
        )

    def teardown(
        self, netns: str | None, ifname: str, host_ifname: str | None, addresses: Any
    ) -> None:
        self.calls.append(("teardown", (netns, ifname, host_ifname, addresses)))
        if self.fail_teardown:
            raise self.fail_teardown

    def check(self, spec: Any, expected: Any) -> None:
        self.calls.append(("check", (spec, expected)))
        if self.fail_check:
            raise self.fail_check

    def list_host_veths(self, prefix: str) -> list[Any]:
        if self.fail_list:
            raise self.fail_list
        return self.veths

    def delete_host_veth(self, name: str) -> None:
        self.calls.append(("delete_host_veth", name))
        if self.fail_delete:
            raise self.fail_delete

    def pod_interface_present(self, netns_path: str, ifname: str) -> bool:
        self.calls.append(("pod_interface_present", (netns_path, ifname)))
        return self.live


class FakeIpam:
    """Implements the ``IpamInvoker`` protocol the plugin is given (no process)."""

    def __init__(self) -> None:
        self.calls: list[str] = []
        self.result: dict[str, Any] = {
            "ips": [{"address": "10.244.0.5/32"}, {"address": "fd00:10:244::5/128"}]
        }
        self.fail: dict[str, CniError] = {}

    def start(self, ipam_type: str, command: str, args: skel.CmdArgs) -> plugin.Pending:
        self.calls.append(command)

        def wait() -> dict[str, Any] | None:
            if command in self.fail:
                raise self.fail[command]
            return {"cniVersion": args.cni_version, **self.result} if command == "ADD" else None

        return wait


class FakeEndpoints:
    """Implements the ``EndpointRecorder`` protocol (no datastore)."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, Any]] = []
        self.fail: dict[str, CniError] = {}

    def added(self, args: skel.CmdArgs, conf: Any, addresses: Any, host_ifname: str) -> None:
        self.calls.append(("added", ([str(a) for a in addresses], host_ifname)))
        if "added" in self.fail:
            raise self.fail["added"]

    def removed(self, args: skel.CmdArgs, conf: Any) -> None:
        self.calls.append(("removed", args.container_id))
        if "removed" in self.fail:
            raise self.fail["removed"]


HANDLERS: list[skel.Handlers] = []
ENDPOINTS: list[FakeEndpoints] = []


@pytest.fixture
def fakes() -> Iterator[tuple[FakeDataplane, FakeIpam]]:
    dp, ipam, eps = FakeDataplane(), FakeIpam(), FakeEndpoints()
    HANDLERS.append(plugin.Plugin(dataplane=lambda: dp, ipam=ipam, endpoints=eps).handlers())
    ENDPOINTS.append(eps)
    yield dp, ipam
    HANDLERS.clear()
    ENDPOINTS.clear()


def conf(version: str = "1.1.0", **extra: Any) -> dict[str, Any]:
    return {
        "cniVersion": version,
        "name": "net1",
        "type": "tabby",
        "ipam": {"type": "tabby-ipam"},
        **extra,
    }


def run(command: str, config: dict[str, Any], **env: str) -> tuple[int, Any]:
    rc, out = run_raw(command, config, **env)
    return rc, (json.loads(out) if out.strip() else None)


def run_raw(command: str, config: dict[str, Any], **env: str) -> tuple[int, bytes]:
    """The call's exit status and stdout, byte for byte."""
    base = {
        "CNI_COMMAND": command,
        "CNI_CONTAINERID": "c1",
        "CNI_NETNS": "/run/netns/p1",
        "CNI_IFNAME": "eth0",
        "CNI_PATH": "/opt/cni/bin",
        **env,
    }
    base = {k: v for k, v in base.items() if v != "<unset>"}
    return skel.run(HANDLERS[-1], base, json.dumps(config).encode())


@pytest.mark.parametrize("version", ALL_SPEC_VERSIONS)
def test_add_result_shape(fakes: tuple[FakeDataplane, FakeIpam], version: str) -> None:
    """ADD-3, GEN-8, CHN-3: both interfaces, IPs on the container side, routes programmed."""
    dp, ipam = fakes
    rc, out = run("ADD", conf(version))
    assert rc == 0, out
    assert out["cniVersion"] == version
    host, pod = out["interfaces"]
    assert "sandbox" not in host
    assert pod == {**pod, "name": "eth0", "sandbox": "/run/netns/p1", "mac": "02:11:22:33:44:55"}
    assert [ip["address"] for ip in out["ips"]] == ["10.244.0.5/32", "fd00:10:244::5/128"]
    assert all(ip["interface"] == 1 for ip in out["ips"])
    assert ("version" in out["ips"][0]) is (version < "1.0.0")
    assert {"dst": "0.0.0.0/0", "gw": "169.254.1.1"} in out["routes"]
    assert {"dst": "::/0", "gw": str(V6GW)} in out["routes"]
    assert ("mtu" in host) is (version == "1.1.0")
    spec = dp.calls[0][1]
    assert [str(a) for a in spec.addresses] == ["10.244.0.5", "fd00:10:244::5"]
    assert spec.host_ifname.startswith("cali")
    assert len(spec.host_ifname) <= 15
    assert ipam.calls == ["ADD"]


def test_add_and_del_time_their_phases(fakes: tuple[FakeDataplane, FakeIpam]) -> None:
    """tabby-node's per-phase times (``cni_protocol.phases``): the IPAM, the kernel side
    (and what the call waited of it), the endpoint beside the kernel side (and what the
    call waited of it)."""
    for command, want in (
        ("ADD", {"ipam", "netlink", "netlink_wait", "endpoint", "endpoint_wait", "server"}),
        ("DEL", {"ipam", "netlink", "netlink_wait", "endpoint", "endpoint_wait", "server"}),
    ):
        phases.begin()
        rc, out = run(command, conf())
        got = phases.end(60.0)
        assert rc == 0, out
        assert set(got) == want, command
        assert got["server"] < 60.0
        assert got["endpoint_wait"] <= got["endpoint"] + 0.001
        assert got["netlink_wait"] <= got["netlink"] + 0.001


def test_add_keeps_prev_result(fakes: tuple[FakeDataplane, FakeIpam]) -> None:
    """ADD-4: earlier interfaces keep their indexes; ours are appended."""
    prev = {
        "cniVersion": "1.0.0",
        "interfaces": [{"name": "x0"}],
        "ips": [{"address": "192.168.9.9/24", "interface": 0}],
    }
    rc, out = run("ADD", conf("1.0.0", prevResult=prev))
    assert rc == 0, out
    assert out["interfaces"][0] == {"name": "x0"}
    assert out["ips"][0] == {"address": "192.168.9.9/24", "interface": 0}
    assert all(ip["interface"] == 2 for ip in out["ips"][1:])


def test_add_rolls_back_ipam_when_dataplane_fails(fakes: tuple[FakeDataplane, FakeIpam]) -> None:
    """ADD-5: a failure after IPAM succeeded runs IPAM DEL, then reports the error."""
    dp, ipam = fakes
    dp.fail_setup = NetlinkFailure("add route 0.0.0.0/0", "pod", errno.EPERM)
    rc, out = run("ADD", conf())
    assert rc == 1
    assert out["code"] == 103
    assert ipam.calls == ["ADD", "DEL"]


def test_add_with_no_ips_is_an_error_and_releases(fakes: tuple[FakeDataplane, FakeIpam]) -> None:
    """ADD-8."""
    dp, ipam = fakes
    ipam.result = {"ips": []}
    rc, out = run("ADD", conf())
    assert rc == 1
    assert out["code"] == 104
    assert ipam.calls == ["ADD", "DEL"]
    assert not [c for c in dp.calls if c[0] == "setup"]


def test_add_ipam_error_passes_through(fakes: tuple[FakeDataplane, FakeIpam]) -> None:
    """IPM-4: the delegate's code is kept; nothing to roll back."""
    dp, ipam = fakes
    ipam.fail["ADD"] = CniError(100, "no address available", "pool full")
    rc, out = run("ADD", conf())
    assert (rc, out["code"], out["msg"]) == (1, 100, "no address available")
    assert ipam.calls == ["ADD"]
    assert dp.calls == []


@pytest.mark.parametrize("mac", ["zz:00:00:00:00:00", "01:00:00:00:00:01", 5])
def test_bad_mac_capability_is_rejected_and_nothing_is_left(
    fakes: tuple[FakeDataplane, FakeIpam], mac: Any
) -> None:
    """ADD-10. The IPAM call starts before validation (they overlap); a refused ADD gives
    the address back and never touches the kernel."""
    dp, ipam = fakes
    rc, out = run("ADD", conf(runtimeConfig={"mac": mac}))
    assert (rc, out["code"]) == (1, 7)
    assert ipam.calls == ["ADD", "DEL"]
    assert [c[0] for c in dp.calls] == ["pod_interface_present"]


def test_refused_repeated_add_of_a_live_pod_keeps_its_addresses(
    fakes: tuple[FakeDataplane, FakeIpam],
) -> None:
    """A repeated ADD (same attachment) with a configuration refused after the overlapped
    IPAM call got the running pod's own addresses back: releasing them would hand them out
    twice, so they are kept."""
    dp, ipam = fakes
    dp.live = True
    rc, out = run("ADD", conf(mtu=5))
    assert (rc, out["code"]) == (1, 2)
    assert ipam.calls == ["ADD"]


def test_add_whose_namespace_cannot_be_opened_gives_back_the_overlapped_ipam(
    fakes: tuple[FakeDataplane, FakeIpam],
) -> None:
    """The binaries start the IPAM call first: a namespace that is gone fails the ADD
    before the dataplane asks for the addresses, which are given back."""
    dp, ipam = fakes
    dp.fail_open = NetNSNotFound("/run/netns/p1")
    rc, out = run("ADD", conf())
    assert (rc, out["code"]) == (1, 3)
    assert ipam.calls == ["ADD", "DEL"]
    assert ENDPOINTS[-1].calls == []


@pytest.fixture
def served() -> Iterator[tuple[FakeDataplane, FakeIpam, FakeEndpoints]]:
    """The handlers as tabby-node runs them: the configuration validated first, the IPAM
    call in-process (started when the dataplane asks for the addresses)."""
    dp, ipam, eps = FakeDataplane(), FakeIpam(), FakeEndpoints()
    HANDLERS.append(
        plugin.Plugin(
            dataplane=lambda: dp, ipam=ipam, endpoints=eps, validate_first=True
        ).handlers()
    )
    yield dp, ipam, eps
    HANDLERS.clear()


def test_served_add_asks_ipam_only_once_the_namespace_is_open(
    served: tuple[FakeDataplane, FakeIpam, FakeEndpoints],
) -> None:
    """tabby-node (IPAM beside the pair): a namespace that is gone fails the ADD before any
    address is allocated; a pair that fails after gives the addresses back."""
    dp, ipam, eps = served
    dp.fail_open = NetNSNotFound("/run/netns/p1")
    rc, out = run("ADD", conf())
    assert (rc, out["code"]) == (1, 3)
    assert ipam.calls == []
    dp.fail_open = None
    dp.fail_setup = NetlinkFailure("add route 0.0.0.0/0", "pod", errno.EPERM)
    rc, out = run("ADD", conf())
    assert (rc, out["code"]) == (1, 103)
    assert ipam.calls == ["ADD", "DEL"]
    assert [c[0] for c in eps.calls] == ["added", "removed"]


def test_tabby_node_validates_before_the_ipam_call(
    served: tuple[FakeDataplane, FakeIpam, FakeEndpoints],
) -> None:
    """Where the models are warm (tabby-node), an invalid configuration never reaches IPAM."""
    dp, ipam, _ = served
    rc, out = run("ADD", conf(mtu=5))
    assert (rc, out["code"]) == (1, 2)
    assert ipam.calls == []
    assert dp.calls == []


@pytest.mark.parametrize("present", [True, False])
def test_an_unserved_add_is_refused_while_the_policy_table_is_there(present: bool) -> None:
    """The binaries' ADD (tabby-node did not serve it) while tabby-node's table is on the
    node: code 11 before anything is done (the table would drop the pod's traffic); without
    the table the pod is networked in-process. DEL is never refused."""
    dp, ipam = FakeDataplane(), FakeIpam()
    handlers = plugin.Plugin(
        dataplane=lambda: dp, ipam=ipam, endpoints=FakeEndpoints(), policy_table=lambda: present
    ).handlers()
    env = {
        "CNI_CONTAINERID": "c1",
        "CNI_NETNS": "/run/netns/p1",
        "CNI_IFNAME": "eth0",
        "CNI_PATH": "/opt/cni/bin",
    }
    rc, out = skel.run(handlers, {**env, "CNI_COMMAND": "ADD"}, json.dumps(conf()).encode())
    answer = json.loads(out)
    if present:
        assert (rc, answer["code"]) == (1, 11)
        assert answer["msg"].startswith("tabby-node is not running")
        assert "nft delete table inet tabby" in answer["details"]
        assert (ipam.calls, dp.calls) == ([], [])
    else:
        assert rc == 0, answer
        assert ipam.calls == ["ADD"]
    rc, out = skel.run(handlers, {**env, "CNI_COMMAND": "DEL"}, json.dumps(conf()).encode())
    assert rc == 0, out


def test_the_binaries_look_for_the_table_and_tabby_node_does_not() -> None:
    from tabby_node.server import node_handlers

    for handlers, check in (
        (plugin.HANDLERS, plugin.policy_table_present),
        (plugin.unserved_handlers(node_absent=True), plugin.policy_table_present),
        # a tabby-node is there but did not take the call: it programs the pod itself
        (plugin.unserved_handlers(node_absent=False), None),
        (node_handlers(), None),
    ):
        add = handlers.by_verb["ADD"]
        assert isinstance(add.__self__, plugin.Plugin)  # type: ignore[attr-defined]
        assert add.__self__.policy_table is check  # type: ignore[attr-defined]


def test_mac_capability_is_used(fakes: tuple[FakeDataplane, FakeIpam]) -> None:
    dp, _ = fakes
    rc, _ = run("ADD", conf(runtimeConfig={"MAC": "0A:58:0A:F4:00:05"}))
    assert rc == 0
    assert dp.calls[0][1].mac == "0a:58:0a:f4:00:05"


def test_mac_not_declared_is_ignored(fakes: tuple[FakeDataplane, FakeIpam]) -> None:
    """CAP-3/ADD-10: a capability not declared is not consumed."""
    dp, _ = fakes
    rc, _ = run("ADD", conf(capabilities={"ips": True}, runtimeConfig={"mac": "0a:58:0a:f4:00:05"}))
    assert rc == 0
    assert dp.calls[0][1].mac is None


@pytest.mark.parametrize(
    ("field", "value", "code"),
    [
        ("mtu", 10, 2),
        ("mtu", "x", 2),
        ("veth_prefix", "toolong", 2),
        ("veth_prefix", "a/b", 2),
        ("ipam", {"type": "../x"}, 7),
        ("ipam", {}, 7),
        ("container_settings", {"allow_ip_forwarding": "maybe"}, 2),
    ],
)
def test_bad_known_fields(
    fakes: tuple[FakeDataplane, FakeIpam], field: str, value: Any, code: int
) -> None:
    """GEN-11: code 2 names field and value; CFG-4: ipam.type without path characters."""
    rc, out = run("ADD", {**conf(), field: value})
    assert (rc, out["code"]) == (1, code)
    if code == 2:
        assert field in out["msg"]


@pytest.mark.parametrize("netns", ["/run/netns/p1", "<unset>", "/nonexistent/ns"])
def test_del_always_tears_down_then_releases(
    fakes: tuple[FakeDataplane, FakeIpam], netns: str
) -> None:
    """DEL-1..3: local cleanup, IPAM DEL always, also without a netns."""
    dp, ipam = fakes
    for _ in range(3):
        rc, out = run("DEL", conf(), CNI_NETNS=netns)
        assert (rc, out) == (0, None)  # DEL-8: nothing on stdout
    assert [c[0] for c in dp.calls] == ["teardown"] * 3
    assert dp.calls[0][1][0] == (None if netns == "<unset>" else netns)
    assert ipam.calls == ["DEL"] * 3


def test_del_releases_ipam_even_when_teardown_fails(fakes: tuple[FakeDataplane, FakeIpam]) -> None:
    """DEL-3: IPAM DEL is not skipped because an earlier step failed; the error is reported."""
    dp, ipam = fakes
    dp.fail_teardown = NetlinkFailure("delete link cali0", "host", errno.EBUSY)
    rc, out = run("DEL", conf())
    assert (rc, out["code"]) == (1, 103)
    assert ipam.calls == ["DEL"]


def test_del_reports_locked_store_after_local_cleanup(
    fakes: tuple[FakeDataplane, FakeIpam],
) -> None:
    """DEL-7: a busy store does not block local cleanup; code 11 says retry."""
    dp, ipam = fakes
    ipam.fail["DEL"] = CniError(11, "IPAM datastore busy, try again later")
    rc, out = run("DEL", conf())
    assert (rc, out["code"]) == (1, 11)
    assert dp.calls[0][0] == "teardown"


def test_del_releases_once_the_endpoint_is_gone_beside_the_teardown(
    fakes: tuple[FakeDataplane, FakeIpam],
) -> None:
    """DEL-3, DEL-7: the endpoint's removal and the IPAM DEL that follows it both run
    while the kernel side is torn down (which waits for no store); the addresses are never
    released before the endpoint is gone; a failed removal is reported after the IPAM DEL,
    which still runs."""
    import threading

    dp, ipam = fakes
    eps = ENDPOINTS[-1]
    in_teardown, released = threading.Event(), threading.Event()
    order: list[str] = []
    teardown, removed, start = dp.teardown, eps.removed, ipam.start

    def slow_teardown(*a: Any) -> None:
        in_teardown.set()
        assert released.wait(10), "the IPAM DEL did not run beside the teardown"
        teardown(*a)
        order.append("teardown")

    def removing_endpoint(args: skel.CmdArgs, c: Any) -> None:
        assert in_teardown.wait(10)
        removed(args, c)
        order.append("removed")

    def ipam_start(ipam_type: str, command: str, args: skel.CmdArgs) -> plugin.Pending:
        order.append(f"ipam {command}")
        released.set()
        return start(ipam_type, command, args)

    dp.teardown = slow_teardown  # type: ignore[method-assign]
    eps.removed = removing_endpoint  # type: ignore[method-assign]
    ipam.start = ipam_start  # type: ignore[method-assign]
    assert run("DEL", conf()) == (0, None)
    assert order == ["removed", "ipam DEL", "teardown"]
    eps.fail["removed"] = CniError(11, "IPAM datastore lock timeout")
    order.clear()
    released.clear()
    rc, out = run("DEL", conf())
    assert (rc, out["code"]) == (1, 11)
    assert order == ["ipam DEL", "teardown"]  # the removal failed: reported after IPAM DEL


def test_del_reports_the_ipam_error_after_the_teardown_is_done(
    fakes: tuple[FakeDataplane, FakeIpam],
) -> None:
    """An IPAM DEL that fails while the kernel side is torn down: the call still waits for
    the teardown, then reports the IPAM error (a local failure is only logged then)."""
    import threading

    dp, ipam = fakes
    done = threading.Event()
    teardown = dp.teardown

    def slow_teardown(*a: Any) -> None:
        threading.Event().wait(0.05)
        teardown(*a)
        done.set()

    dp.teardown = slow_teardown  # type: ignore[method-assign]
    ipam.fail["DEL"] = CniError(11, "IPAM datastore busy, try again later")
    rc, out = run("DEL", conf())
    assert (rc, out["code"]) == (1, 11)
    assert done.is_set()
    dp.fail_teardown = NetlinkFailure("delete link cali0", "host", errno.EBUSY)
    assert run("DEL", conf())[1]["code"] == 11


def test_del_with_garbage_prev_result_still_cleans(fakes: tuple[FakeDataplane, FakeIpam]) -> None:
    """DEL-4: prevResult is accepted but never required."""
    _dp, ipam = fakes
    rc, _ = run("DEL", conf(prevResult={"ips": "garbage"}))
    assert rc == 0
    assert ipam.calls == ["DEL"]


def test_del_with_an_invalid_veth_prefix_removes_the_pod_side(
    fakes: tuple[FakeDataplane, FakeIpam], caplog: pytest.LogCaptureFixture
) -> None:
    """DEL-9: the host veth's name derives from veth_prefix: none is looked for; the pod end
    (by ifname), the endpoint and the addresses still go; the dropped field is logged."""
    dp, ipam = fakes
    with caplog.at_level("WARNING", logger="tabby.plugin"):
        rc, out = run("DEL", conf(veth_prefix="1ab", mtu=65536))
    assert (rc, out) == (0, None)
    assert dp.calls == [("teardown", ("/run/netns/p1", "eth0", None, None))]
    assert ENDPOINTS[-1].calls == [("removed", "c1")]
    assert ipam.calls == ["DEL"]
    logged = " ".join(r.getMessage() for r in caplog.records)
    assert "invalid veth_prefix='1ab'" in logged
    assert "invalid mtu=65536" in logged


@pytest.mark.parametrize(
    "change",
    [
        {"ipam": {"type": "tabby-ipam", "data_dir": "relative"}},
        {"ipam": {"type": "tabby-ipam", "datastore_type": "zk"}},
        {"nodename": "node:a"},
        {"nodename_file": "relative"},  # no nodename: the node would come from the file
    ],
)
def test_del_with_an_invalid_store_or_node_removes_no_endpoint(
    fakes: tuple[FakeDataplane, FakeIpam], change: dict[str, Any]
) -> None:
    """DEL-9: the endpoint's key holds the node and it lives in the store: neither is
    guessed; the kernel side goes and IPAM DEL is still called (it judges the store itself)."""
    dp, ipam = fakes
    rc, out = run("DEL", conf(**change))
    assert (rc, out) == (0, None)
    assert [c[0] for c in dp.calls] == ["teardown"]
    assert dp.calls[0][1][2] == host_veth_name("cali", "net1", "c1", "eth0")
    assert ENDPOINTS[-1].calls == []
    assert ipam.calls == ["DEL"]


def test_del_with_garbage_in_the_nodename_file_succeeds(
    fakes: tuple[FakeDataplane, FakeIpam], tmp_path: Any
) -> None:
    """DEL-9: a node-name file that holds no node name names no endpoint: DEL does the rest
    and succeeds (ADD refuses it with code 2)."""
    _dp, ipam = fakes
    garbage = tmp_path / "nodename"
    garbage.write_text("not a node name!\n")
    rc, out = run("DEL", conf(nodename_file=str(garbage)))
    assert (rc, out) == (0, None)
    assert ENDPOINTS[-1].calls == []
    assert ipam.calls == ["DEL"]


@pytest.mark.parametrize("field", ["container_settings", "ipam"])
def test_del_still_fails_on_a_structural_problem(
    fakes: tuple[FakeDataplane, FakeIpam], field: str
) -> None:
    """DEL-9: a section that is not an object is code 7 for DEL as for ADD."""
    dp, ipam = fakes
    rc, out = run("DEL", conf(**{field: "yes"}))
    assert (rc, out["code"]) == (1, 7)
    assert dp.calls == []
    assert ipam.calls == []


def test_del_uses_prev_result_addresses(fakes: tuple[FakeDataplane, FakeIpam]) -> None:
    dp, _ = fakes
    prev = {"cniVersion": "1.1.0", "ips": [{"address": "10.244.0.5/32"}]}
    run("DEL", conf(prevResult=prev))
    assert [str(a) for a in dp.calls[0][1][3]] == ["10.244.0.5"]


def _added(version: str = "1.1.0") -> dict[str, Any]:
    return {
        "cniVersion": version,
        "interfaces": [
            {"name": "cali123", "mac": "ee:ee:ee:ee:ee:ee"},
            {"name": "eth0", "mac": "02:11:22:33:44:55", "sandbox": "/run/netns/p1"},
        ],
        "ips": [{"address": "10.244.0.5/32", "interface": 1}],
    }


def test_check_compares_with_prev_result_and_forwards(
    fakes: tuple[FakeDataplane, FakeIpam],
) -> None:
    """CHK-2, CHK-4, CHK-6, CHK-8."""
    dp, ipam = fakes
    rc, out = run("CHECK", conf(prevResult=_added()))
    assert (rc, out) == (0, None)
    spec, expected = dp.calls[0][1]
    assert [str(a) for a in spec.addresses] == ["10.244.0.5"]
    assert expected.container_mac == "02:11:22:33:44:55"
    assert ipam.calls == ["CHECK"]


def test_check_without_prev_result_fails(fakes: tuple[FakeDataplane, FakeIpam]) -> None:
    """CHK-2."""
    rc, out = run("CHECK", conf())
    assert rc == 1
    assert out["code"] == 7


def test_check_sandbox_mismatch_fails(fakes: tuple[FakeDataplane, FakeIpam]) -> None:
    rc, out = run("CHECK", conf(prevResult=_added()), CNI_NETNS="/run/netns/other")
    assert (rc, out["code"]) == (1, 103)


def test_check_dataplane_failure_is_reported(fakes: tuple[FakeDataplane, FakeIpam]) -> None:
    """CHK-3."""
    dp, _ipam = fakes
    dp.fail_check = CheckMismatch("host route 10.244.0.5/32 dev cali0 missing", "in the host netns")
    rc, out = run("CHECK", conf(prevResult=_added()))
    assert (rc, out["code"]) == (1, 103)


def test_check_ipam_failure_is_passed_on(fakes: tuple[FakeDataplane, FakeIpam]) -> None:
    """CHK-6."""
    _, ipam = fakes
    ipam.fail["CHECK"] = CniError(3, "no IPAM allocation for this attachment")
    rc, out = run("CHECK", conf(prevResult=_added()))
    assert (rc, out["code"]) == (1, 3)


def test_check_dataplane_error_wins_and_ipam_is_still_waited_for(
    fakes: tuple[FakeDataplane, FakeIpam],
) -> None:
    """CHK-3/CHK-6: IPAM's CHECK runs alongside the kernel inspection; when both fail the
    dataplane's error is the one reported, and the IPAM call started is waited for (no
    orphaned delegate)."""
    dp, ipam = fakes
    dp.fail_check = CheckMismatch("host route 10.244.0.5/32 dev cali0 missing", "in the host netns")
    ipam.fail["CHECK"] = CniError(3, "no IPAM allocation for this attachment")
    rc, out = run("CHECK", conf(prevResult=_added()))
    assert (rc, out["code"]) == (1, 103)
    assert out["msg"] == "check failed: host route 10.244.0.5/32 dev cali0 missing"
    assert ipam.calls == ["CHECK"]


def _gc_conf(**extra: Any) -> dict[str, Any]:
    return conf("1.1.0", **extra)


def test_gc_removes_only_this_networks_stale_veths(fakes: tuple[FakeDataplane, FakeIpam]) -> None:
    """GC-3, GC-6: stale veths of this network go; valid ones and other networks' stay."""
    dp, ipam = fakes
    keep = host_veth_name("cali", "net1", "c1", "eth0")
    dp.veths = [
        SimpleNamespace(name=keep, alias="tabby:net1:c1:eth0"),
        SimpleNamespace(name="cali-stale", alias="tabby:net1:c2:eth0"),
        SimpleNamespace(name="cali-other", alias="tabby:net2:c3:eth0"),
        SimpleNamespace(name="cali-foreign", alias=""),
    ]
    valid = [{"containerID": "c1", "ifname": "eth0"}]
    rc, out = run("GC", _gc_conf(**{"cni.dev/valid-attachments": valid}), CNI_CONTAINERID="")
    assert (rc, out) == (0, None)  # GC-8
    assert [c for c in dp.calls if c[0] == "delete_host_veth"] == [
        ("delete_host_veth", "cali-stale")
    ]
    assert ipam.calls == ["GC"]


def test_gc_legacy_key_and_absent_key(fakes: tuple[FakeDataplane, FakeIpam]) -> None:
    """GC-2 (legacy key honoured), GC-4 (absent key deletes nothing)."""
    dp, ipam = fakes
    dp.veths = [SimpleNamespace(name="cali-stale", alias="tabby:net1:c2:eth0")]
    run("GC", _gc_conf())
    assert not [c for c in dp.calls if c[0] == "delete_host_veth"]
    run("GC", _gc_conf(**{"cni.dev/attachments": []}))
    assert [c for c in dp.calls if c[0] == "delete_host_veth"] == [
        ("delete_host_veth", "cali-stale")
    ]
    assert ipam.calls == ["GC", "GC"]


def test_gc_with_an_invalid_veth_prefix_removes_no_host_veth(
    fakes: tuple[FakeDataplane, FakeIpam],
) -> None:
    """DEL-9: no host veth has an invalid prefix; GC is still forwarded to IPAM (GC-6)."""
    dp, ipam = fakes
    dp.veths = [SimpleNamespace(name="cali-stale", alias="tabby:net1:c2:eth0")]
    rc, out = run("GC", _gc_conf(veth_prefix="toolong", **{"cni.dev/valid-attachments": []}))
    assert (rc, out) == (0, None)
    assert not [c for c in dp.calls if c[0] == "delete_host_veth"]
    assert ipam.calls == ["GC"]


def test_gc_keeps_going_and_reports_all_errors(fakes: tuple[FakeDataplane, FakeIpam]) -> None:
    """GC-5."""
    _dp, ipam = fakes
    ipam.fail["GC"] = CniError(11, "busy")
    rc, out = run("GC", _gc_conf(**{"cni.dev/valid-attachments": []}))
    assert (rc, out["code"]) == (1, 11)


def test_status_forwards_to_ipam(fakes: tuple[FakeDataplane, FakeIpam]) -> None:
    """STA-4."""
    _, ipam = fakes
    rc, out = run("STATUS", conf(), CNI_CONTAINERID="", CNI_NETNS="", CNI_IFNAME="")
    assert (rc, out) == (0, None)
    ipam.fail["STATUS"] = CniError(50, "no address can be allocated for this node")
    rc, out = run("STATUS", conf())
    assert (rc, out["code"]) == (1, 50)


def test_a_failed_setup_removes_the_endpoint_recorded_meanwhile(
    fakes: tuple[FakeDataplane, FakeIpam],
) -> None:
    """The endpoint is recorded while the kernel side is built; when that fails, the
    record goes again with the addresses."""
    dp, ipam = fakes
    dp.fail_setup = NetlinkFailure("add route 0.0.0.0/0", "pod", errno.EPERM)
    rc, out = run("ADD", conf())
    assert (rc, out["code"]) == (1, 103)
    assert [c[0] for c in ENDPOINTS[0].calls] == ["added", "removed"]
    assert ipam.calls == ["ADD", "DEL"]


def test_add_records_the_endpoint_with_the_dataplane(
    fakes: tuple[FakeDataplane, FakeIpam],
) -> None:
    dp, _ = fakes
    rc, out = run("ADD", conf())
    assert rc == 0, out
    (call,) = ENDPOINTS[0].calls
    assert call == ("added", (["10.244.0.5", "fd00:10:244::5"], dp.calls[0][1].host_ifname))


def test_add_that_cannot_record_its_endpoint_is_rolled_back(
    fakes: tuple[FakeDataplane, FakeIpam],
) -> None:
    """The datastore refused the endpoint: the pod's interfaces go, the addresses go back,
    and the store's code is reported (11: try again later)."""
    dp, ipam = fakes
    ENDPOINTS[0].fail["added"] = CniError(11, "datastore unavailable, try again later")
    rc, out = run("ADD", conf())
    assert (rc, out["code"]) == (1, 11)
    assert [c[0] for c in dp.calls] == ["setup", "teardown"]
    assert ipam.calls == ["ADD", "DEL"]


def test_del_removes_the_endpoint_and_still_releases_when_it_cannot(
    fakes: tuple[FakeDataplane, FakeIpam],
) -> None:
    dp, ipam = fakes
    assert run("DEL", conf()) == (0, None)
    assert ENDPOINTS[0].calls == [("removed", "c1")]
    ENDPOINTS[0].fail["removed"] = CniError(11, "datastore unavailable, try again later")
    rc, out = run("DEL", conf())
    assert (rc, out["code"]) == (1, 11)
    assert ipam.calls == ["DEL", "DEL"], "IPAM DEL runs although the record could not go"
    assert [c[0] for c in dp.calls] == ["teardown", "teardown"]


def test_add_writes_its_log_only_where_the_configuration_says(
    fakes: tuple[FakeDataplane, FakeIpam], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Issue 21: logging is set up (with the defaults) before ADD reads its configuration;
    that must not create the default log directory when ``log_file_path`` is elsewhere."""
    from cni_protocol import log

    default = tmp_path / "default" / "cni.log"
    mine = tmp_path / "mine" / "cni.log"
    monkeypatch.setattr(log, "DEFAULT_LOG_FILE", str(default))
    env = {
        "CNI_COMMAND": "ADD",
        "CNI_CONTAINERID": "c1",
        "CNI_NETNS": "/run/netns/p1",
        "CNI_IFNAME": "eth0",
        "CNI_PATH": "/opt/cni/bin",
    }
    stdin = json.dumps(conf(log_file_path=str(mine))).encode()
    try:
        rc, out = skel.run(HANDLERS[-1], env, stdin, before_dispatch=plugin.configure_logging)
        assert rc == 0, out
        assert not default.parent.exists()
        assert "added" in mine.read_text()
        assert mine.parent.stat().st_mode & 0o777 == 0o700
    finally:
        log.setup("info", None, stderr=False)


# -- the dataplane's errors as the runtime reads them (cni_plugin.cni_codes) -------------------
# The dataplane raises its own errors; the plugin's edge gives them their CNI codes. What the
# binary prints is byte for byte what it printed when the dataplane raised CNI errors itself.

_NS = "/run/netns/p1"
_CODES = [
    (
        NetNSNotFound(_NS),
        b'{"cniVersion":"1.1.0","code":3,"msg":"network namespace /run/netns/p1 not found",'
        b'"details":"/run/netns/p1"}\n',
    ),
    (
        InvalidNetNS(_NS, f"{_NS} is not a namespace (Inappropriate ioctl for device)"),
        b'{"cniVersion":"1.1.0","code":8,"msg":"invalid network namespace /run/netns/p1",'
        b'"details":"/run/netns/p1 is not a namespace (Inappropriate ioctl for device)"}\n',
    ),
    (
        NetlinkFailure(
            "add route 0.0.0.0/0 via 169.254.1.1",
            "pod",
            errno.ENETUNREACH,
            "Nexthop has invalid gateway",
        ),
        b'{"cniVersion":"1.1.0","code":103,"msg":"netlink: add route 0.0.0.0/0 via 169.254.1.1'
        b' failed","details":"add route 0.0.0.0/0 via 169.254.1.1 (in pod netns): errno 101'
        b" ENETUNREACH (Network is unreachable): the kernel says 'Nexthop has invalid"
        b" gateway'\"}\n",
    ),
    (
        SysctlFailure(
            "write",
            "ipv4/conf/cali0/forwarding",
            "/proc/sys/net/ipv4/conf/cali0/forwarding",
            PermissionError(errno.EACCES, "Permission denied"),
        ),
        b'{"cniVersion":"1.1.0","code":103,"msg":"sysctl write failed:'
        b' net/ipv4/conf/cali0/forwarding","details":"write'
        b' /proc/sys/net/ipv4/conf/cali0/forwarding: errno 13 (Permission denied)"}\n',
    ),
    (
        InterfaceConflict(
            "interface eth0 already exists in the pod",
            f"an interface named 'eth0' already exists in {_NS}; it was left untouched"
            " (CNI_IFNAME must be new)",
        ),
        b'{"cniVersion":"1.1.0","code":103,"msg":"interface eth0 already exists in the pod",'
        b'"details":"an interface named \'eth0\' already exists in /run/netns/p1; it was left'
        b' untouched (CNI_IFNAME must be new)"}\n',
    ),
]


@pytest.mark.parametrize(("error", "printed"), _CODES, ids=lambda v: type(v).__name__)
def test_a_dataplane_error_of_add_is_printed_as_before(
    fakes: tuple[FakeDataplane, FakeIpam], error: Exception, printed: bytes
) -> None:
    dp, ipam = fakes
    dp.fail_setup = error
    assert run_raw("ADD", conf()) == (1, printed)
    assert ipam.calls == ["ADD", "DEL"]


def test_a_check_mismatch_is_code_103(fakes: tuple[FakeDataplane, FakeIpam]) -> None:
    dp, _ = fakes
    dp.fail_check = CheckMismatch("host veth cali0 is down", "in the host netns")
    assert run_raw("CHECK", conf(prevResult=_added())) == (
        1,
        b'{"cniVersion":"1.1.0","code":103,"msg":"check failed: host veth cali0 is down",'
        b'"details":"in the host netns"}\n',
    )


def test_del_in_the_plugins_own_netns_is_code_8_after_ipam_del(
    fakes: tuple[FakeDataplane, FakeIpam],
) -> None:
    dp, ipam = fakes
    why = f"{_NS} is the plugin's own network namespace; refusing to configure the host"
    dp.fail_teardown = InvalidNetNS(_NS, why, own=True)
    assert run_raw("DEL", conf()) == (
        1,
        b'{"cniVersion":"1.1.0","code":8,"msg":"invalid network namespace /run/netns/p1",'
        b'"details":"/run/netns/p1 is the plugin\'s own network namespace; refusing to'
        b' configure the host"}\n',
    )
    assert ipam.calls == ["DEL"]


def test_gc_reports_a_dataplane_error_with_the_others(
    fakes: tuple[FakeDataplane, FakeIpam],
) -> None:
    """GC-5: a host veth that cannot be deleted, and one whose listing failed."""
    dp, ipam = fakes
    dp.veths = [SimpleNamespace(name="cali-stale", alias="tabby:net1:c2:eth0")]
    dp.fail_delete = InterfaceConflict("cali-stale is not a veth", "it is of kind 'dummy'")
    valid = {"cni.dev/valid-attachments": []}
    assert run_raw("GC", _gc_conf(**valid), CNI_CONTAINERID="") == (
        1,
        b'{"cniVersion":"1.1.0","code":103,"msg":"cali-stale is not a veth",'
        b'"details":"cali-stale is not a veth: it is of kind \'dummy\'"}\n',
    )
    dp.fail_list = NetlinkFailure("dump links", "host", errno.EPERM)
    ipam.fail["GC"] = CniError(11, "busy")
    assert run_raw("GC", _gc_conf(**valid), CNI_CONTAINERID="") == (
        1,
        b'{"cniVersion":"1.1.0","code":103,"msg":"netlink: dump links failed","details":'
        b'"netlink: dump links failed: dump links (in host netns): errno 1 EPERM (Operation not'
        b' permitted); busy"}\n',
    )
    assert ipam.calls == ["GC", "GC"]


def test_an_invalid_veth_prefix_is_code_2() -> None:
    """The configuration models refuse it first; the dataplane's own check, should it be
    reached, says the same."""
    args = SimpleNamespace(network="net1", container_id="c1", ifname="eth0")
    with pytest.raises(CniError) as e:
        plugin.host_ifname(args, SimpleNamespace(veth_prefix="9ab"))  # type: ignore[arg-type]
    assert e.value.to_json("1.1.0") == (
        '{"cniVersion":"1.1.0","code":2,"msg":"unsupported value for field \'veth_prefix\':'
        " '9ab'\",\"details\":\"must be a letter followed by letters, digits, '_' or '-'\"}"
    )
    assert isinstance(e.value.__context__, InvalidVethPrefix)
