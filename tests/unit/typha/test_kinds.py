"""typha serves what tabby-node watches, and may read exactly that: tabby-node's watcher and
typha's watch, each run against a store that records the kinds asked for, ask for the same
kinds; a client asking for a kind typha does not sync is refused (tests/unit/fanout/
test_stream.py); typha's ClusterRole lists and watches exactly what tabby-node's does
(tabby-node watches the API itself without typha), and tests/unit/manifests/test_rbac.py
runs typha's watch against the in-memory API server for its least privilege."""

from __future__ import annotations

import threading
from collections.abc import Iterable, Iterator

from datastore.base import SyncEvent
from tabby_node.cache import Cache
from tabby_node.watcher import Watcher
from tests.rbac import granted
from typha.main import Typha
from typha.options import parse


class Asked:
    """A store whose ``sync`` records the kinds asked for, then stops its caller."""

    def __init__(self) -> None:
        self.kinds: tuple[str, ...] = ()
        self.stopping = threading.Event()

    def sync(self, kinds: Iterable[str], stop: threading.Event) -> Iterator[SyncEvent]:
        self.kinds = tuple(kinds)
        stop.set()
        return iter(())


def test_typha_syncs_and_serves_every_kind_tabby_node_watches() -> None:
    node = Asked()
    watcher = Watcher(node, Cache("n1"), stopping=node.stopping, beats={})  # type: ignore[arg-type]
    watcher.run()
    options, _ = parse(["--plaintext", "--datastore-type", "kubernetes"], {})
    typha_store = Asked()
    typha = Typha(options, typha_store)  # type: ignore[arg-type]
    typha.watch(None)  # type: ignore[arg-type]
    assert node.kinds, "tabby-node watched nothing"
    assert typha_store.kinds == node.kinds
    assert typha.hub.kinds == frozenset(node.kinds)
    # the Calico policy kinds the engine enforces are among them (main's policy model)
    assert {"calico-networkpolicy", "globalnetworkpolicy", "tier", "networkset"} <= set(node.kinds)


def test_typha_may_list_and_watch_what_tabby_node_watches_and_nothing_else() -> None:
    def reads(account: str) -> set[tuple[str, str, str]]:
        return {
            (a.group, a.resource, a.verb)
            for a in granted(account)
            if a.verb in ("list", "watch") and not a.names
        }

    typha = reads("tabby-typha")
    assert typha == reads("tabby-node")
    assert {v for _, _, v in typha} == {"list", "watch"}
    listed = {(g, r) for g, r, v in typha if v == "list"}
    assert listed == {(g, r) for g, r, v in typha if v == "watch"}
    assert ("tabby.io", "globalnetworkpolicies", "watch") in typha
