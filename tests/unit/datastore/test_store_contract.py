"""The Store contract, one suite for every implementation (+ file-store specifics)."""

from __future__ import annotations

import errno
import os
import signal
import stat
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from datastore.base import KINDS, Doc, Store
from datastore.etcd.store import EtcdStore
from datastore.file import FileStore, escape_key, unescape_name
from datastore.memory import MemoryStore
from ipam.core.errors import (
    InvalidConfig,
    LockTimeout,
    RevisionConflict,
    StoreCorrupt,
    StoreUnavailable,
)
from stores import open_store
from tests.unit.datastore.sync_mirror import Mirror

# -- the stores under test: memory, file, and etcd (one member for the module) ------------


@pytest.fixture
def store(every_store: Store) -> Store:
    return every_store


def corrupt(store: Store, kind: str, key: str, content: bytes = b'{"format": 1, "rev') -> str:
    """Make one document unreadable the way a torn write or bad disk would."""
    if isinstance(store, MemoryStore):
        store.corrupt(kind, key)
    elif isinstance(store, EtcdStore):
        assert store.get(kind, key) is not None
        store.client.put(store.raw_key(kind, key), content)
    else:
        assert store.get(kind, key) is not None
        Path(store.location(kind, key)).write_bytes(content)
    return store.location(kind, key)


# -- CAS semantics ------------------------------------------------------------------------


def test_create_then_get(store: Store) -> None:
    rev = store.put("block", "10.0.0.0/26", {"a": [1, None, "x"]}, None)
    assert rev > 0
    doc = store.get("block", "10.0.0.0/26")
    assert doc is not None
    assert doc.data == {"a": [1, None, "x"]}
    assert doc.revision == rev
    assert store.get("block", "10.0.0.64/26") is None
    assert store.get("handle", "10.0.0.0/26") is None  # kinds are separate


def test_get_returns_a_copy(store: Store) -> None:
    store.put("pool", "p", {"list": [1]}, None)
    doc = store.get("pool", "p")
    assert doc is not None
    doc.data["list"].append(2)
    again = store.get("pool", "p")
    assert again is not None
    assert again.data == {"list": [1]}


def test_create_existing_conflicts(store: Store) -> None:
    store.put("pool", "p", {"v": 1}, None)
    with pytest.raises(RevisionConflict):
        store.put("pool", "p", {"v": 2}, None)
    doc = store.get("pool", "p")
    assert doc is not None
    assert doc.data == {"v": 1}


def test_update_needs_current_revision(store: Store) -> None:
    r1 = store.put("handle", "n:c:eth0", {"v": 1}, None)
    r2 = store.put("handle", "n:c:eth0", {"v": 2}, r1)
    assert r2 > r1
    with pytest.raises(RevisionConflict):
        store.put("handle", "n:c:eth0", {"v": 3}, r1)  # stale
    with pytest.raises(RevisionConflict):
        store.put("handle", "other", {"v": 3}, r2)  # missing document
    doc = store.get("handle", "n:c:eth0")
    assert doc is not None
    assert doc.data == {"v": 2}
    assert doc.revision == r2


def test_delete_needs_current_revision(store: Store) -> None:
    r1 = store.put("affinity", "node-a", {"v": 1}, None)
    r2 = store.put("affinity", "node-a", {"v": 2}, r1)
    with pytest.raises(RevisionConflict):
        store.delete("affinity", "node-a", r1)
    store.delete("affinity", "node-a", r2)
    assert store.get("affinity", "node-a") is None
    with pytest.raises(RevisionConflict):
        store.delete("affinity", "node-a", r2)  # missing = conflict too
    r3 = store.put("affinity", "node-a", {"v": 3}, None)
    assert r3 not in (r1, r2)  # a stale revision can never match a re-created document
    with pytest.raises(RevisionConflict):
        store.put("affinity", "node-a", {"v": 4}, r2)


def test_list_keys_roundtrip_odd_keys(store: Store) -> None:
    keys = [
        "10.244.0.64/26",
        "fd00:10:244::40/122",
        "k8s-pod-network:0123abcd:eth0",
        ".hidden",
        "sp ace%and/slash",
        "ünï",
        "..",
    ]
    for k in keys:
        store.put("handle", k, {"k": k}, None)
    store.put("block", "10.0.0.0/26", {}, None)
    assert store.list_keys("handle") == sorted(keys)
    assert store.list_keys("block") == ["10.0.0.0/26"]
    assert store.list_keys("pool") == []
    for k in keys:
        doc = store.get("handle", k)
        assert doc is not None
        assert doc.data == {"k": k}


def test_rejects_unknown_kind_empty_key_and_non_json(store: Store) -> None:
    with pytest.raises(ValueError, match="kind"):
        store.get("blocks", "x")
    with pytest.raises(ValueError, match="key"):
        store.put("pool", "", {}, None)
    with pytest.raises((TypeError, ValueError)):
        store.put("pool", "p", {"x": {1, 2}}, None)
    with pytest.raises(ValueError):
        store.put("pool", "p", {"x": float("nan")}, None)
    assert store.get("pool", "p") is None


def test_delete_needs_a_revision(store: Store) -> None:
    """``delete(..., None)`` is a programming error, not an assertion that nothing is there."""
    store.put("pool", "p", {}, None)
    for stored in ("p", "missing"):
        with pytest.raises(TypeError, match="revision"):
            store.delete("pool", stored, None)  # type: ignore[arg-type]
    assert store.get("pool", "p") is not None


