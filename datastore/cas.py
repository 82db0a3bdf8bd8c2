"""The one compare-and-swap loop: read, change, write with the revision read.

Every read-modify-write of tabby (the IPAM core, the resources, tabby-node's own documents,
the controllers' mirror) goes through ``cas``: ``read()`` looks at the store (and
may do idempotent work, such as releasing a handle's allocations before the handle itself),
``write(state)`` writes based on exactly what was read, passing the revision it read. When
the write loses (``RevisionConflict``: someone wrote the document since), ``read`` runs again
on fresh data; after ``RETRIES`` lost writes the conflict is raised (the CNI adapters map it
to "try again later"). Only a conflict raised by ``write`` is retried: ``read`` may call
``cas`` itself, and its exhausted retries are not multiplied.

``update`` is the common case: one document, ``change(doc)`` returns the new data,
``DELETE``, or None (write nothing).

Under the store lock a conflict means a writer of another node (cluster mode) or a foreign
writer; correctness never rests on the lock.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, TypeVar

from datastore.errors import RevisionConflict

if TYPE_CHECKING:
    from bundle.types import JSON
    from datastore.base import Doc, Store

S = TypeVar("S")
R = TypeVar("R")

RETRIES = 20  # bounded: a conflict means another writer, and it does not happen forever


class Delete:
    """``update``: the change function's answer "delete the document"."""

    __slots__ = ()

    def __repr__(self) -> str:
        return "DELETE"


DELETE = Delete()


def cas(read: Callable[[], S], write: Callable[[S], R], what: str, key: str) -> R:
    """``write(read())``, read again while ``write`` raises ``RevisionConflict``."""
    for _ in range(RETRIES):
        state = read()
        try:
            return write(state)
        except RevisionConflict:
            continue
    raise RevisionConflict(f"{what} changed too often", key)


def update(
    store: Store,
    kind: str,
    key: str,
    change: Callable[[Doc | None], JSON | Delete | None],
) -> int | None:
    """CAS read-modify-write of one document.

    ``change(doc)`` gets the current document (None: absent) and returns its new data,
    ``DELETE``, or None to write nothing. It may raise to abort (nothing is written). It
    runs again on the fresh document after a lost write, so it must not count on running
    once. Returns the revision the document has afterwards (None: it does not exist).
    """

    def read() -> Doc | None:
        return store.get(kind, key)

    def write(doc: Doc | None) -> int | None:
        new = change(doc)
        if new is None:
            return None if doc is None else doc.revision
        if isinstance(new, Delete):
            if doc is not None:
                store.delete(kind, key, doc.revision)
            return None
        return store.put(kind, key, new, None if doc is None else doc.revision)

    return cas(read, write, kind, key)
