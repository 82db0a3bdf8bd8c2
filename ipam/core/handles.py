"""The handle document: one per attachment, a superset index of the blocks holding its
addresses (invariant I2). It is written before an allocation and shrunk after a release."""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

from ipam.core.cas import update
from ipam.core.docs import Docs
from ipam.core.model import Allocation, Handle

if TYPE_CHECKING:
    from datastore.base import Doc


def held(docs: Docs, handle: Handle) -> tuple[list[Allocation], list[str]]:
    """(allocations of the handle, listed blocks holding none of them)."""
    out: list[Allocation] = []
    empty: list[str] = []
    for cidr in handle.blocks:
        got = docs.block(cidr)
        ordinals = got[0].ordinals_of(handle.id) if got else []
        if not ordinals:
            empty.append(cidr)
        elif got is not None:
            out += [docs.allocation(got[0], o) for o in ordinals]
    out.sort(key=lambda a: (a.ip.version, int(a.ip)))
    return out, empty


def extend(docs: Docs, hid: str, *, add: Iterable[str], remove: Iterable[str]) -> list[str]:
    """List ``add`` in the handle (created if missing), unlist ``remove``. Returns the
    blocks it unlisted (the caller sweeps them: ``release.sweep``)."""
    adding = list(dict.fromkeys(add))
    drop = set(remove) - set(adding)
    dropped: list[str] = []

    def change(doc: Doc | None) -> dict[str, Any] | None:
        dropped.clear()
        if doc is None:
            if not adding:
                return None
            h = Handle.new(hid, docs.node, docs.clock())
            h.blocks = list(adding)
            return h.to_data()
        h = Handle.from_data(doc.data, docs.store.location("handle", hid))
        blocks = [b for b in h.blocks if b not in drop]
        blocks += [b for b in adding if b not in blocks]
        if blocks == h.blocks:
            return None
        dropped.extend(b for b in h.blocks if b in drop)
        h.blocks = blocks
        return h.to_data()

    update(docs.store, "handle", hid, change)
    return dropped