def test_check_usable_on_fresh_store(store: Store) -> None:
    store.check_usable()
    store.put("pool", "p", {}, None)
    store.check_usable()


# -- lock ---------------------------------------------------------------------------------


def test_lock_is_exclusive_and_times_out(
    store: Store, tmp_path: Path, subprocess_env: dict[str, str]
) -> None:
    store.put("pool", "p", {}, None)  # the file store now has its directory
    short = _with_timeout(store, 0.3)
    if isinstance(store, MemoryStore):
        held = threading.Event()
        done = threading.Event()

        def holder() -> None:
            with store.lock():
                held.set()
                done.wait(10)

        t = threading.Thread(target=holder)
        t.start()
        try:
            assert held.wait(5)
            _assert_times_out(short, 0.3)
        finally:
            done.set()
            t.join()
    else:
        if isinstance(store, EtcdStore):  # another process on this node
            make = (
                f"EtcdStore({store.endpoints!r}, prefix={store.prefix!r}, "
                f"lock_dir={store.lock_dir!r})"
            )
            imp = "from datastore.etcd.store import EtcdStore\n"
        else:
            assert isinstance(store, FileStore)
            make = f"FileStore({store.data_dir!r})"
            imp = "from datastore.file import FileStore\n"
        code = (
            f"import sys, time\n{imp}s = {make}\n"
            "with s.lock():\n"
            "    print('held', flush=True)\n"
            "    time.sleep(30)\n"
        )
        proc = subprocess.Popen(
            [sys.executable, "-c", code], stdout=subprocess.PIPE, env=subprocess_env, text=True
        )
        try:
            assert proc.stdout is not None
            assert proc.stdout.readline().strip() == "held"
            _assert_times_out(short, 0.3)
        finally:
            proc.kill()
            proc.wait()
            assert proc.stdout is not None
            proc.stdout.close()
    with short.lock():  # free again once the holder is gone
        pass


def _with_timeout(store: Store, timeout: float) -> Store:
    if isinstance(store, MemoryStore):
        store.lock_timeout = timeout
        return store
    if isinstance(store, EtcdStore):
        return EtcdStore(
            store.endpoints, prefix=store.prefix, lock_timeout=timeout, lock_dir=store.lock_dir
        )
    assert isinstance(store, FileStore)
    return FileStore(store.data_dir, lock_timeout=timeout)


def _assert_times_out(store: Store, timeout: float) -> None:
    t0 = time.monotonic()
    with pytest.raises(LockTimeout), store.lock():
        pytest.fail("lock acquired while held elsewhere")
    elapsed = time.monotonic() - t0
    assert timeout * 0.9 <= elapsed < timeout + 1.5


def test_lock_released_after_exception(store: Store) -> None:
    with pytest.raises(RuntimeError), store.lock():
        raise RuntimeError("boom")
    short = _with_timeout(store, 0.2)
    with short.lock():
        pass


def test_lock_of_one_object_serialises_its_threads(store: Store) -> None:
    """One store object serving several threads (as in tabby-node): while one thread holds
    the lock, another waits for it (LockTimeout if it is not let go in time), never taken for
    a re-entry."""
    short = _with_timeout(store, 0.5)
    held = threading.Event()
    done = threading.Event()

    def holder() -> None:
        with short.lock():
            held.set()
            done.wait(10)

    t = threading.Thread(target=holder)
    t.start()
    try:
        assert held.wait(5)
        _assert_times_out(short, 0.5)
    finally:
        done.set()
        t.join()
    try:
        with short.lock():
            pass
        assert short.put("pool", "p", {}, None) > 0
    finally:
        if short is not store:
            short.close()


# -- corruption ---------------------------------------------------------------------------


def test_corrupt_document_names_its_path_and_spares_others(store: Store) -> None:
    store.put("block", "10.0.0.0/26", {"ok": True}, None)
    store.put("block", "10.0.0.64/26", {"ok": True}, None)
    path = corrupt(store, "block", "10.0.0.64/26")
    with pytest.raises(StoreCorrupt) as info:
        store.get("block", "10.0.0.64/26")
    assert info.value.path == path
    assert path in str(info.value)
    with pytest.raises(StoreCorrupt):
        store.put("block", "10.0.0.64/26", {}, 1)
    doc = store.get("block", "10.0.0.0/26")
    assert doc is not None
    assert doc.data == {"ok": True}
    assert "10.0.0.64/26" in store.list_keys("block")


@pytest.mark.parametrize(
    "content",
    [
        b"",
        b'{"format": 1, "kind": "block", "key": "10.0.0.0/26", "revision": 3, "da',
        b"\xff\xfe",
        b"[1, 2]",
        b'{"format": 1, "kind": "block", "key": "other", "revision": 3, "data": {}}',
        b'{"format": 1, "kind": "block", "key": "10.0.0.0/26", "revision": "3", "data": {}}',
        b"[" * 100_000,  # found by fuzzing: RecursionError out of the store, not StoreCorrupt
    ],
    ids=["empty", "truncated", "binary", "not-object", "wrong-key", "bad-revision", "deep"],
)
def test_file_store_truncated_or_garbage(file_store: FileStore, content: bytes) -> None:
    file_store.put("block", "10.0.0.0/26", {"v": 1}, None)
    Path(file_store.location("block", "10.0.0.0/26")).write_bytes(content)
    with pytest.raises(StoreCorrupt) as info:
        file_store.get("block", "10.0.0.0/26")
    assert info.value.path == file_store.location("block", "10.0.0.0/26")


