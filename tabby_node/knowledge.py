"""What tabby-node knows of the datastore, for the CNI calls it serves.

The calls' datastore work runs as one optimistic commit (``datastore.optimistic``) based on
this ``Known``: the documents tabby-node watches come from its cache (blocks, pools, pods,
endpoints: as fresh as the watch), the others an IPAM operation reads (handles, affinity
documents) from what tabby-node itself last read or wrote (a bounded memo: every handle of
this node's pods and its own affinity document fit). Nothing here is trusted for
correctness: the commit proves every document it relied on, and one that proved stale is
forgotten (a watched one is corrected by the watch).
"""

from __future__ import annotations

import collections
import threading

from datastore.base import Doc
from datastore.optimistic import UNKNOWN, Unknown
from tabby_node.cache import Cache

#: Documents remembered besides the watch: a node's handles (110 pods, a few interfaces
#: each) and its affinity document fit many times over.
MEMO_LIMIT = 4096


class Knowledge:
    def __init__(self, cache: Cache, limit: int = MEMO_LIMIT) -> None:
        self.cache = cache
        self.limit = limit
        self._memo: collections.OrderedDict[tuple[str, str], Doc | None] = collections.OrderedDict()
        self._lock = threading.Lock()

    def lookup(self, kind: str, key: str) -> Doc | Unknown | None:
        found = self.cache.lookup(kind, key)
        if not isinstance(found, Unknown) or self.cache.watches(kind):
            return found
        with self._lock:
            if (kind, key) not in self._memo:
                return UNKNOWN
            self._memo.move_to_end((kind, key))
            return self._memo[(kind, key)]

    def learn(self, kind: str, key: str, doc: Doc | None) -> None:
        if self.cache.watches(kind):
            self.cache.put_local(kind, key, doc)
            return
        with self._lock:
            self._memo[(kind, key)] = doc
            self._memo.move_to_end((kind, key))
            while len(self._memo) > self.limit:
                self._memo.popitem(last=False)

    def forget(self, kind: str, key: str) -> None:
        with self._lock:
            self._memo.pop((kind, key), None)
