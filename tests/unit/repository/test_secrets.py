"""No secret in what tabby says (docs/security.md "Secrets"): a recognizable secret value,
``CANARY``, put wherever an operator can put a secret (an etcd endpoint's credentials, the
etcd client key, a kubeconfig's token or client key, a token file, the plugins' token Secret,
a field named like a password), then every path that reads it driven to a failure: the CNI
plugins' error JSON, stderr and log file, tabby-node's and tabby-kube-controllers' logs at
debug level, tabbyctl's output. The canary never appears. (tabby writes no Kubernetes
Events; its BIRD configuration carries no secret: BGPPeer has no password.)"""

from __future__ import annotations

import base64
import json
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest
from click.testing import CliRunner

from cni_protocol.redact import REDACTED, redact_json, redact_text, secret_field
from tabbyctl.cli import cli
from tests.unit.tabbyctl.test_install import credentials, init_env, make_bundle

CANARY = "s3cr3t-TABBY-canary"
#: A port nothing listens on (connections refused at once).
CLOSED = "127.0.0.1:1"
KEY = f"-----BEGIN PRIVATE KEY-----\n{CANARY}\n-----END PRIVATE KEY-----\n"


def _kubeconfig(where: Path, user: str, server: str = f"https://{CLOSED}") -> Path:
    path = where / "kubeconfig"
    path.write_text(
        "apiVersion: v1\n"
        f"clusters:\n- cluster: {{server: {json.dumps(server)}}}\n  name: c\n"
        "contexts:\n- context: {cluster: c, user: u}\n  name: x\ncurrent-context: x\n"
        f"users:\n- name: u\n  user:\n{user}"
    )
    return path


def _b64(text: str) -> str:
    return base64.b64encode(text.encode()).decode()


#: name -> the datastore settings (an ipam section's fields) carrying the canary, made in a
#: temporary directory
SETTINGS: dict[str, Callable[[Path], dict[str, object]]] = {
    "etcd endpoint's password": lambda _: {
        "datastore_type": "etcdv3",
        "etcd_endpoints": [f"http://tabby:{CANARY}@{CLOSED}"],
    },
    "etcd endpoint's query": lambda _: {
        "datastore_type": "etcdv3",
        "etcd_endpoints": [f"http://{CLOSED}/?token={CANARY}"],
    },
    "etcd key pasted for its path": lambda _: {
        "datastore_type": "etcdv3",
        "etcd_endpoints": [f"https://{CLOSED}"],
        "etcd_key_file": KEY,
    },
    "etcd client key's content": lambda tmp: {
        "datastore_type": "etcdv3",
        "etcd_endpoints": [f"https://{CLOSED}"],
        **{
            field: str(_write(tmp / field, KEY))
            for field in ("etcd_key_file", "etcd_cert_file", "etcd_ca_cert_file")
        },
    },
    "kubeconfig's token": lambda tmp: {
        "datastore_type": "kubernetes",
        "kubeconfig": str(_kubeconfig(tmp, f"    token: {CANARY}\n")),
    },
    "kubeconfig's token on a line YAML refuses": lambda tmp: {
        "datastore_type": "kubernetes",
        "kubeconfig": str(_kubeconfig(tmp, f"    token: {CANARY}: x\n")),
    },
    "kubeconfig's client key": lambda tmp: {
        "datastore_type": "kubernetes",
        "kubeconfig": str(
            _kubeconfig(
                tmp,
                f"    client-certificate-data: {_b64(KEY)}\n    client-key-data: {_b64(KEY)}\n",
            )
        ),
    },
    "kubeconfig's token file": lambda tmp: {
        "datastore_type": "kubernetes",
        "kubeconfig": str(
            _kubeconfig(tmp, f"    tokenFile: {_write(tmp / 'token', CANARY + chr(10))}\n")
        ),
    },
}


def _write(path: Path, text: str) -> Path:
    path.write_text(text)
    return path


def _clean(*texts: str | bytes) -> None:
    for text in texts:
        shown = text.decode(errors="replace") if isinstance(text, bytes) else text
        assert CANARY not in shown, shown[-2000:]


# -- the rule ------------------------------------------------------------------------------------


