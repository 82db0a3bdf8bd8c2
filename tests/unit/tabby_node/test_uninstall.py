"""tabby-node's stop in Kubernetes: an uninstall told apart from a restart (its DaemonSet
read from the in-memory API server, tests/kube_fake.py), and what an uninstall removes
(tabby_node.uninstall). The Kubernetes tier does both on a real cluster
(tests/kubernetes/test_manifest.py)."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from pathlib import Path

import pytest

from stores.kube.client import ApiError
from tabby_node import CNI_KUBECONFIG_NAME, CNI_TLS_DIR, CONFLIST_NAME
from tabby_node.uninstall import Uninstall, read_verdict, remove_cni_files
from tests.kube_fake import FakeApi, fake_api, write_kubeconfig

DAEMONSET = "tabby-system/tabby-node"
DAEMONSETS = "/apis/apps/v1/daemonsets"


def daemonset(deleting: bool = False) -> dict[str, object]:
    meta: dict[str, object] = {"name": "tabby-node", "namespace": "tabby-system"}
    if deleting:
        meta["deletionTimestamp"] = "2026-01-01T00:00:00Z"
    return {"apiVersion": "apps/v1", "kind": "DaemonSet", "metadata": meta}


def namespace_deleting() -> dict[str, object]:
    meta = {"name": "tabby-system", "deletionTimestamp": "2026-01-01T00:00:00Z"}
    return {"apiVersion": "v1", "kind": "Namespace", "metadata": meta}


@pytest.fixture
def api(tmp_path: Path) -> Iterator[tuple[FakeApi, str]]:
    with fake_api() as (fake, url):
        yield fake, write_kubeconfig(str(tmp_path / "kubeconfig"), url)


@pytest.fixture
def node_files(tmp_path: Path) -> Path:
    """What the installer leaves in the CNI configuration directory, and another network's
    file beside it."""
    conf = tmp_path / "net.d"
    (conf / CNI_TLS_DIR).mkdir(parents=True)
    (conf / CNI_TLS_DIR / "etcd-ca").write_text("ca")
    (conf / CONFLIST_NAME).write_text("{}")
    (conf / CNI_KUBECONFIG_NAME).write_text("{}")
    (conf / "20-other.conflist").write_text("{}")
    return conf


class Node:
    """The stop step as tabby-node registers it, with a table that records its deletion."""

    def __init__(self, conf: Path, kubeconfig: str, removed: str | None = None) -> None:
        self.table_deleted = 0
        self.step = Uninstall(
            DAEMONSET,
            str(conf),
            kubeconfig=kubeconfig,
            store_removed=lambda: removed,
            delete_table=self._delete,
        )

    def _delete(self) -> None:
        self.table_deleted += 1


def test_a_restart_keeps_everything_while_the_daemonset_is_there(
    api: tuple[FakeApi, str], node_files: Path, caplog: pytest.LogCaptureFixture
) -> None:
    fake, kubeconfig = api
    fake.put(DAEMONSETS, daemonset())
    # even with tabby's definitions seen going: the DaemonSet decides first
    node = Node(node_files, kubeconfig, removed="ippools.tabby.io being deleted")
    with caplog.at_level(logging.WARNING, "tabby.node"):
        node.step()
    assert sorted(p.name for p in node_files.iterdir()) == sorted(
        [CONFLIST_NAME, CNI_KUBECONFIG_NAME, CNI_TLS_DIR, "20-other.conflist"]
    )
    assert node.table_deleted == 0
    assert "not uninstalled (the DaemonSet tabby-system/tabby-node is there)" in caplog.text
    assert fake.requests == [
        "GET /apis/apps/v1/namespaces/tabby-system/daemonsets/tabby-node",
        "GET /api/v1/namespaces/tabby-system",
    ]


@pytest.mark.parametrize(
    "how", ["gone", "being deleted", "its namespace being deleted", "credentials refused"]
)
def test_an_uninstall_removes_the_conflist_credentials_and_table(
    api: tuple[FakeApi, str], node_files: Path, how: str, caplog: pytest.LogCaptureFixture
) -> None:
    fake, kubeconfig = api
    if how == "being deleted":
        fake.put(DAEMONSETS, daemonset(deleting=True))
    elif how == "its namespace being deleted":  # its controller deletes the pods first
        fake.put(DAEMONSETS, daemonset())
        fake.put("/api/v1/namespaces", namespace_deleting())
    elif how == "credentials refused":
        fake.put(DAEMONSETS, daemonset())
        fake.unauthorized = True  # its ServiceAccount deleted
    node = Node(node_files, kubeconfig)
    with caplog.at_level(logging.WARNING, "tabby.node"):
        node.step()
    # another network's file stays
    assert [p.name for p in node_files.iterdir()] == ["20-other.conflist"]
    assert node.table_deleted == 1
    assert "tabby is uninstalled" in caplog.text
    assert "no new pod starts here" in caplog.text


def test_a_forbidden_read_is_an_uninstall() -> None:
    """403: the Role that comes with --daemonset in the manifest is gone (kubectl deletes it
    before it reaches the DaemonSet)."""

    def get(path: str) -> dict[str, object]:
        raise ApiError(403, "Forbidden")

    verdict = read_verdict(DAEMONSET, get, None)
    assert verdict.uninstall
    assert "may no longer read its DaemonSet" in verdict.why


@pytest.mark.parametrize("status", [0, 500, 503])
def test_an_api_that_decides_nothing_keeps_everything_unless_the_store_was_removed(
    status: int,
) -> None:
    def get(path: str) -> dict[str, object]:
        raise ApiError(status, "refused")

    kept = read_verdict(DAEMONSET, get, None)
    assert not kept.uninstall
    assert "cannot read the DaemonSet tabby-system/tabby-node" in kept.why
    removed = read_verdict(DAEMONSET, get, "ippools.tabby.io: being deleted")
    assert removed.uninstall
    assert "tabby's definitions are being deleted" in removed.why


def test_without_an_api_configuration_nothing_is_removed(
    node_files: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    monkeypatch.delenv("KUBECONFIG", raising=False)
    node = Node(node_files, kubeconfig="")
    verdict = node.step.verdict()
    assert not verdict.uninstall, verdict
    assert "no API configuration" in verdict.why
    node.step()
    assert (node_files / CONFLIST_NAME).exists()
    assert node.table_deleted == 0


def test_removing_the_files_twice_is_fine(node_files: Path) -> None:
    first = remove_cni_files(str(node_files))
    assert [Path(p).name for p in first] == [CONFLIST_NAME, CNI_KUBECONFIG_NAME, CNI_TLS_DIR]
    assert remove_cni_files(str(node_files)) == []
