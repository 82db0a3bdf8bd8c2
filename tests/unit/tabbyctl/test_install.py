"""``tabbyctl node install`` (tabbyctl/install.py) on a host tree in tmp_path, with a small
fake bundle: versioned bundle directories that are never changed once named, ``current`` and
the CNI links replaced by rename, the previous bundle kept and older ones removed, the
conflist filled in from the manifest's own template and checked as the plugins read it (the
Kubernetes datastore as shipped, etcd mode by the ConfigMap's one change), the plugins'
kubeconfig or the TLS files, the node name, and nothing written when the template or the
plugins' credentials are wrong. The DaemonSet runs it for real in
tests/kubernetes/test_manifest.py."""

from __future__ import annotations

import json
import os
import re
import stat
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml
from click.testing import CliRunner

from tabbyctl import install
from tabbyctl.cli import cli
from tests import REPO_ROOT

MANIFEST = REPO_ROOT / "manifests" / "tabby.yaml"

FAKE_EXE = """#!/bin/sh
# stands in for the bundle's executable: `tabbyctl version -o json`
echo '{"version": "%s"}'
"""


def make_bundle(where: Path, version: str = "0.1.0", extra: str = "") -> Path:
    bundle = where / f"bundle-{version}{extra}"
    (bundle / "_internal" / "pkg").mkdir(parents=True)
    exe = bundle / "tabby"
    exe.write_text(FAKE_EXE % version)
    exe.chmod(0o755)
    (bundle / "_internal" / "libpython.so").write_bytes(b"\x7fELF" + extra.encode())
    (bundle / "_internal" / "pkg" / "mod.pyc").write_bytes(b"code")
    os.symlink("libpython.so", bundle / "_internal" / "libpython.so.1")
    return bundle


def manifest_docs() -> list[dict[str, Any]]:
    return [d for d in yaml.safe_load_all(MANIFEST.read_text()) if isinstance(d, dict)]


def config_map() -> dict[str, str]:
    (cm,) = [d for d in manifest_docs() if d["kind"] == "ConfigMap"]
    return dict(cm["data"])


#: what the kubelet gives every container: the API server's service address
SERVICE_ENV = {"KUBERNETES_SERVICE_HOST": "10.96.0.1", "KUBERNETES_SERVICE_PORT": "443"}
ETCD_MODE = {"datastore_type": "etcdv3"}  # the ConfigMap's one change


def init_env(overrides: dict[str, str] | None = None) -> dict[str, str]:
    """The environment the DaemonSet gives its init container, from the manifest's
    ConfigMap (with ``overrides`` of its keys)."""
    data = {**config_map(), **(overrides or {})}
    (ds,) = [d for d in manifest_docs() if d["kind"] == "DaemonSet"]
    (init,) = ds["spec"]["template"]["spec"]["initContainers"]
    env = dict(SERVICE_ENV)
    for var in init["env"]:
        ref = var.get("valueFrom", {}).get("configMapKeyRef")
        if ref is not None:
            env[var["name"]] = data[ref["key"]]
    return env


def credentials(where: Path, token: str = "the-token\n") -> Path:
    """The Secret tabby-cni-token as the DaemonSet mounts it."""
    where.mkdir(parents=True, exist_ok=True)
    (where / "token").write_text(token)
    (where / "ca.crt").write_text("-----BEGIN CERTIFICATE-----\nCA\n-----END CERTIFICATE-----\n")
    return where


class Host:
    def __init__(self, root: Path, secret: Path) -> None:
        self.root = root
        self.layout = install.Layout(root)
        self.lines: list[str] = []
        self.secret = secret

    def path(self, host_path: str) -> Path:
        return self.layout.here(host_path)

    def run(
        self, bundle: Path, env: dict[str, str] | None = None, nodename: str = "node-1"
    ) -> install.Report:
        env = env if env is not None else init_env()
        return install.install(
            self.layout,
            bundle,
            env["TABBY_CNI_NETWORK_CONFIG"],
            nodename,
            env,
            self.lines.append,
            credentials=self.secret,
        )

    def conflist(self) -> dict[str, Any]:
        return dict(json.loads(self.path("/etc/cni/net.d/10-tabby.conflist").read_text()))

    def files(self) -> set[str]:
        return {str(p.relative_to(self.root)) for p in self.root.rglob("*")}


@pytest.fixture
def host(tmp_path: Path) -> Host:
    root = tmp_path / "host"
    root.mkdir()
    return Host(root, credentials(tmp_path / "secret"))


