"""The protocol skeleton, in-process (the general, environment and VERSION rules of
cni_protocol/CONFORMANCE.md; the codes of docs/configuration.md "Error codes")."""

from __future__ import annotations

import json
from typing import Any

import pytest

from cni_protocol import skel
from cni_protocol.errors import CniError
from tests.conftest import ALL_SPEC_VERSIONS

BASE_ENV = {
    "CNI_CONTAINERID": "abc123",
    "CNI_NETNS": "/var/run/netns/test",
    "CNI_IFNAME": "eth0",
    "CNI_PATH": "/opt/cni/bin",
}


class Recorder:
    def __init__(
        self, result: dict[str, Any] | None = None, exc: BaseException | None = None
    ) -> None:
        self.calls: list[skel.CmdArgs] = []
        self.result = result
        self.exc = exc

    def __call__(self, args: skel.CmdArgs) -> dict[str, Any] | None:
        self.calls.append(args)
        if self.exc:
            raise self.exc
        return self.result

    def handlers(self) -> skel.Handlers:
        return skel.Handlers(add=self, delete=self, check=self, gc=self, status=self)


def conf(version: str = "1.1.0", **extra: Any) -> bytes:
    return json.dumps({"cniVersion": version, "name": "net1", "type": "tabby", **extra}).encode()


def call(
    env: dict[str, str], stdin: bytes, rec: Recorder | None = None, **kw: Any
) -> tuple[int, Any]:
    rec = rec or Recorder()
    rc, out = skel.run(rec.handlers(), env, stdin, **kw)
    text = out.decode()
    # GEN-5: stdout is exactly one JSON document or nothing
    return rc, (json.loads(text) if text.strip() else None)


def assert_error(rc: int, out: Any, code: int, version: str = "1.1.0") -> None:
    assert rc == 1  # GEN-1
    assert isinstance(out, dict)
    assert out["code"] == code  # GEN-3: code is an integer
    assert isinstance(out["code"], int)
    assert out["msg"]
    assert out["cniVersion"] == version  # GEN-8


@pytest.mark.parametrize("version", ALL_SPEC_VERSIONS)
def test_version_reply_echoes_request(version: str) -> None:
    """VER-1, VER-2, VER-3."""
    rc, out = call({"CNI_COMMAND": "VERSION"}, json.dumps({"cniVersion": version}).encode())
    assert rc == 0
    assert out == {
        "cniVersion": version,
        "supportedVersions": ["0.3.0", "0.3.1", "0.4.0", "1.0.0", "1.1.0"],
    }


def test_version_with_podman_dummy_env() -> None:
    """ENV-8, VER-4: dummy env, no container id, no name, nothing validated."""
    env = {
        "CNI_COMMAND": "VERSION",
        "CNI_PATH": "dummy",
        "CNI_NETNS": "dummy",
        "CNI_IFNAME": "dummy",
    }
    rc, out = call(env, b'{"cniVersion":"1.1.0"}')
    assert rc == 0
    assert out["cniVersion"] == "1.1.0"


@pytest.mark.parametrize("stdin", [b"", b"garbage", b'{"cniVersion":"0.2.0"}'])
def test_version_with_unusable_stdin_answers_highest(stdin: bytes) -> None:
    """VER-2: echo when it parses to a version we speak, else our highest."""
    rc, out = call({"CNI_COMMAND": "VERSION"}, stdin)
    assert rc == 0
    assert out["cniVersion"] == "1.1.0"


@pytest.mark.parametrize("command", ["", "FOO", "add"])
def test_bad_command_is_code_4(command: str) -> None:
    """ENV-1."""
    rc, out = call({**BASE_ENV, "CNI_COMMAND": command}, conf())
    assert_error(rc, out, 4)
    assert "CNI_COMMAND" in out["details"]