# -- file store specifics ---------------------------------------------------------------


def _mode(path: str | Path) -> int:
    return stat.S_IMODE(os.lstat(path).st_mode)


def test_file_store_layout_and_permissions(tmp_path: Path) -> None:
    old = os.umask(0o022)
    try:
        data_dir = tmp_path / "a" / "b" / "ipam"
        store = FileStore(str(data_dir))
        assert store.get("pool", "p") is None
        assert not data_dir.exists()  # reads never create anything
        store.put("block", "10.0.0.0/26", {}, None)
        with store.lock():
            pass
    finally:
        os.umask(old)
    for d in (tmp_path / "a", tmp_path / "a" / "b", data_dir, data_dir / "blocks"):
        assert _mode(d) == 0o700, d
    assert (data_dir / "blocks" / "10.0.0.0%2F26.json").is_file()
    assert _mode(data_dir / "blocks" / "10.0.0.0%2F26.json") == 0o600
    assert _mode(data_dir / "lock") == 0o600
    assert sorted(os.listdir(data_dir)) == ["blocks", "lock"]


def test_file_store_tightens_loose_data_dir(tmp_path: Path) -> None:
    data_dir = tmp_path / "ipam"
    data_dir.mkdir(mode=0o755)
    os.chmod(data_dir, 0o755)
    store = FileStore(str(data_dir))
    with store.lock():
        pass
    assert _mode(data_dir) == 0o700


def test_file_store_refuses_symlinked_data_dir(tmp_path: Path) -> None:
    real = tmp_path / "real"
    real.mkdir(mode=0o700)
    link = tmp_path / "link"
    link.symlink_to(real)
    store = FileStore(str(link))
    with pytest.raises(StoreCorrupt) as info:
        store.put("pool", "p", {}, None)
    assert info.value.path == str(link)
    with pytest.raises(StoreCorrupt):
        store.get("pool", "p")
    with pytest.raises(StoreCorrupt), store.lock():
        pass
    with pytest.raises(StoreCorrupt):
        store.check_usable()
    assert list(real.iterdir()) == []


def test_file_store_refuses_symlinked_kind_dir_and_document(tmp_path: Path) -> None:
    store = FileStore(str(tmp_path / "ipam"))
    store.put("pool", "p", {}, None)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (tmp_path / "ipam" / "blocks").symlink_to(elsewhere)
    with pytest.raises(StoreCorrupt):
        store.put("block", "10.0.0.0/26", {}, None)
    with pytest.raises(StoreCorrupt):
        store.list_keys("block")
    with pytest.raises(StoreCorrupt):
        store.check_usable()
    assert list(elsewhere.iterdir()) == []
    # a document that is a symlink is neither read nor written through
    target = tmp_path / "target.json"
    target.write_text("{}")
    store.put("handle", "other", {}, None)
    os.symlink(target, store.location("handle", "h"))
    with pytest.raises(StoreCorrupt):
        store.get("handle", "h")
    with pytest.raises(StoreCorrupt):
        store.put("handle", "h", {"x": 1}, None)
    assert target.read_text() == "{}"


def test_file_store_check_usable(tmp_path: Path) -> None:
    FileStore(str(tmp_path / "missing" / "ipam")).check_usable()  # creatable: fine
    assert not (tmp_path / "missing").exists()
    (tmp_path / "file").write_text("")
    with pytest.raises(StoreCorrupt):
        FileStore(str(tmp_path / "file")).check_usable()
    store = FileStore(str(tmp_path / "ipam"))
    with store.lock():
        pass
    os.unlink(tmp_path / "ipam" / "lock")
    os.symlink("/etc/passwd", tmp_path / "ipam" / "lock")
    with pytest.raises(StoreCorrupt):
        store.check_usable()


@pytest.mark.parametrize("fail", ["replace", "fsync"])
def test_file_store_write_failure_is_store_unavailable(
    file_store: FileStore, monkeypatch: pytest.MonkeyPatch, fail: str
) -> None:
    rev = file_store.put("pool", "p", {"v": 1}, None)

    def broken(*args: object, **kwargs: object) -> None:
        raise OSError(errno.EROFS, os.strerror(errno.EROFS))

    monkeypatch.setattr(os, fail, broken)
    with pytest.raises(StoreUnavailable) as info:
        file_store.put("pool", "p", {"v": 2}, rev)
    monkeypatch.undo()
    assert info.value.path == file_store.location("pool", "p")
    doc = file_store.get("pool", "p")
    assert doc is not None
    assert doc.data == {"v": 1}
    assert doc.revision == rev
    pools = Path(file_store.location("pool", "p")).parent
    assert os.listdir(pools) == ["p.json"]  # the temp file went away


def test_file_store_temp_files_are_not_documents(file_store: FileStore) -> None:
    file_store.put("pool", "p", {}, None)
    pools = Path(file_store.location("pool", "p")).parent
    (pools / ".p.json.123.abcd.tmp").write_text("{")
    assert file_store.list_keys("pool") == ["p"]


