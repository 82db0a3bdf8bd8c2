"""Shared helpers of the IPAM core tests: requests, set-up, and store wrappers that die,
fail or count."""

from __future__ import annotations

from contextlib import AbstractContextManager
from typing import Any

from datastore.base import Doc, Store
from ipam.core import AssignRequest, Ipam, PoolSpec, check_consistency, handle_id
from ipam.core.errors import StoreUnavailable

V4 = "10.0.0.0/24"
V6 = "fd00::/120"


def hid(n: int | str, net: str = "net") -> str:
    return handle_id(net, f"c{n}", "eth0")


def req(h: str, **kw: Any) -> AssignRequest:
    base: dict[str, Any] = {
        "attrs": {"pod_name": "p", "pod_namespace": "ns"},
        "want_v4": True,
        "want_v6": False,
        "v4_pools": [V4],
        "v6_pools": [V6],
    }
    base.update(kw)
    return AssignRequest(h, **base)


def setup(store: Store, node: str = "node-a", *, v4: int = 28, v6: int = 124, **kw: Any) -> Ipam:
    ipam = Ipam(store, node, **kw)
    ipam.ensure_pools([PoolSpec(V4, v4), PoolSpec(V6, v6)])
    return ipam


def errors(store: Store) -> list[Any]:
    return [p for p in check_consistency(store) if p.severity == "error"]


def in_use(ipam: Ipam) -> int:
    return sum(p.in_use for p in ipam.pool_usage())


def small(store: Store, node: str = "node-a", pool: str = "10.1.0.0/29", **kw: Any) -> Ipam:
    ipam = Ipam(store, node, **kw)
    ipam.ensure_pools([PoolSpec(pool, 30)])
    return ipam


def sreq(h: str, pool: str = "10.1.0.0/29", **kw: Any) -> AssignRequest:
    return req(h, v4_pools=[pool], **kw)


class Crash(BaseException):
    """The process died: nothing after this point happens."""


class DyingStore:
    """Passes through to ``inner`` until the ``die_at``-th write, then every call fails."""

    def __init__(self, inner: Store, die_at: int | None = None) -> None:
        self.inner = inner
        self.die_at = die_at
        self.writes = 0
        self.dead = False

    def _write(self) -> None:
        self.writes += 1
        if self.dead or (self.die_at is not None and self.writes >= self.die_at):
            self.dead = True
            raise Crash

    def _alive(self) -> None:
        if self.dead:
            raise Crash

    def lock(self) -> AbstractContextManager[None]:
        self._alive()
        return self.inner.lock()

    def get(self, kind: str, key: str) -> Doc | None:
        self._alive()
        return self.inner.get(kind, key)

    def list_keys(self, kind: str) -> list[str]:
        self._alive()
        return self.inner.list_keys(kind)

    def list(self, kind: str, prefix: str = "") -> list[tuple[str, Doc]]:
        self._alive()
        return self.inner.list(kind, prefix)

    def put(self, kind: str, key: str, data: dict[str, Any], expected_revision: int | None) -> int:
        self._write()
        return self.inner.put(kind, key, data, expected_revision)

    def delete(self, kind: str, key: str, expected_revision: int) -> None:
        self._write()
        self.inner.delete(kind, key, expected_revision)

    def check_usable(self) -> None:
        self._alive()

    def location(self, kind: str, key: str) -> str:
        return self.inner.location(kind, key)


class FailingStore(DyingStore):
    """Fails one chosen write with a StoreUnavailable (an I/O error, not a crash)."""

    def __init__(self, inner: Store, fail_kind: str, fail_key_part: str) -> None:
        super().__init__(inner)
        self.fail_kind = fail_kind
        self.fail_key_part = fail_key_part

    def put(self, kind: str, key: str, data: dict[str, Any], expected_revision: int | None) -> int:
        if kind == self.fail_kind and self.fail_key_part in key:
            raise StoreUnavailable(key, "disk full")
        return self.inner.put(kind, key, data, expected_revision)


class CountingStore(DyingStore):
    def __init__(self, inner: Store) -> None:
        super().__init__(inner)
        self.gets = 0
        self.lists = 0

    def get(self, kind: str, key: str) -> Doc | None:
        self.gets += 1
        return self.inner.get(kind, key)

    def list_keys(self, kind: str) -> list[str]:
        self.lists += 1
        return self.inner.list_keys(kind)

    def list(self, kind: str, prefix: str = "") -> list[tuple[str, Doc]]:
        self.lists += 1
        return self.inner.list(kind, prefix)