@pytest.mark.parametrize(
    ("command", "var"), [(c, v) for c, vs in skel.REQUIRED_ENV.items() for v in vs]
)
def test_each_missing_env_var_is_named(command: str, var: str) -> None:
    """ENV-2: drop each required variable in turn -> code 4 naming exactly it."""
    env = {**BASE_ENV, "CNI_COMMAND": command}
    del env[var]
    rc, out = call(env, conf("1.1.0"))
    assert_error(rc, out, 4)
    assert var in out["msg"]
    assert [v for v in skel.REQUIRED_ENV[command] if v in out["msg"]] == [var]


def test_all_missing_env_vars_are_listed() -> None:
    rc, out = call({"CNI_COMMAND": "ADD"}, conf())
    assert_error(rc, out, 4)
    for var in ("CNI_CONTAINERID", "CNI_NETNS", "CNI_IFNAME", "CNI_PATH"):
        assert var in out["msg"]


def test_del_without_netns_is_accepted() -> None:
    """ENV-5, DEL-2: CNI_NETNS is optional for DEL."""
    env = {**BASE_ENV, "CNI_COMMAND": "DEL"}
    del env["CNI_NETNS"]
    rec = Recorder()
    rc, out = call(env, conf(), rec)
    assert rc == 0
    assert out is None
    assert rec.calls[0].netns == ""


@pytest.mark.parametrize("cid", ["-abc", "a/b", "a b", ".x", "a:b"])
@pytest.mark.parametrize("command", ["ADD", "DEL", "CHECK"])
def test_bad_container_id_is_code_4(command: str, cid: str) -> None:
    """ENV-3."""
    rc, out = call({**BASE_ENV, "CNI_COMMAND": command, "CNI_CONTAINERID": cid}, conf())
    assert_error(rc, out, 4)


def test_long_hex_container_id_and_underscore_are_fine() -> None:
    """ENV-3: the regex includes '_' (the spec prose drops it by a typo)."""
    for cid in ("a" * 64, "pod_1.x-y"):
        rc, _ = call({**BASE_ENV, "CNI_COMMAND": "ADD", "CNI_CONTAINERID": cid}, conf())
        assert rc == 0


@pytest.mark.parametrize("ifname", ["a" * 16, "a:b", "a b", ".", "..", "a/b", "a\tb"])
def test_bad_ifname_is_code_4(ifname: str) -> None:
    """ENV-4."""
    rc, out = call({**BASE_ENV, "CNI_COMMAND": "ADD", "CNI_IFNAME": ifname}, conf())
    assert_error(rc, out, 4)


def test_15_byte_ifname_is_fine() -> None:
    rc, _ = call({**BASE_ENV, "CNI_COMMAND": "ADD", "CNI_IFNAME": "a" * 15}, conf())
    assert rc == 0


@pytest.mark.parametrize("stdin", [b"{", b"not json", b"[1,2]", b"\xff\xfe"])
def test_bad_json_is_code_6(stdin: bytes) -> None:
    """GEN-6."""
    rc, out = call({**BASE_ENV, "CNI_COMMAND": "ADD"}, stdin)
    assert_error(rc, out, 6)


@pytest.mark.parametrize("version", ["9.9.9", "0.2.0", "0.1.0", "1.2.0"])
def test_unknown_version_is_code_1_before_dispatch(version: str) -> None:
    """GEN-7: code 1, details name both sides, no handler runs."""
    rec = Recorder()
    rc, out = call({**BASE_ENV, "CNI_COMMAND": "ADD"}, conf(version), rec)
    assert_error(rc, out, 1)
    assert version in out["details"]
    assert "1.1.0" in out["details"]
    assert rec.calls == []


def test_missing_version_is_code_1() -> None:
    rc, out = call({**BASE_ENV, "CNI_COMMAND": "ADD"}, b'{"name":"n","type":"tabby"}')
    assert_error(rc, out, 1)


def test_malformed_version_string_is_code_6() -> None:
    rc, out = call({**BASE_ENV, "CNI_COMMAND": "ADD"}, conf("one.two"))
    assert_error(rc, out, 6)