def test_file_store_removes_temp_files_of_a_killed_writer(
    file_store: FileStore, subprocess_env: dict[str, str]
) -> None:
    file_store.put("pool", "p", {"v": 1}, None)
    code = (
        "import os, sys, time\n"
        "from datastore.file import FileStore\n"
        "s = FileStore(sys.argv[1])\n"
        "real_fsync = os.fsync\n"
        "def hang(fd):\n"
        "    print('writing', flush=True)\n"
        "    time.sleep(60)\n"
        "os.fsync = hang\n"
        "with s.lock():\n"
        "    doc = s.get('pool', 'p')\n"
        "    s.put('pool', 'p', {'v': 2}, doc.revision)\n"
    )
    proc = subprocess.Popen(
        [sys.executable, "-c", code, file_store.data_dir],
        stdout=subprocess.PIPE,
        env=subprocess_env,
        text=True,
    )
    assert proc.stdout is not None
    assert proc.stdout.readline().strip() == "writing"
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    proc.stdout.close()
    pools = Path(file_store.location("pool", "p")).parent
    assert [n for n in os.listdir(pools) if n.endswith(".tmp")], "the writer left no temp file"
    assert os.path.getsize(Path(file_store.data_dir) / "lock") > 0
    doc = file_store.get("pool", "p")
    assert doc is not None
    assert doc.data == {"v": 1}
    with file_store.lock():
        assert not [n for n in os.listdir(pools) if n.endswith(".tmp")]
    assert os.path.getsize(Path(file_store.data_dir) / "lock") == 0


def test_file_store_clean_unlock_leaves_no_marker(file_store: FileStore) -> None:
    with file_store.lock():
        file_store.put("pool", "p", {}, None)
        assert os.path.getsize(Path(file_store.data_dir) / "lock") > 0
    assert os.path.getsize(Path(file_store.data_dir) / "lock") == 0


def test_file_store_lock_is_not_reentrant(file_store: FileStore) -> None:
    with file_store.lock(), pytest.raises(RuntimeError), file_store.lock():
        pass


@pytest.mark.parametrize(
    ("key", "name"),
    [
        ("10.0.0.0/26", "10.0.0.0%2F26.json"),
        ("fd00::/122", "fd00::%2F122.json"),
        ("net:cid:eth0", "net:cid:eth0.json"),
        (".x", "%2Ex.json"),
        ("a b%", "a%20b%25.json"),
        ("é", "%C3%A9.json"),
    ],
)
def test_escape_roundtrip(key: str, name: str) -> None:
    assert escape_key(key) == name
    assert unescape_name(name) == key


def test_unescape_ignores_non_documents() -> None:
    assert unescape_name(".p.json.1.ab.tmp") is None
    assert unescape_name("lock") is None
    assert unescape_name("%zz.json") is None


def test_kinds_are_the_documented_ones() -> None:
    assert KINDS == (
        "pool",
        "block",
        "handle",
        "affinity",
        "node",
        "bgpconfiguration",
        "bgppeer",
        "networkpolicy",
        "namespace",
        "serviceaccount",
        "pod",
        "workloadendpoint",
        "calico-networkpolicy",
        "globalnetworkpolicy",
        "stagednetworkpolicy",
        "stagedglobalnetworkpolicy",
        "stagedkubernetesnetworkpolicy",
        "tier",
        "networkset",
        "globalnetworkset",
        "hostendpoint",
        "heartbeat",
        "trace",
    )


def test_layouts_are_the_documented_ones(tmp_path: Path) -> None:
    """Where each kind lives in the file store and in etcd (the modules' docstrings): data
    already stored depends on it."""
    files = FileStore(str(tmp_path))
    etcd = EtcdStore(["http://127.0.0.1:1"], prefix="/p", lock_dir=str(tmp_path))
    ipam = {"pool": "pools", "block": "blocks", "handle": "handles", "affinity": "affinities"}
    resources = {
        "node": "nodes",
        "bgpconfiguration": "bgpconfigurations",
        "bgppeer": "bgppeers",
        "networkpolicy": "networkpolicies",
        "namespace": "namespaces",
        "serviceaccount": "serviceaccounts",
        "pod": "pods",
        "workloadendpoint": "workloadendpoints",
    }
    calico = {
        "calico-networkpolicy": "calico-networkpolicies",
        "globalnetworkpolicy": "globalnetworkpolicies",
        "stagednetworkpolicy": "stagednetworkpolicies",
        "stagedglobalnetworkpolicy": "stagedglobalnetworkpolicies",
        "stagedkubernetesnetworkpolicy": "stagedkubernetesnetworkpolicies",
        "tier": "tiers",
        "networkset": "networksets",
        "globalnetworkset": "globalnetworksets",
        "hostendpoint": "hostendpoints",
    }
    others = {"heartbeat": "heartbeats", "trace": "traces"}
    for kind, plural in {**ipam, **resources, **calico, **others}.items():
        assert files.location(kind, "k") == f"{tmp_path}/{plural}/k.json"
        group = (
            "ipam/v1/"
            if kind in ipam
            else "resources/v1/"
            if kind in resources
            else "calico/v1/"
            if kind in calico
            else ""
        )
        assert etcd.location(kind, "k") == f"etcd:/p/{group}{plural}/k"


# == the extended contract (cluster mode) ==================================================

KEY_OF = {
    "pool": "10.244.0.0/16",
    "block": "10.244.0.64/26",
    "handle": "net:0123abcd:eth0",
    "affinity": "node-a",
    "node": "node-a",
    "bgpconfiguration": "default",
    "bgppeer": "rr-1",
    "networkpolicy": "default/deny-all",
    "namespace": "kube-system",
    "serviceaccount": "default/web",
    "pod": "default/web-0",
    "workloadendpoint": "default/web-0",
    "calico-networkpolicy": "default/deny-all",
    "globalnetworkpolicy": "deny-all",
    "stagednetworkpolicy": "default/deny-all",
    "stagedglobalnetworkpolicy": "deny-all",
    "stagedkubernetesnetworkpolicy": "default/deny-all",
    "tier": "security",
    "networkset": "default/external",
    "globalnetworkset": "external",
    "hostendpoint": "node-a.eth0",
    "heartbeat": "node-a",
    "trace": "0123456789abcdef.node-a",
}


