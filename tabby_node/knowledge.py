"""What tabby-node knows of the datastore, for the CNI calls it serves.

The calls' datastore work reads through this ``Known`` (``datastore.cached``): the documents
tabby-node watches come from its cache (blocks, pools, pods, endpoints: as fresh as the
watch), the others an IPAM operation reads (affinity documents) from what tabby-node itself
last read or wrote (a bounded memo). Nothing here is trusted for correctness: every write is
a compare-and-swap at the revision read, and a document that proved stale is forgotten (a
watched one is corrected by the watch).
"""

from __future__ import annotations

import collections
import threading

from datastore.base import Doc
from datastore.cached import UNKNOWN, Unknown
from tabby_node.cache import Cache

#: Documents remembered besides the watch (this node's affinity document, and what an
#: operator's release read).
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