@pytest.mark.parametrize("version", ["0.3.0", "0.3.1"])
def test_check_below_040_is_code_1(version: str) -> None:
    """CHK-1."""
    rc, out = call({**BASE_ENV, "CNI_COMMAND": "CHECK"}, conf(version))
    assert_error(rc, out, 1, version)


@pytest.mark.parametrize("command", ["GC", "STATUS"])
@pytest.mark.parametrize("version", ["0.3.0", "0.3.1", "0.4.0", "1.0.0"])
def test_gc_and_status_below_110_are_code_1(command: str, version: str) -> None:
    """GC-1, STA-1."""
    rc, out = call({"CNI_COMMAND": command, "CNI_PATH": "/x"}, conf(version))
    assert_error(rc, out, 1, version)


@pytest.mark.parametrize("name", ["", "../x", "a/b", "-x", None, 5])
def test_bad_network_name_is_code_7(name: Any) -> None:
    """GEN-9."""
    stdin = json.dumps({"cniVersion": "1.0.0", "name": name, "type": "tabby"}).encode()
    rc, out = call({**BASE_ENV, "CNI_COMMAND": "ADD"}, stdin)
    assert_error(rc, out, 7, "1.0.0")


@pytest.mark.parametrize("version", ALL_SPEC_VERSIONS)
def test_dispatch_passes_validated_args(version: str) -> None:
    rec = Recorder(result={"cniVersion": version, "ips": []})
    env = {
        **BASE_ENV,
        "CNI_COMMAND": "ADD",
        "CNI_ARGS": "IgnoreUnknown=1;K8S_POD_NAME=a",
        "CNI_PATH": "/a::/b",
    }
    rc, out = call(env, conf(version), rec)
    assert rc == 0
    assert out == {"cniVersion": version, "ips": []}
    a = rec.calls[0]
    assert (a.command, a.container_id, a.ifname, a.netns) == (
        "ADD",
        "abc123",
        "eth0",
        "/var/run/netns/test",
    )
    assert a.path == ["/a", "/b"]  # ENV-6: empty entries skipped
    assert a.cni_version == version
    assert a.network == "net1"
    assert a.stdin == conf(version)


@pytest.mark.parametrize(
    "key", ["runtimeConfig", "args", "prevResult", "cni.dev/foo", "capabilities", "foo"]
)
def test_reserved_and_unknown_keys_do_not_fail(key: str) -> None:
    """GEN-10, GEN-11, CFG-5, CDEV-1."""
    rc, _ = call({**BASE_ENV, "CNI_COMMAND": "ADD"}, conf("1.1.0", **{key: {"x": {"y": 1}}}))
    assert rc == 0


@pytest.mark.parametrize("version", ALL_SPEC_VERSIONS)
def test_handler_cni_error_passes_through_in_request_version(version: str) -> None:
    """GEN-2, GEN-3, GEN-8; IPM-4: a CniError is never re-wrapped."""
    rec = Recorder(exc=CniError(11, "store busy", "lock held"))
    rc, out = call({**BASE_ENV, "CNI_COMMAND": "DEL"}, conf(version), rec)
    assert_error(rc, out, 11, version)
    assert out == {"cniVersion": version, "code": 11, "msg": "store busy", "details": "lock held"}


def test_unexpected_exception_becomes_999_without_traceback(
    capsys: pytest.CaptureFixture[str],
) -> None:
    rec = Recorder(exc=ZeroDivisionError("boom"))
    rc, out = call({**BASE_ENV, "CNI_COMMAND": "ADD"}, conf(), rec)
    assert_error(rc, out, 999)
    assert "boom" in out["details"]
    assert "Traceback" not in capsys.readouterr().err