def test_every_kind_is_separate_and_roundtrips(store: Store) -> None:
    assert set(KEY_OF) == set(KINDS)
    revs = {}
    for kind in KINDS:
        revs[kind] = store.put(kind, KEY_OF[kind], {"kind": kind}, None)
    for kind in KINDS:
        assert store.get(kind, KEY_OF[kind]) == Doc({"kind": kind}, revs[kind])
        assert store.list_keys(kind) == [KEY_OF[kind]]
        assert store.list(kind) == [(KEY_OF[kind], Doc({"kind": kind}, revs[kind]))]


# -- list ---------------------------------------------------------------------------------


def test_list_is_sorted_filtered_by_prefix_and_carries_revisions(store: Store) -> None:
    assert store.list("pod") == []
    revs = {}
    for key in ["ns-b/x", "ns-a/z", "ns-a/y", "ns-ab/w"]:
        revs[key] = store.put("pod", key, {"k": key}, None)
    store.put("namespace", "ns-a", {}, None)
    items = store.list("pod")
    assert [k for k, _ in items] == ["ns-a/y", "ns-a/z", "ns-ab/w", "ns-b/x"]
    for key, doc in items:
        assert doc == Doc({"k": key}, revs[key])
    assert [k for k, _ in store.list("pod", "ns-a/")] == ["ns-a/y", "ns-a/z"]
    assert store.list("pod", "zz") == []
    # the revision from list is good for a compare-and-swap
    key, doc = items[0]
    assert store.put("pod", key, {"k": 2}, doc.revision) > doc.revision


def test_list_returns_copies(store: Store) -> None:
    store.put("node", "n1", {"labels": {"a": "1"}}, None)
    ((_key, doc),) = store.list("node")
    doc.data["labels"]["b"] = "2"
    assert store.list("node")[0][1].data == {"labels": {"a": "1"}}


def test_list_raises_store_corrupt_naming_the_document(store: Store) -> None:
    store.put("block", "10.0.0.0/26", {"ok": True}, None)
    store.put("block", "10.0.0.64/26", {"ok": True}, None)
    path = corrupt(store, "block", "10.0.0.64/26")
    with pytest.raises(StoreCorrupt) as info:
        store.list("block")
    assert info.value.path == path
    assert [k for k, _ in store.list("block", "10.0.0.0")] == ["10.0.0.0/26"]


# -- ttl ----------------------------------------------------------------------------------


def _wait_until(cond: Callable[[], bool], timeout: float, what: str) -> float:
    t0 = time.monotonic()
    while not cond():
        if time.monotonic() - t0 > timeout:
            pytest.fail(f"{what}: not within {timeout} s")
        time.sleep(0.05)
    return time.monotonic() - t0


@pytest.mark.slow
def test_ttl_document_expires_and_reads_as_absent_everywhere(store: Store) -> None:
    rev = store.put_leased("heartbeat", "node-a", {"at": 1}, None, ttl=1)
    store.put("heartbeat", "node-b", {"at": 1}, None)
    assert store.get("heartbeat", "node-a") == Doc({"at": 1}, rev)
    assert store.list_keys("heartbeat") == ["node-a", "node-b"]
    _wait_until(lambda: store.get("heartbeat", "node-a") is None, 6, "expiry")
    assert store.list_keys("heartbeat") == ["node-b"]
    assert [k for k, _ in store.list("heartbeat")] == ["node-b"]
    with pytest.raises(RevisionConflict):
        store.put("heartbeat", "node-a", {"at": 2}, rev)
    with pytest.raises(RevisionConflict):
        store.delete("heartbeat", "node-a", rev)
    rev2 = store.put("heartbeat", "node-a", {"at": 3}, None)  # created again, permanent
    assert rev2 != rev
    assert store.get("heartbeat", "node-a") == Doc({"at": 3}, rev2)


@pytest.mark.slow
def test_ttl_is_renewed_by_a_write_and_dropped_by_a_write_without_ttl(store: Store) -> None:
    r1 = store.put_leased("heartbeat", "a", {"n": 1}, None, ttl=1)
    r2 = store.put_leased("heartbeat", "b", {"n": 1}, None, ttl=1)
    store.put("heartbeat", "b", {"n": 2}, r2)  # now permanent
    time.sleep(0.6)
    store.put_leased("heartbeat", "a", {"n": 2}, r1, ttl=30)  # renewed for long
    time.sleep(2.2)  # past both first deadlines (etcd rounds ttls up to whole seconds)
    a = store.get("heartbeat", "a")
    b = store.get("heartbeat", "b")
    assert a is not None
    assert a.data == {"n": 2}
    assert b is not None
    assert b.data == {"n": 2}