def test_a_fresh_node_gets_the_bundle_links_conflist_and_name(host: Host, tmp_path: Path) -> None:
    bundle = make_bundle(tmp_path)
    report = host.run(bundle)
    ident = report.bundle_id
    assert ident == f"0.1.0-{install.content_hash(bundle)[:12]}"
    installed = host.path(f"/opt/tabby/bundles/{ident}")
    assert (installed / "_internal" / "pkg" / "mod.pyc").read_bytes() == b"code"
    assert os.readlink(installed / "_internal" / "libpython.so.1") == "libpython.so"
    assert install.content_hash(bundle) == install.content_hash(_without_roles(installed))
    for role in ("tabby-node", "tabbyctl", "tabby-kube-controllers"):
        assert os.readlink(installed / role) == "tabby"
    assert os.readlink(host.path("/opt/tabby/current")) == f"bundles/{ident}"
    for name in ("tabby", "tabby-ipam"):
        assert os.readlink(host.path(f"/opt/cni/bin/{name}")) == "/opt/tabby/current/tabby"
    assert host.path("/var/lib/tabby/nodename").read_text() == "node-1\n"
    doc = host.conflist()
    (plugin,) = doc["plugins"]
    assert plugin["type"] == "tabby"
    assert plugin["mtu"] == 0
    assert plugin["log_level"] == "info"
    ipam = plugin["ipam"]
    # the Kubernetes datastore, as shipped: the plugins' kubeconfig, no etcd setting
    assert ipam["datastore_type"] == "kubernetes"
    assert ipam["kubeconfig"] == "/etc/cni/net.d/tabby-kubeconfig"
    assert not [k for k in ipam if k.startswith("etcd_")]
    assert ipam["ipv4_pools"] == ["10.244.0.0/16"]
    assert ipam["ipv6_pools"] == []
    assert (ipam["assign_ipv4"], ipam["assign_ipv6"]) == (True, False)
    assert not [f for f in host.files() if ".tmp" in f]
    assert stat.S_IMODE(host.path("/etc/cni/net.d/10-tabby.conflist").stat().st_mode) == 0o644
    assert not host.path("/etc/cni/net.d/tabby-tls").exists()


def test_the_kubernetes_datastore_gets_the_plugins_kubeconfig(host: Host, tmp_path: Path) -> None:
    """/etc/cni/net.d/tabby-kubeconfig: root's only, JSON (read without a YAML parser on a
    CNI call), the service address the pod was given, the CA and the tabby-cni token."""
    bundle = make_bundle(tmp_path)
    host.run(bundle)
    path = host.path("/etc/cni/net.d/tabby-kubeconfig")
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    doc = json.loads(path.read_text())
    ((cluster,), (user,)) = (doc["clusters"], doc["users"])
    assert cluster["cluster"]["server"] == "https://10.96.0.1:443"
    assert user["user"] == {"token": "the-token"}
    code = (
        "import sys; from stores.kube.client import KubeConfig; "
        f"c = KubeConfig.from_kubeconfig({str(path)!r}); "
        "print(c.server, c.token, 'BEGIN CERTIFICATE' in (c.ca_data or ''), 'yaml' in sys.modules)"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=REPO_ROOT
    ).stdout.split()
    assert out == ["https://10.96.0.1:443", "the-token", "True", "False"]
    # the API server's real address where the service address does not work (the
    # ConfigMap tabby-kubernetes-api in the init container's environment), IPv6 too
    host.run(bundle, {**init_env(), "KUBERNETES_SERVICE_HOST": "fd00::1"})
    doc = json.loads(path.read_text())
    assert doc["clusters"][0]["cluster"]["server"] == "https://[fd00::1]:443"


def test_etcd_mode_is_one_configmap_change(host: Host, tmp_path: Path) -> None:
    """datastore_type etcdv3 and the endpoints: the etcd settings in the conflist, no
    kubeconfig (one left by a Kubernetes install is removed)."""
    bundle = make_bundle(tmp_path)
    host.run(bundle)
    assert host.path("/etc/cni/net.d/tabby-kubeconfig").exists()
    etcd = {**ETCD_MODE, "etcd_endpoints": "http://10.0.0.1:2379,http://10.0.0.2:2379"}
    host.run(bundle, init_env(etcd))
    ipam = host.conflist()["plugins"][0]["ipam"]
    assert ipam["datastore_type"] == "etcdv3"
    assert ipam["etcd_endpoints"] == ["http://10.0.0.1:2379", "http://10.0.0.2:2379"]
    assert ipam["etcd_prefix"] == "/tabby"
    assert ipam["etcd_ca_cert_file"] is None
    assert "kubeconfig" not in ipam
    assert not host.path("/etc/cni/net.d/tabby-kubeconfig").exists()
    # and no credentials needed: an etcd install works without the Secret
    bare = Host(host.root, tmp_path / "no-secret")
    bare.run(bundle, init_env(etcd))


