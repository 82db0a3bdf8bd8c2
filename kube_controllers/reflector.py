"""A reflector: one kind of Kubernetes object kept in memory by list, then watch.

List (one consistent snapshot), then watch from the list's resourceVersion, with bookmarks
(the resourceVersion moves on even when nothing of this kind changes, so a reconnect rarely
needs a new list). When the watch ends (the server's timeout, a broken connection) it is
opened again from the last resourceVersion seen; on ``410 Gone`` (the version is too old:
etcd compacted it) or a version the API refuses, everything is listed again and compared
with what was held, so an object deleted in the gap is found and reported as deleted: no
event is lost. Errors back off from 0.2 s to 5 s.

The reflector keeps each object projected (``project(obj)``: only what the mirror needs, or
None to ignore it) and calls ``on_change(key)`` for every key whose projection changed.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterable, Mapping
from typing import TypeVar

from bundle.types import JSON
from stores.kube.client import ApiError, Gone, KubeClient

log = logging.getLogger("tabby.controllers")

P = TypeVar("P")
WATCH_SECONDS = 300
BACKOFF = (0.2, 5.0)


def object_key(obj: Mapping[str, object]) -> str:
    """``<namespace>/<name>``, or ``<name>`` for a cluster-scoped object."""
    meta = obj.get("metadata")
    if not isinstance(meta, Mapping):
        return ""
    name = str(meta.get("name") or "")
    namespace = meta.get("namespace")
    return f"{namespace}/{name}" if namespace else name


class Reflector:
    """Objects of one kind (``path``: a collection such as ``/api/v1/pods``)."""

    def __init__(
        self,
        api: KubeClient,
        kind: str,
        path: str,
        project: Callable[[JSON], JSON | None],
        on_change: Callable[[str, str], None],
        *,
        on_event: Callable[[str], None] = lambda kind: None,
    ) -> None:
        self.api = api
        self.kind = kind
        self.path = path
        self.project = project
        self.on_change = on_change  # (kind, key)
        self.on_event = on_event  # (kind): every watch event and list, for metrics
        self.lock = threading.Lock()
        self.objects: dict[str, JSON] = {}
        self.resource_version = ""
        self.synced = threading.Event()
        self.lists = 0  # full lists made (the first one and every relist)
        self.last_error = ""

    # -- reading ------------------------------------------------------------------------------

    def get(self, key: str) -> JSON | None:
        with self.lock:
            return self.objects.get(key)

    def keys(self) -> list[str]:
        with self.lock:
            return list(self.objects)

    def items(self) -> list[tuple[str, JSON]]:
        with self.lock:
            return list(self.objects.items())

    # -- the loop -------------------------------------------------------------------------------

    def run(self, stop: threading.Event) -> None:
        pause = BACKOFF[0]
        fresh = True
        while not stop.is_set():
            try:
                if fresh:
                    self.relist()
                    fresh = False
                self.watch(stop)
                pause = BACKOFF[0]
            except Gone:
                log.info(
                    "%s: resourceVersion %s expired: listing again",
                    self.kind,
                    self.resource_version,
                )
                fresh = True
            except ApiError as e:
                if stop.is_set():
                    return
                if str(e) != self.last_error:
                    log.warning("%s: %s (again in %.1f s)", self.kind, e, pause)
                self.last_error = str(e)
                # A broken watch resumes from the last version; a failed list lists again.
                stop.wait(pause)
                pause = min(pause * 2, BACKOFF[1])

    def relist(self) -> None:
        items, version = self.api.list(self.path)
        fresh: dict[str, JSON] = {}
        for obj in items:
            projected = self.project(obj)
            if projected is not None:
                fresh[object_key(obj)] = projected
        with self.lock:
            old = self.objects
            self.objects = fresh
            self.resource_version = version
            self.lists += 1
        changed = [k for k in fresh if old.get(k) != fresh[k]]
        gone = [k for k in old if k not in fresh]  # deleted while no watch was open
        self.last_error = ""
        self.synced.set()
        self.on_event(self.kind)
        self._report(changed + gone)

    def watch(self, stop: threading.Event) -> None:
        for event in self.api.watch(
            self.path, self.resource_version, stop, timeout_seconds=WATCH_SECONDS
        ):
            kind = event.get("type")
            obj = event.get("object")
            if not isinstance(obj, dict):
                continue
            meta = obj.get("metadata") or {}
            version = str(meta.get("resourceVersion") or "") if isinstance(meta, dict) else ""
            if kind == "BOOKMARK":
                if version:
                    self.resource_version = version
                continue
            key = object_key(obj)
            projected = None if kind == "DELETED" else self.project(obj)
            with self.lock:
                before = self.objects.get(key)
                if projected is None:
                    self.objects.pop(key, None)
                else:
                    self.objects[key] = projected
                if version:
                    self.resource_version = version
            self.on_event(self.kind)
            if before != projected:
                self._report([key])

    def _report(self, keys: Iterable[str]) -> None:
        for key in keys:
            self.on_change(self.kind, key)