@pytest.mark.slow
def test_keepalive_keeps_a_document_without_a_revision_or_an_event(
    store: Store, mirrors: list[Mirror]
) -> None:
    """A node's liveness costs its watchers nothing: kept alive, a ttl document outlives its
    ttl with the same revision, and a watcher sees no event for it."""
    rev = store.put_leased("heartbeat", "node-a", {"n": 1}, None, ttl=2)
    store.put_leased("heartbeat", "node-b", {"n": 1}, None, ttl=2)
    m = Mirror(store, ["heartbeat"])
    mirrors.append(m)
    m.wait(lambda: "node-a" in m.state.get("heartbeat", {}))
    for _ in range(8):  # 4 s: twice the ttl
        assert store.keepalive("heartbeat", "node-a")
        time.sleep(0.5)
    assert store.get("heartbeat", "node-a") == Doc({"n": 1}, rev)
    m.wait(lambda: "node-b" not in m.state["heartbeat"], 8, "node-b's expiry")
    assert [(e.type, e.key) for e in m.events[1:]] == [("delete", "node-b")]
    assert not store.keepalive("heartbeat", "node-b")  # gone: write it again
    assert not store.keepalive("heartbeat", "never")
    store.put("heartbeat", "plain", {}, None)
    assert not store.keepalive("heartbeat", "plain")  # no ttl to renew


def test_ttl_must_be_positive(store: Store) -> None:
    for ttl in (0, -1, float("nan"), float("inf")):
        with pytest.raises(ValueError, match="ttl"):
            store.put_leased("heartbeat", "a", {}, None, ttl=ttl)
    assert store.get("heartbeat", "a") is None


# -- sync ---------------------------------------------------------------------------------


@pytest.fixture
def mirrors() -> Iterator[list[Mirror]]:
    made: list[Mirror] = []
    yield made
    for m in made:
        m.stop.set()
    for m in made:
        m.close()


def test_sync_snapshot_then_changes_in_order(store: Store, mirrors: list[Mirror]) -> None:
    r_a = store.put("node", "a", {"v": 1}, None)
    store.put("node", "b", {"v": 1}, None)
    store.put("pod", "ns/p", {"v": 1}, None)
    store.put("block", "10.0.0.0/26", {}, None)  # a kind not watched
    m = Mirror(store, ["node", "pod"])
    mirrors.append(m)
    m.wait(lambda: m.snapshots == 1)
    first = m.events[0]
    assert first.type == "snapshot"
    assert first.snapshot == {
        "node": {"a": Doc({"v": 1}, r_a), "b": store.get("node", "b")},
        "pod": {"ns/p": store.get("pod", "ns/p")},
    }
    r_a2 = store.put("node", "a", {"v": 2}, r_a)
    m.wait(lambda: m.state["node"]["a"].revision == r_a2)
    b = store.get("node", "b")
    assert b is not None
    store.delete("node", "b", b.revision)
    m.wait(lambda: "b" not in m.state["node"])
    store.put("pod", "ns/q", {"v": 1}, None)
    store.put("node", "c", {"v": 1}, None)
    store.put("block", "10.0.0.64/26", {}, None)
    m.wait_matches(store)
    assert [(e.type, e.kind, e.key) for e in m.events[1:3]] == [
        ("put", "node", "a"),
        ("delete", "node", "b"),
    ]
    assert {(e.type, e.kind, e.key) for e in m.events[3:]} == {
        ("put", "pod", "ns/q"),
        ("put", "node", "c"),
    }
    assert all(e.kind != "block" for e in m.events)
    assert m.snapshots == 1
    assert store.sync_stats == {"snapshots": 1, "rereads": 0, "resumes": 0}
    assert m.close() < 2.0


@pytest.mark.slow
def test_sync_reports_ttl_expiry_as_delete(store: Store, mirrors: list[Mirror]) -> None:
    store.put_leased("heartbeat", "node-a", {}, None, ttl=1)
    m = Mirror(store, ["heartbeat"])
    mirrors.append(m)
    m.wait(lambda: "node-a" in m.state.get("heartbeat", {}))
    m.wait(lambda: "node-a" not in m.state["heartbeat"], 8, "the expiry")
    last = m.events[-1]
    assert (last.type, last.kind, last.key) == ("delete", "heartbeat", "node-a")
    assert m.snapshots == 1


def test_sync_leaves_out_corrupt_documents(store: Store, mirrors: list[Mirror]) -> None:
    store.put("pod", "ns/good", {}, None)
    store.put("pod", "ns/bad", {}, None)
    corrupt(store, "pod", "ns/bad")
    m = Mirror(store, ["pod"])
    mirrors.append(m)
    m.wait(lambda: m.snapshots == 1)
    assert set(m.state["pod"]) == {"ns/good"}
    store.put("pod", "ns/new", {}, None)
    m.wait(lambda: "ns/new" in m.state["pod"])


def test_sync_ends_soon_after_stop_and_checks_its_arguments(store: Store) -> None:
    with pytest.raises(ValueError, match="kind"):
        store.sync(["pods"], threading.Event())
    with pytest.raises(ValueError):
        store.sync([], threading.Event())
    m = Mirror(store, ["pod"])
    m.wait(lambda: m.snapshots == 1)
    time.sleep(0.3)  # idle: nothing to report
    assert m.close() < 2.0
    stopped = threading.Event()
    stopped.set()
    assert [e.type for e in store.sync(["pod"], stopped)] in ([], ["snapshot"])


def test_close_is_idempotent(store: Store) -> None:
    store.put("pool", "p", {}, None)
    store.close()
    store.close()


# -- memory / file specifics of the extension ---------------------------------------------