def _without_roles(installed: Path) -> Path:
    """The installed tree minus the role links the installer adds (to compare hashes)."""
    copy = installed.parent / ".compare"
    import shutil

    shutil.copytree(installed, copy, symlinks=True)
    for role in install.ROLE_LINKS:
        (copy / role).unlink()
    return copy


def test_installing_again_copies_nothing_and_replaces_files_by_rename(
    host: Host, tmp_path: Path
) -> None:
    bundle = make_bundle(tmp_path)
    first = host.run(bundle)
    assert first.copied_bytes > 0
    conflist = host.path("/etc/cni/net.d/10-tabby.conflist")
    inode = conflist.stat().st_ino
    link_inode = host.path("/opt/cni/bin/tabby").lstat().st_ino
    second = host.run(bundle)
    assert second.bundle_id == first.bundle_id
    assert second.copied_bytes == 0
    assert second.previous is None  # current already named this bundle
    assert any("already in /opt/tabby/bundles" in line for line in host.lines)
    assert conflist.stat().st_ino != inode  # a new file renamed over the old one
    assert host.path("/opt/cni/bin/tabby").lstat().st_ino != link_inode


def test_an_upgrade_switches_current_keeps_the_previous_and_removes_older(
    host: Host, tmp_path: Path
) -> None:
    v1 = host.run(make_bundle(tmp_path, "0.1.0")).bundle_id
    v2_report = host.run(make_bundle(tmp_path, "0.2.0"))
    v2 = v2_report.bundle_id
    assert v2 != v1
    assert v2_report.previous == v1
    assert os.readlink(host.path("/opt/tabby/current")) == f"bundles/{v2}"
    bundles = host.path("/opt/tabby/bundles")
    assert sorted(p.name for p in bundles.iterdir()) == sorted([v1, v2])  # v1 may still run
    v3_report = host.run(make_bundle(tmp_path, "0.2.0", extra="-patched"))
    v3 = v3_report.bundle_id
    assert v3.startswith("0.2.0-")
    assert v3 != v2
    assert v3_report.removed == [v1]
    assert sorted(p.name for p in bundles.iterdir()) == sorted([v2, v3])


def test_a_half_done_install_is_cleaned_up(host: Host, tmp_path: Path) -> None:
    stale = host.path("/opt/tabby/bundles/.0.1.0-deadbeef0000.tmp-4242")
    (stale / "_internal").mkdir(parents=True)
    host.run(make_bundle(tmp_path))
    assert not stale.exists()


def test_tls_files_are_copied_private_and_named_in_the_conflist(host: Host, tmp_path: Path) -> None:
    secrets = tmp_path / "secrets"
    secrets.mkdir()
    for name in ("etcd-ca", "etcd-cert", "etcd-key"):
        (secrets / name).write_text(f"PEM {name}\n")
    env = init_env(
        {
            **ETCD_MODE,
            "etcd_ca": str(secrets / "etcd-ca"),
            "etcd_cert": str(secrets / "etcd-cert"),
            "etcd_key": str(secrets / "etcd-key"),
        }
    )
    host.run(make_bundle(tmp_path), env)
    tls = host.path("/etc/cni/net.d/tabby-tls")
    assert stat.S_IMODE(tls.stat().st_mode) == 0o700
    for name in ("etcd-ca", "etcd-cert", "etcd-key"):
        assert (tls / name).read_text() == f"PEM {name}\n"
        assert stat.S_IMODE((tls / name).stat().st_mode) == 0o600
    ipam = host.conflist()["plugins"][0]["ipam"]
    assert ipam["etcd_ca_cert_file"] == "/etc/cni/net.d/tabby-tls/etcd-ca"
    assert ipam["etcd_cert_file"] == "/etc/cni/net.d/tabby-tls/etcd-cert"
    assert ipam["etcd_key_file"] == "/etc/cni/net.d/tabby-tls/etcd-key"
    # TLS turned off again: the copies go
    host.run(make_bundle(tmp_path, extra="-2"), init_env(ETCD_MODE))
    assert list(tls.iterdir()) == []
    assert host.conflist()["plugins"][0]["ipam"]["etcd_key_file"] is None