def test_the_rule_of_what_looks_secret() -> None:
    """cni_protocol.redact: the one rule errors, logs and ``tabbyctl node diags`` apply."""
    for name in ("etcd_key_file", "password", "token", "client-key-data", "bearerToken"):
        assert secret_field(name), name
    for name in ("etcd_cert_file", "etcd_endpoints", "kubeconfig", "peerIP", "monkey"):
        assert not secret_field(name), name
    cases = {
        f"http://u:{CANARY}@10.0.0.1:2379/v3": f"http://{REDACTED}@10.0.0.1:2379/v3",
        f"https://[fd00::1]:2379/?t={CANARY}": f"https://[fd00::1]:2379/?{REDACTED}",
        f"Authorization: Bearer {CANARY}": f"Authorization: {REDACTED}",
        KEY: "[REDACTED PRIVATE KEY]\n",
        "http://10.0.0.1:2379 stays": "http://10.0.0.1:2379 stays",
    }
    for text, want in cases.items():
        assert redact_text(text)[0] == want, text
    value, count = redact_json({"spec": {"password": CANARY, "url": f"http://a:{CANARY}@h:1"}})
    assert count == 2
    _clean(json.dumps(value))


# -- the CNI plugins -----------------------------------------------------------------------------


@pytest.mark.parametrize("case", sorted(SETTINGS))
def test_cni_errors_and_logs_carry_no_secret(
    case: str, tmp_path: Path, subprocess_env: dict[str, str]
) -> None:
    """tabby-ipam's ADD and DEL (a process each, as a runtime runs them) on settings
    carrying the canary, at debug level: the ADD fails (the settings were read and used),
    and neither the error JSON on stdout, nor stderr, nor the log file names the canary."""
    log = tmp_path / "cni.log"
    ipam = {
        "type": "tabby-ipam",
        "ipv4_pools": ["10.9.0.0/16"],
        "nodename": "node-a",
        "log_file_path": str(log),
        "log_level": "debug",
        "lock_timeout_seconds": 0.5,
        **SETTINGS[case](tmp_path),
    }
    conf = {"cniVersion": "1.0.0", "name": "net", "type": "tabby", "ipam": ipam}
    for command in ("ADD", "DEL"):
        env = {
            **subprocess_env,
            "CNI_COMMAND": command,
            "CNI_CONTAINERID": "c0ffee",
            "CNI_NETNS": "/var/run/netns/x",
            "CNI_IFNAME": "eth0",
            "CNI_PATH": "/opt/cni/bin",
        }
        proc = subprocess.run(
            _program("tabby-ipam"),
            input=json.dumps(conf),
            env=env,
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        )
        if command == "ADD":
            assert proc.returncode == 1, proc.stdout + proc.stderr
            assert json.loads(proc.stdout)["code"] in (2, 7, 11), proc.stdout
        _clean(proc.stdout, proc.stderr)
    _clean(log.read_text() if log.exists() else "")


# -- the daemons ---------------------------------------------------------------------------------