def test_memory_resync_reports_only_the_differences() -> None:
    """``resync`` drops what the iterator had queued and reads again (as etcd's store does
    after a compaction): the changes it had not delivered come as puts and deletes, an
    unchanged document is not reported again, and there is no second snapshot."""
    store = MemoryStore()
    r_a = store.put("pod", "ns/a", {"v": 1}, None)
    store.put("pod", "ns/same", {}, None)
    r_gone = store.put("pod", "ns/gone", {}, None)
    store.put("node", "n", {}, None)
    stop = threading.Event()
    events = store.sync(["pod", "node"], stop)
    first = next(events)
    assert first.type == "snapshot"
    # changes the consumer has not taken yet, then the queue is dropped
    store.put("pod", "ns/a", {"v": 2}, r_a)
    store.delete("pod", "ns/gone", r_gone)
    store.put("pod", "ns/new", {}, None)
    store.resync()
    got = [next(events) for _ in range(3)]
    stop.set()
    got += list(events)
    assert [(e.type, e.kind, e.key) for e in got] == [
        ("delete", "pod", "ns/gone"),
        ("put", "pod", "ns/a"),
        ("put", "pod", "ns/new"),
    ]
    assert got[1].doc == store.get("pod", "ns/a")
    assert store.sync_stats == {"snapshots": 1, "rereads": 1, "resumes": 0}


def test_file_store_sync_failed_poll_reports_only_the_differences(
    file_store: FileStore, tmp_path: Path, mirrors: list[Mirror]
) -> None:
    """The pods' directory is swapped for a symlink (refused: every poll fails) while
    another writer changes, deletes and adds documents in it, then swapped back: one
    re-read reports exactly those changes (an unchanged document is not reported again, no
    second snapshot) and the mirror equals the store."""
    r_a = file_store.put("pod", "ns/a", {"v": 1}, None)
    file_store.put("pod", "ns/same", {}, None)
    file_store.put("pod", "ns/gone", {}, None)
    m = Mirror(file_store, ["pod"])
    mirrors.append(m)
    m.wait(lambda: m.snapshots == 1)
    pods = Path(file_store.data_dir) / "pods"
    other = FileStore(str(tmp_path / "other"), lock_timeout=2.0)
    other.put("node", "x", {}, None)  # makes its data dir
    link = tmp_path / "link"
    link.symlink_to(tmp_path / "nowhere")
    _exchange(pods, link)  # atomically: the store's pods/ is a symlink, link the directory
    link.rename(tmp_path / "other" / "pods")
    time.sleep(0.5)  # polls fail
    other.put("pod", "ns/a", {"v": 2}, r_a)
    gone = other.get("pod", "ns/gone")
    assert gone is not None
    other.delete("pod", "ns/gone", gone.revision)
    other.put("pod", "ns/new", {}, None)
    (tmp_path / "other" / "pods").rename(link)
    _exchange(pods, link)
    m.wait_matches(file_store)
    assert [(e.type, e.key) for e in m.events[1:]] == [
        ("delete", "ns/gone"),
        ("put", "ns/a"),
        ("put", "ns/new"),
    ]
    assert file_store.sync_stats == {"snapshots": 1, "rereads": 1, "resumes": 0}


def _exchange(a: Path, b: Path) -> None:
    """renameat2(RENAME_EXCHANGE): swap two paths in one step (no moment without either)."""
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    at_fdcwd, rename_exchange = -100, 2
    if libc.renameat2(at_fdcwd, bytes(a), at_fdcwd, bytes(b), rename_exchange) != 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err))


def test_file_store_sync_sees_many_quick_writes(
    file_store: FileStore, mirrors: list[Mirror]
) -> None:
    m = Mirror(file_store, ["block"])
    mirrors.append(m)
    m.wait(lambda: m.snapshots == 1)
    rev = None
    for i in range(30):  # many writes within one mtime tick and one poll
        rev = file_store.put("block", "10.0.0.0/26", {"i": i}, rev)
    m.wait_matches(file_store)
    assert m.state["block"]["10.0.0.0/26"].data == {"i": 29}


def test_file_store_ttl_marker_and_expired_file_left_until_rewritten(
    file_store: FileStore,
) -> None:
    file_store.put_leased("heartbeat", "n", {}, None, ttl=0.2)
    file_store.put("pool", "p", {}, None)
    hb = Path(file_store.data_dir) / "heartbeats"
    assert sorted(os.listdir(hb)) == [".ttl", "n.json"]
    assert not (Path(file_store.data_dir) / "pools" / ".ttl").exists()
    time.sleep(0.3)
    assert file_store.list_keys("heartbeat") == []
    assert (hb / "n.json").exists()  # reads never write
    file_store.put("heartbeat", "n", {}, None)
    assert file_store.list_keys("heartbeat") == ["n"]


# -- the factory ----------------------------------------------------------------------------


class Settings:
    def __init__(self, **kw: Any) -> None:
        self.datastore_type = "file"
        self.data_dir = "/nonexistent"
        self.lock_timeout_seconds = 3.0
        self.etcd_endpoints = ["http://127.0.0.1:2379"]
        self.etcd_prefix = "/tabby"
        self.etcd_ca_cert_file: str | None = None
        self.etcd_cert_file: str | None = None
        self.etcd_key_file: str | None = None
        self.etcd_watch_transport = "grpc"
        self.etcd_watch_endpoints: list[str] = []
        self.__dict__.update(kw)


def test_open_store_file(tmp_path: Path) -> None:
    store = open_store(Settings(data_dir=str(tmp_path / "d"), lock_timeout_seconds=4))
    assert isinstance(store, FileStore)
    assert store.data_dir == str(tmp_path / "d")
    assert store.lock_timeout == 4.0


