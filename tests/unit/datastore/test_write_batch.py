"""``datastore.base.write_batch``: in the file store, the documents written in one lock
session's batch are visible at once and their directories fsynced once at its end; every
other store writes as always. Nothing is answered from a batch before that end."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from datastore.base import write_batch
from datastore.cached import Cached
from datastore.errors import StoreUnavailable
from datastore.file import FileStore
from datastore.memory import MemoryStore


class Counting(FileStore):
    """Counts directory fsyncs (``fail``: the next one fails, as on a disk gone bad)."""

    def __init__(self, data_dir: str) -> None:
        super().__init__(data_dir, lock_timeout=5)
        self.dir_syncs = 0
        self.fail = False

    def _fsync_dir(self, dfd: int) -> None:
        if self.fail:
            raise OSError(5, "Input/output error")
        self.dir_syncs += 1
        super()._fsync_dir(dfd)


def test_a_batch_syncs_each_directory_once_at_its_end(tmp_path: Path) -> None:
    store = Counting(str(tmp_path))
    other = FileStore(str(tmp_path))  # another process's view of the same directory
    with store.lock():
        store.put("workloadendpoint", "ns/a", {"n": 0}, None)
    assert store.dir_syncs == 1  # alone: one fsync of the directory per document
    store.dir_syncs = 0
    with store.lock(), write_batch(store):
        rev = store.put(
            "workloadendpoint", "ns/a", {"n": 1}, store.get("workloadendpoint", "ns/a").revision
        )  # type: ignore[union-attr]
        for i in range(10):
            store.put("workloadendpoint", f"ns/p{i}", {"n": i}, None)
        store.delete("workloadendpoint", "ns/p3", store.get("workloadendpoint", "ns/p3").revision)  # type: ignore[union-attr]
        store.put("pod", "ns/x", {"n": 1}, None)
        # visible at once, to every reader; durable only at the end
        assert other.get("workloadendpoint", "ns/a") is not None
        assert other.get("workloadendpoint", "ns/a").revision == rev  # type: ignore[union-attr]
        assert other.get("workloadendpoint", "ns/p3") is None
        assert store.dir_syncs == 0
    assert store.dir_syncs == 2  # one per kind written: workloadendpoints/, pods/
    assert sorted(k for k, _ in other.list("workloadendpoint")) == sorted(
        ["ns/a", *(f"ns/p{i}" for i in range(10) if i != 3)]
    )
    assert not [n for n in os.listdir(tmp_path / "workloadendpoints") if n.endswith(".tmp")]


def test_a_batch_belongs_to_its_lock_session(tmp_path: Path) -> None:
    store = Counting(str(tmp_path))
    with pytest.raises(RuntimeError, match="outside lock"), store.write_batch():
        pass
    with store.lock(), write_batch(store), write_batch(store):  # nested: the outer one syncs
        store.put("pod", "ns/x", {}, None)
        assert store.dir_syncs == 0
    assert store.dir_syncs == 1
    with store.lock():  # a later session writes as always
        store.put("pod", "ns/y", {}, None)
    assert store.dir_syncs == 2


def test_a_batch_whose_sync_fails_reports_the_store_unwritable(tmp_path: Path) -> None:
    store = Counting(str(tmp_path))
    with (  # noqa: PT012
        pytest.raises(StoreUnavailable, match="workloadendpoints"),
        store.lock(),
        write_batch(store),
    ):
        store.put("workloadendpoint", "ns/a", {}, None)
        store.fail = True


def test_other_stores_and_views_write_as_always(tmp_path: Path) -> None:
    memory = MemoryStore()
    with memory.lock(), write_batch(memory):
        memory.put("pod", "ns/x", {}, None)
    assert memory.get("pod", "ns/x") is not None

    class Nothing:
        def learn(self, *args: object) -> None: ...

        def lookup(self, *args: object) -> object: ...

        def forget(self, *args: object) -> None: ...

    store = Counting(str(tmp_path))
    view = Cached(store, Nothing())  # type: ignore[arg-type]
    with view.lock(), write_batch(view):  # tabby-node's calls write through a view
        view.put("pod", "ns/x", {}, None)
        view.put("pod", "ns/y", {}, None)
        assert store.dir_syncs == 0
    assert store.dir_syncs == 1