def _run_daemon(
    argv: list[str], env: dict[str, str], out: Path, until: Callable[[str], bool]
) -> str:
    """A daemon's whole output (stdout and stderr, into ``out``): it runs until it exits
    or ``until`` is true of what it wrote (20 s at most), then it is stopped (SIGTERM)."""
    with out.open("w") as f:
        proc = subprocess.Popen(argv, env=env, stdout=f, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 20
    try:
        while proc.poll() is None and time.monotonic() < deadline:
            if until(out.read_text(errors="replace")):
                break
            time.sleep(0.1)
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    return out.read_text(errors="replace")


def _program(role: str) -> list[str]:
    return [
        sys.executable,
        "-c",
        f"import sys; sys.argv[0] = {role!r}; from bundle.entry import main; sys.exit(main())",
    ]


@pytest.mark.parametrize(
    "case",
    [
        "etcd endpoint's password",
        pytest.param("kubeconfig's token", marks=pytest.mark.slow),  # retries waited for
        "kubeconfig's token on a line YAML refuses",
    ],
)
def test_the_daemons_log_no_secret(
    case: str, tmp_path: Path, subprocess_env: dict[str, str]
) -> None:
    """tabby-node (no backend: no root needed) and tabby-kube-controllers at debug level on
    settings carrying the canary, each until it has said why it cannot reach its datastore
    (or exited on it): not a word of the canary."""
    settings = SETTINGS[case](tmp_path)
    flags = ["--datastore-type", str(settings["datastore_type"])]
    if "kubeconfig" in settings:
        flags += ["--kubeconfig", str(settings["kubeconfig"])]
    else:
        flags += ["--etcd-endpoints", ",".join(map(str, settings["etcd_endpoints"]))]  # type: ignore[call-overload]
    env = {k: v for k, v in subprocess_env.items() if not k.startswith(("TABBY_", "KUBE"))}
    run = tmp_path / "run"

    def said_why(out: str) -> bool:
        return any(
            w in out
            for w in ("retrying", "unreachable", "not writable", "kubeconfig", "unsupported value")
        )

    node = _run_daemon(
        [
            *_program("tabby-node"),
            *("--backend", "none", "--nodename", "node-a", "--log-level", "debug"),
            *("--log-file", "", "--socket", str(run / "node.sock"), "--run-dir", str(run)),
            *("--state-dir", str(tmp_path / "state"), "--metrics-port", "0"),
            *("--health-port", "0", *flags),
        ],
        env,
        tmp_path / "node.out",
        said_why,
    )
    assert said_why(node), node[-2000:]
    _clean(node)
    controllers = _run_daemon(
        [
            *_program("tabby-kube-controllers"),
            *("--log-level", "debug", "--health-port", "0", "--metrics-port", "0"),
            *("--lease-namespace", "tabby-system", *flags),
        ],
        env,
        tmp_path / "controllers.out",
        said_why,
    )
    assert said_why(controllers), controllers[-2000:]
    _clean(controllers)


# -- tabbyctl ------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "case",
    [
        "etcd endpoint's password",
        "etcd endpoint's query",
        "kubeconfig's token on a line YAML refuses",
        pytest.param("kubeconfig's token", marks=pytest.mark.slow),  # retries waited for
    ],
)
def test_tabbyctl_says_no_secret(case: str, tmp_path: Path) -> None:
    settings = SETTINGS[case](tmp_path)
    flags = ["--datastore-type", str(settings["datastore_type"])]
    if "kubeconfig" in settings:
        flags += ["--kubeconfig", str(settings["kubeconfig"])]
    else:
        flags += ["--etcd-endpoints", ",".join(map(str, settings["etcd_endpoints"]))]  # type: ignore[call-overload]
    for args in (["ipam", "show"], ["get", "bgppeers", "-o", "yaml"]):
        result = CliRunner().invoke(cli, [*flags, *args], prog_name="tabbyctl")
        assert result.exit_code != 0, result.output
        _clean(result.output)


def test_a_kubeconfig_shows_no_secret() -> None:
    """What the Kubernetes client holds of a kubeconfig prints without its token or key."""
    from stores.kube.client import KubeConfig

    config = KubeConfig(server="https://10.0.0.1:6443", token=CANARY, key_data=KEY.encode())
    _clean(repr(config), str(config))


def test_a_bgp_peer_with_a_password_is_refused_without_showing_it(tmp_path: Path) -> None:
    """BGPPeer has no password (tabby's BIRD speaks no TCP-MD5): a Calico-style peer with
    one, inline or as a secretKeyRef, is refused naming the field, never its value."""
    for password in (CANARY, {"secretKeyRef": {"name": "bgp", "key": CANARY}}):
        peer = {
            "apiVersion": "tabby.io/v1",
            "kind": "BGPPeer",
            "metadata": {"name": "rack1"},
            "spec": {"peerIP": "192.0.2.1", "asNumber": 64513, "password": password},
        }
        path = _write(tmp_path / "peer.json", json.dumps(peer))
        args = ["--datastore-type", "file", "--data-dir", str(tmp_path / "store")]
        result = CliRunner().invoke(cli, [*args, "apply", "-f", str(path)], prog_name="tabbyctl")
        assert result.exit_code == 1, result.output
        assert "spec.password" in result.output
        _clean(result.output)


def test_the_installer_writes_the_token_and_says_nothing_of_it(tmp_path: Path) -> None:
    """``tabbyctl node install`` (the DaemonSet's init container) writes the plugins'
    token into their kubeconfig (0600) and prints nothing of it."""
    host = tmp_path / "host"
    host.mkdir()
    secret = credentials(tmp_path / "secret", CANARY + "\n")
    args = ["node", "install", "--host-root", str(host), "--bundle", str(make_bundle(tmp_path))]
    args += ["--cni-credentials", str(secret), "--nodename", "node-7"]
    result = CliRunner().invoke(cli, args, env=init_env())
    assert result.exit_code == 0, result.output
    kubeconfig = host / "etc/cni/net.d/tabby-kubeconfig"
    assert CANARY in kubeconfig.read_text()
    assert kubeconfig.stat().st_mode & 0o777 == 0o600
    _clean(result.output)