def test_open_store_unknown_type() -> None:
    with pytest.raises(InvalidConfig, match="datastore_type"):
        open_store(Settings(datastore_type="etcdv2"))


def test_importing_ipam_store_is_cheap(subprocess_env: dict[str, str]) -> None:
    """The package loads no implementation and no network, TLS or logging module."""
    code = (
        "import sys\n"
        "before = set(sys.modules)\n"
        "import datastore\n"
        "print(' '.join(sorted(set(sys.modules) - before)))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], env=subprocess_env, capture_output=True, text=True, check=True
    ).stdout.split()
    assert "datastore.base" in out
    heavy = {
        "datastore.file",
        "datastore.memory",
        "datastore.etcd",
        "ipam.core",
        "ipam.core.errors",
        "json",
        "http.client",
        "ssl",
        "socket",
        "logging",
        "threading",
    }
    assert heavy.isdisjoint(out), sorted(heavy.intersection(out))


def test_open_store_etcd_builds_without_io(tmp_path: Path) -> None:
    store = open_store(
        Settings(
            datastore_type="etcdv3",
            etcd_endpoints=["https://10.0.0.1:2379", "10.0.0.2"],
            etcd_prefix="/cluster-a/",
            etcd_ca_cert_file="/nonexistent/ca.crt",
            etcd_cert_file="/nonexistent/c.crt",
            etcd_key_file="/nonexistent/c.key",
            lock_timeout_seconds=7,
            run_dir=str(tmp_path / "run"),
        )
    )
    assert isinstance(store, EtcdStore)
    assert store.endpoints == ["https://10.0.0.1:2379", "10.0.0.2"]
    assert [ep.tls for ep in store.client.endpoints] == [True, True]  # TLS files: https
    assert store.prefix == "/cluster-a"
    assert store.lock_timeout == 7.0
    assert store.location("block", "10.0.0.0/26") == "etcd:/cluster-a/ipam/v1/blocks/10.0.0.0/26"
    assert store.lock_path.startswith(str(tmp_path / "run" / "locks") + "/etcd-")
    assert not (tmp_path / "run").exists()  # nothing done yet
    default = open_store(Settings(datastore_type="etcdv3"))
    assert isinstance(default, EtcdStore)
    assert default.lock_path.startswith("/run/tabby/locks/etcd-")
    assert default.raw_key("pod", "ns/a") == b"/tabby/resources/v1/pods/ns/a"


@pytest.mark.parametrize(
    "kw",
    [
        {"etcd_endpoints": []},
        {"etcd_endpoints": ["ftp://x:1"]},
        {"etcd_endpoints": ["http://x:99999"]},
        {"etcd_cert_file": "/c.crt"},
    ],
    ids=["no-endpoints", "scheme", "port", "cert-without-key"],
)
def test_open_store_etcd_bad_settings(kw: dict[str, Any]) -> None:
    with pytest.raises(InvalidConfig, match="etcd"):
        open_store(Settings(datastore_type="etcdv3", **kw))


def test_etcd_lock_file_names_node_and_cluster(tmp_path: Path) -> None:
    """Same endpoints (any order) and prefix: one lock; another prefix: another one."""
    a = EtcdStore(["http://a:1", "http://b:2"], prefix="/p", lock_dir=str(tmp_path))
    b = EtcdStore(["http://b:2", "http://a:1"], prefix="/p/", lock_dir=str(tmp_path))
    c = EtcdStore(["http://a:1", "http://b:2"], prefix="/q", lock_dir=str(tmp_path))
    assert a.lock_path == b.lock_path != c.lock_path
    with a.lock(), c.lock():  # different clusters do not exclude each other
        pass
    with a.lock(), pytest.raises(RuntimeError, match="re-entrant"), a.lock():
        pass


def test_etcd_lock_file_exists_only_while_held(tmp_path: Path) -> None:
    """Lock files are named after settings (endpoints, prefix, network namespace): they
    must not pile up in the lock directory, one per cluster ever used."""
    a = EtcdStore(["http://a:1"], prefix="/p", lock_dir=str(tmp_path))
    with a.lock():
        assert os.path.exists(a.lock_path)
    assert os.listdir(tmp_path) == []


def test_etcd_lock_excludes_across_processes_while_its_file_comes_and_goes(
    tmp_path: Path, subprocess_env: dict[str, str]
) -> None:
    """Four processes, two threads each, increment one counter under the lock: a waiter
    that got the flock of a file its holder unlinked must not count as holding the lock."""
    counter = tmp_path / "counter"
    counter.write_text("0")
    rounds = 150
    code = (
        "import sys, threading\n"
        "from datastore.etcd.store import EtcdStore\n"
        f"s = EtcdStore(['http://a:1'], prefix='/p', lock_dir={str(tmp_path / 'locks')!r})\n"
        "def work():\n"
        f"    for _ in range({rounds}):\n"
        "        with s.lock():\n"
        f"            with open({str(counter)!r}) as f: n = int(f.read())\n"
        f"            with open({str(counter)!r}, 'w') as f: f.write(str(n + 1))\n"
        "ts = [threading.Thread(target=work) for _ in range(2)]\n"
        "[t.start() for t in ts]; [t.join() for t in ts]\n"
    )
    procs = [subprocess.Popen([sys.executable, "-c", code], env=subprocess_env) for _ in range(4)]
    for p in procs:
        assert p.wait(120) == 0
    assert int(counter.read_text()) == 4 * 2 * rounds
    assert os.listdir(tmp_path / "locks") == []
