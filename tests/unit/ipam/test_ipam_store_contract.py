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
from pathlib import Path

import pytest

from ipam.core.errors import LockTimeout, RevisionConflict, StoreCorrupt, StoreUnavailable
from ipam.store.base import KINDS, Store
from ipam.store.file import FileStore, escape_key, unescape_name
from ipam.store.memory import MemoryStore


def corrupt(store: Store, kind: str, key: str, content: bytes = b'{"format": 1, "rev') -> str:
    """Make one document unreadable the way a torn write or bad disk would."""
    if isinstance(store, MemoryStore):
        store.corrupt(kind, key)
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
        assert isinstance(store, FileStore)
        code = (
            "import sys, time\n"
            "from ipam.store.file import FileStore\n"
            "s = FileStore(sys.argv[1])\n"
            "with s.lock():\n"
            "    print('held', flush=True)\n"
            "    time.sleep(30)\n"
        )
        proc = subprocess.Popen(
            [sys.executable, "-c", code, store.data_dir],
            stdout=subprocess.PIPE,
            env=subprocess_env,
            text=True,
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
    ],
    ids=["empty", "truncated", "binary", "not-object", "wrong-key", "bad-revision"],
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
        "from ipam.store.file import FileStore\n"
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
    assert KINDS == ("pool", "block", "handle", "affinity")
