"""manifests/tabby.yaml's privileges (docs/security.md "What each container may do"): no
container is privileged, each holds the capabilities it needs and says what for, every root
filesystem is read-only with the paths the programs write mounted as volumes, and every
container has requests and limits. The Kubernetes tier runs the manifest with exactly these
(tests/kubernetes/test_manifest.py reads the running processes' capabilities)."""

from __future__ import annotations

import json
import re
from typing import Any

from tests import REPO_ROOT as ROOT
from tests.unit.manifests.test_tabby_yaml import DOCS, containers, one

TEXT = (ROOT / "manifests" / "tabby.yaml").read_text()
WORKLOADS = [
    one("DaemonSet", "tabby-node"),
    one("Deployment", "tabby-kube-controllers"),
    one("Deployment", "tabby-typha"),
]
ALL = [(w["metadata"]["name"], c) for w in WORKLOADS for c in containers(w)]
#: What tabby-node needs, each for the reason docs/security.md gives (measured on the
#: Kubernetes tier: without any one of them it fails).
NODE_CAPABILITIES = {"NET_ADMIN", "SYS_ADMIN", "SYS_CHROOT", "NET_BIND_SERVICE"}


def _quantity(value: str) -> float:
    """A Kubernetes quantity as a number (cores, bytes)."""
    units = {"m": 1e-3, "Ki": 2**10, "Mi": 2**20, "Gi": 2**30}
    for suffix, factor in units.items():
        if value.endswith(suffix):
            return float(value[: -len(suffix)]) * factor
    return float(value)


def test_no_container_is_privileged_and_each_drops_every_capability() -> None:
    assert "privileged: true" not in TEXT
    for workload, c in ALL:
        sc = c["securityContext"]
        assert "privileged" not in sc, (workload, c["name"])
        assert sc["capabilities"]["drop"] == ["ALL"], (workload, c["name"])
        assert sc["readOnlyRootFilesystem"] is True, (workload, c["name"])
        assert sc["seccompProfile"] == {"type": "RuntimeDefault"}, (workload, c["name"])
        # the API server refuses allowPrivilegeEscalation false beside SYS_ADMIN
        if "SYS_ADMIN" in sc["capabilities"].get("add", []):
            assert "allowPrivilegeEscalation" not in sc
        else:
            assert sc["allowPrivilegeEscalation"] is False, (workload, c["name"])


def test_tabby_node_adds_what_it_needs_each_with_what_it_is_for() -> None:
    """Exactly NODE_CAPABILITIES; each one comes after a comment (what it is for) and is in
    docs/security.md's table; the installer and the controllers add none."""
    added = {(w, c["name"]): c["securityContext"]["capabilities"].get("add", []) for w, c in ALL}
    assert set(added.pop(("tabby-node", "tabby-node"))) == NODE_CAPABILITIES
    assert all(v == [] for v in added.values()), added
    lines = TEXT.splitlines()
    doc = (ROOT / "docs" / "security.md").read_text()
    for cap in NODE_CAPABILITIES:
        (at,) = [i for i, line in enumerate(lines) if line.strip() == f"- {cap}"]
        assert lines[at - 1].strip().startswith("#"), f"{cap}: no comment says what it is for"
        assert re.search(rf"^\| `{cap}` \| .+ \|", doc, re.M), f"{cap} not in docs/security.md"
    annotations = one("DaemonSet", "tabby-node")["spec"]["template"]["metadata"]["annotations"]
    apparmor = "container.apparmor.security.beta.kubernetes.io/tabby-node"
    assert annotations == {apparmor: "unconfined"}


def test_the_controllers_and_typha_run_as_no_root_and_read_their_keys_by_group() -> None:
    for name in ("tabby-kube-controllers", "tabby-typha"):
        spec = one("Deployment", name)["spec"]["template"]["spec"]
        pod = spec["securityContext"]
        assert pod["runAsNonRoot"] is True
        assert pod["runAsUser"] > 0
        assert pod["runAsGroup"] > 0
        assert pod["fsGroup"] == pod["runAsGroup"]
        for secret in [v["secret"] for v in spec["volumes"] if "secret" in v]:
            assert secret["defaultMode"] == 0o440  # root's, readable by the group
    # tabby-node and the installer stay root: the host's directories they write are root's
    ds = one("DaemonSet", "tabby-node")["spec"]["template"]["spec"]
    assert "securityContext" not in ds