class NodeStore:
    """One "node"'s view of a shared store (cluster mode): the documents are shared, the
    lock is this node's own, so nodes write concurrently and only compare-and-swap keeps
    them apart. ``hooks`` run once each just before (or after) a matching store call, to
    put another node's operation at an exact point; ``yield_every`` gives up the GIL on
    store calls so threads interleave finely."""

    def __init__(self, inner: Store, lock_timeout: float = 10.0) -> None:
        import threading

        self.inner = inner
        self._lock = threading.Lock()
        self.lock_timeout = lock_timeout
        self.hooks: list[tuple[str, str, str, str | None, Any]] = []
        self.yielding = False

    def lock(self) -> AbstractContextManager[None]:
        from contextlib import contextmanager

        from ipam.core.errors import LockTimeout

        @contextmanager
        def held() -> Any:
            if not self._lock.acquire(timeout=self.lock_timeout):
                raise LockTimeout("node lock", "timeout")
            try:
                yield
            finally:
                self._lock.release()

        return held()

    def on(self, when: str, method: str, kind: str, fn: Any, key: str | None = None) -> None:
        """Run ``fn()`` once, ``when`` ("before"/"after") the next ``method`` call
        ("get", "put", "create" = put with no revision, "delete") on ``kind``."""
        self.hooks.append((when, method, kind, key, fn))

    def _fire(self, when: str, method: str, kind: str, key: str) -> None:
        if self.yielding:
            import time

            time.sleep(0)
        for hook in list(self.hooks):
            h_when, h_method, h_kind, h_key, fn = hook
            if (h_when, h_method, h_kind) == (when, method, kind) and h_key in (None, key):
                self.hooks.remove(hook)
                fn()
                return

    def get(self, kind: str, key: str) -> Doc | None:
        self._fire("before", "get", kind, key)
        doc = self.inner.get(kind, key)
        self._fire("after", "get", kind, key)
        return doc

    def list_keys(self, kind: str) -> list[str]:
        self._fire("before", "list", kind, "")
        return self.inner.list_keys(kind)

    def list(self, kind: str, prefix: str = "") -> list[tuple[str, Doc]]:
        self._fire("before", "list", kind, "")
        return self.inner.list(kind, prefix)

    def put(self, kind: str, key: str, data: dict[str, Any], expected_revision: int | None) -> int:
        method = "create" if expected_revision is None else "put"
        self._fire("before", method, kind, key)
        rev = self.inner.put(kind, key, data, expected_revision)
        self._fire("after", method, kind, key)
        return rev

    def delete(self, kind: str, key: str, expected_revision: int) -> None:
        self._fire("before", "delete", kind, key)
        self.inner.delete(kind, key, expected_revision)
        self._fire("after", "delete", kind, key)

    def check_usable(self) -> None:
        self.inner.check_usable()

    def location(self, kind: str, key: str) -> str:
        return self.inner.location(kind, key)


def affinity_listing(store: Store) -> dict[str, list[str]]:
    """Block CIDR -> the nodes whose affinity document lists it."""
    out: dict[str, list[str]] = {}
    for node in store.list_keys("affinity"):
        doc = store.get("affinity", node)
        assert doc is not None
        for cidr in doc.data["blocks"]:
            out.setdefault(cidr, []).append(node)
    return out


def assert_one_affinity_per_block(store: Store) -> None:
    """Every block is affine to one node that lists it, and no other node lists it."""
    listing = affinity_listing(store)
    for cidr in store.list_keys("block"):
        doc = store.get("block", cidr)
        assert doc is not None
        aff = doc.data["affinity"]
        owners = listing.get(cidr, [])
        if aff is None:
            assert owners == [], f"{cidr}: affine to no node, listed by {owners}"
        else:
            assert owners == [aff.removeprefix("host:")], f"{cidr}: {aff}, listed by {owners}"
    for cidr, owners in listing.items():
        assert store.get("block", cidr) is not None, f"{owners} list missing block {cidr}"


def handles(store: Store) -> list[str]:
    """The handle of every allocation in the store, sorted, once each."""
    from ipam.core import Ipam

    return sorted({o.handle_id for o in Ipam(store, "").allocations()})