def test_own_netns_is_refused(tmp_path: Any) -> None:
    """GEN-16: CNI_NETNS naming the plugin's own netns -> code 8, no handler runs."""
    target = tmp_path / "ns"
    target.write_text("")
    st = target.stat()
    rec = Recorder()
    env = {**BASE_ENV, "CNI_COMMAND": "ADD", "CNI_NETNS": str(target)}
    rc, out = call(env, conf(), rec, own_netns=(st.st_dev, st.st_ino))
    assert_error(rc, out, 8)
    assert rec.calls == []
    rc, _ = call({**env, "CNI_NETNS_OVERRIDE": "1"}, conf(), rec, own_netns=(st.st_dev, st.st_ino))
    assert rc == 0


def test_success_without_result_prints_nothing() -> None:
    """DEL-8, CHK-8: success with no result -> empty stdout."""
    rc, out = call({**BASE_ENV, "CNI_COMMAND": "CHECK"}, conf("0.4.0"))
    assert rc == 0
    assert out is None


def test_tracebacks_go_to_the_log_file_not_stderr(
    tmp_path: Any, capsys: pytest.CaptureFixture[str]
) -> None:
    """GEN-5 and the product rule: never a traceback on stdout or stderr."""
    from cni_protocol import log

    logfile = tmp_path / "cni.log"
    log.setup("info", str(logfile))
    try:
        rec = Recorder(exc=KeyError("boom"))
        rc, out = call({**BASE_ENV, "CNI_COMMAND": "ADD"}, conf(), rec)
        assert_error(rc, out, 999)
        err = capsys.readouterr().err
        assert "Traceback" not in err
        assert "internal error" in err
        assert "Traceback" in logfile.read_text()
    finally:
        log.setup("info", None, stderr=False)


# -- found by fuzzing (tests/fuzz/cni.py) ------------------------------------------------


@pytest.mark.parametrize("version", ["1.\u00b2.0", "\u0661.1.0", "1.1.\u2460"])
def test_cni_version_with_non_ascii_digits_is_code_6(version: str) -> None:
    """str.isdigit() is true for "²" and other scripts' digits, which int() refuses or
    reads: such a version was an internal error (999), not a decode failure."""
    stdin = json.dumps({"cniVersion": version, "name": "net"}).encode()
    rc, out = skel.run(Recorder().handlers(), {"CNI_COMMAND": "ADD", **BASE_ENV}, stdin)
    assert (rc, json.loads(out)["code"]) == (1, 6)


@pytest.mark.parametrize(
    "stdin",
    [
        b"[" * 100_000,  # past json's own recursion limit
        b'{"cniVersion":"1.1.0","name":"n","ipam":' + b'{"a":' * 500 + b"1" + b"}" * 501,
    ],
    ids=["parser", "models"],
)
def test_deeply_nested_configuration_is_code_6(stdin: bytes) -> None:
    """A configuration nested past the parser's stack, or past what the models recurse
    through (teardown's tolerant reading raised RecursionError at 500 levels), was an
    internal error: it is refused as undecodable before any code walks it."""
    handlers = Recorder().handlers()
    rc, out = skel.run(handlers, {"CNI_COMMAND": "DEL", **BASE_ENV}, stdin)
    assert (rc, json.loads(out)["code"]) == (1, 6)


def test_nesting_up_to_the_limit_is_accepted() -> None:
    deep: object = 1
    for _ in range(skel.MAX_DEPTH - 1):
        deep = [deep]
    config = {"cniVersion": "1.1.0", "name": "n", "x": deep}
    rec = Recorder()
    rc, _ = skel.run(
        rec.handlers(), {"CNI_COMMAND": "ADD", **BASE_ENV}, json.dumps(config).encode()
    )
    assert rc == 0
    assert len(rec.calls) == 1
    config["x"] = [deep]
    rc, out = skel.run(
        rec.handlers(), {"CNI_COMMAND": "ADD", **BASE_ENV}, json.dumps(config).encode()
    )
    assert (rc, json.loads(out)["code"]) == (1, 6)