def _mounts(c: dict[str, Any]) -> dict[str, bool]:
    """mountPath -> writable."""
    return {m["mountPath"]: not m.get("readOnly", False) for m in c["volumeMounts"]}


def test_the_paths_the_programs_write_are_writable_volumes() -> None:
    """A read-only root filesystem: every directory a program writes by default is a
    volume mounted writable (the defaults read from the code)."""
    from datastore.etcd.store import DEFAULT_LOCK_DIR as ETCD_LOCKS
    from stores.kube.store import DEFAULT_LOCK_DIR as KUBE_LOCKS
    from tabby_node import DEFAULT_CNI_CONF_DIR, DEFAULT_RUN_DIR
    from tabby_node.options import DEFAULT_STATE_DIR
    from tabbyctl.install import STATE_DIR

    init, node = containers(one("DaemonSet", "tabby-node"))
    (ctl,) = containers(one("Deployment", "tabby-kube-controllers"))

    def writable(c: dict[str, Any], path: str) -> bool:
        return any(
            ok and (path == m or path.startswith(m.rstrip("/") + "/"))
            for m, ok in _mounts(c).items()
        )

    # (the CNI configuration directory: an uninstall removes tabby's conflist from it)
    cni_conf_dir = f"/host{DEFAULT_CNI_CONF_DIR}"  # not where tabbyctl looks (test_tabby_yaml)
    for path in (DEFAULT_RUN_DIR, DEFAULT_STATE_DIR, KUBE_LOCKS, ETCD_LOCKS, cni_conf_dir):
        assert writable(node, path), path
    for path in (KUBE_LOCKS, ETCD_LOCKS):
        assert writable(ctl, path), path
    for path in ("/opt/tabby", "/opt/cni/bin", "/etc/cni/net.d", STATE_DIR):
        assert writable(init, f"/host{path}"), path
    # and nothing else of theirs is writable: the secrets and the bundle tabby-node runs
    assert {p for p, ok in _mounts(node).items() if ok} == {
        DEFAULT_RUN_DIR,
        DEFAULT_STATE_DIR,
        cni_conf_dir,
    }
    assert {p for p, ok in _mounts(ctl).items() if ok} == {DEFAULT_RUN_DIR}
    (typha,) = containers(one("Deployment", "tabby-typha"))
    assert {p for p, ok in _mounts(typha).items() if ok} == set()  # it writes no file
    volumes = {
        v["name"]: v
        for v in one("Deployment", "tabby-kube-controllers")["spec"]["template"]["spec"]["volumes"]
    }
    assert volumes["run-tabby"]["emptyDir"]["medium"] == "Memory"  # nothing of it persists


def test_every_container_has_requests_and_limits() -> None:
    """Requests and limits of CPU and memory, the limits at least the requests; tabby-node's
    memory limit more than four times the largest resident size measured of it (at 1000
    nodes of 20 pods: bench/results/node_memory_bench.json). tabby-node alone has no CPU
    limit: every pod start waits on it, and a quota throttles it in a burst of them."""
    for workload, c in ALL:
        res = c["resources"]
        for what in ("cpu", "memory"):
            if (c["name"], what) == ("tabby-node", "cpu"):
                assert what not in res["limits"]
                assert res["requests"][what]
                continue
            request, limit = res["requests"][what], res["limits"][what]
            assert _quantity(limit) >= _quantity(request), (workload, c["name"], what)
    bench = json.loads((ROOT / "bench" / "results" / "node_memory_bench.json").read_text())
    (table,) = bench["tables"]
    column = table["columns"].index("RSS step 2")
    largest = max(float(row[column].removesuffix(" MB")) * 1e6 for row in table["rows"])
    (_, node) = containers(one("DaemonSet", "tabby-node"))
    assert _quantity(node["resources"]["limits"]["memory"]) > 4 * largest


def test_every_workload_is_covered() -> None:
    """No pod template escapes these tests."""
    templates = [d for d in DOCS if "template" in d.get("spec", {})]
    assert [d["metadata"]["name"] for d in templates] == [w["metadata"]["name"] for w in WORKLOADS]