@pytest.mark.parametrize(
    ("overrides", "template_edit", "message"),
    [
        ({"datastore_type": "etcd"}, None, "ipam.datastore_type"),
        ({}, ("__CNI_MTU__", "__MTU__"), "unknown placeholders: __MTU__"),
        ({}, ('"plugins": [', '"plugins": [[,'), "not JSON once filled in"),
        ({"ipv4_pool": "10.244.0.0/33"}, None, "ipam.ipv4_pools"),
        ({"log_level": "chatty"}, None, "log_level"),
        ({"veth_mtu": "big"}, None, "TABBY_CNI_MTU='big' is not a number"),
        ({}, ('"type": "tabby-ipam"', '"type": "host-local"'), "ipam type tabby-ipam"),
    ],
    ids=["datastore", "placeholder", "json", "pool", "log-level", "mtu", "ipam-type"],
)
def test_a_bad_configuration_fails_with_one_line_and_writes_nothing(
    host: Host,
    tmp_path: Path,
    overrides: dict[str, str],
    template_edit: tuple[str, str] | None,
    message: str,
) -> None:
    env = init_env(overrides)
    if template_edit is not None:
        old, new = template_edit
        assert old in env["TABBY_CNI_NETWORK_CONFIG"]
        env["TABBY_CNI_NETWORK_CONFIG"] = env["TABBY_CNI_NETWORK_CONFIG"].replace(old, new, 1)
    with pytest.raises(install.InstallError, match=message.replace("(", r"\(")):
        host.run(make_bundle(tmp_path), env)
    assert host.files() == set()


@pytest.mark.parametrize(
    ("token", "env", "message"),
    [
        (None, {}, "has no token yet?"),
        ("  \n", {}, "token is empty"),
        ("t", {"KUBERNETES_SERVICE_HOST": ""}, "KUBERNETES_SERVICE_HOST is not set"),
    ],
    ids=["no-secret", "empty-token", "no-address"],
)
def test_no_credentials_for_the_plugins_fails_and_writes_nothing(
    tmp_path: Path, token: str | None, env: dict[str, str], message: str
) -> None:
    root = tmp_path / "host"
    root.mkdir()
    secret = tmp_path / "secret"
    if token is not None:
        credentials(secret, token)
    host = Host(root, secret)
    with pytest.raises(install.InstallError, match=re.escape(message)):
        host.run(make_bundle(tmp_path), {**init_env(), **env})
    assert host.files() == set()


def test_a_conflist_that_sorts_first_is_warned_about(host: Host, tmp_path: Path) -> None:
    conf_dir = host.path("/etc/cni/net.d")
    conf_dir.mkdir(parents=True)
    (conf_dir / "05-other.conflist").write_text("{}")
    host.run(make_bundle(tmp_path))
    assert any("05-other.conflist sorts before 10-tabby.conflist" in line for line in host.lines)


def test_the_command_line(tmp_path: Path) -> None:
    host = tmp_path / "host"
    host.mkdir()
    bundle = make_bundle(tmp_path)
    env = init_env()
    runner = CliRunner()
    secret = credentials(tmp_path / "secret")
    args = ["node", "install", "--host-root", str(host), "--bundle", str(bundle)]
    args += ["--cni-credentials", str(secret)]
    result = runner.invoke(cli, args, env={**env, "TABBY_NODENAME": "node-7"})
    assert result.exit_code == 0, result.output
    assert "tabby installed on node-7" in result.output
    assert (host / "var/lib/tabby/nodename").read_text() == "node-7\n"
    missing = runner.invoke(cli, args, env={**env, "TABBY_NODENAME": ""})
    assert missing.exit_code == 1
    assert "no node name" in missing.output
    bad = runner.invoke(cli, [*args, "--nodename", "Not_A_Node"], env=env)
    assert bad.exit_code == 1
    assert "node name 'Not_A_Node'" in bad.output
    assert "Traceback" not in bad.output + missing.output
    no_template = runner.invoke(
        cli, [*args, "--nodename", "n"], env={**env, "TABBY_CNI_NETWORK_CONFIG": ""}
    )
    assert no_template.exit_code == 1
    assert "no conflist template" in no_template.output
