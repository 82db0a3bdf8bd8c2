"""Datastore documents (etcd's values, the file store's, the Kubernetes API's objects)
into tabby's typed models.

Properties:

- the stores' JSON edge (``datastore.engine.loads``) gives a JSON value or ``StoreCorrupt``;
- every kind's parser (``resources.index``: the models behind tabby-node's cache, the
  policy inputs, the routing view) gives its model or refuses the document with
  ``StoreCorrupt``, ``ValueError`` or ``TypeError``, the errors the index skips a
  document for (any other exception would stop tabby-node's watch);
- the Kubernetes datastore's projections of API objects (``stores.kube.kinds``: Pods,
  Namespaces, NetworkPolicies, tabby's custom resources) never raise, and a projected
  document is one of the above.

Input bytes (atheris): a JSON envelope ``{"kind": ..., "key": ..., "data": ...}`` (the
corpus: one valid document of every kind), or any bytes.
"""

from __future__ import annotations

import json

from datastore.base import Doc
from datastore.engine import loads
from datastore.errors import StoreCorrupt
from resources import index
from stores.kube import kinds

REFUSALS = (StoreCorrupt, ValueError, TypeError)


def check_parse(kind: str, key: str, data: dict[str, object]) -> None:
    parse = index.BY_NAME[kind].parse
    try:
        parse(key, Doc(data, 7))
    except REFUSALS:
        pass


def check_kube(obj: dict[str, object]) -> None:
    """An API object as each of the Kubernetes datastore's readings sees it."""
    for name, native in kinds.NATIVE.items():
        projected = native.project(obj)
        if projected is not None:
            meta = projected["metadata"]
            assert isinstance(meta, dict)
            key = (
                f"{meta.get('namespace')}/{meta.get('name')}"
                if native.namespaced
                else meta.get("name")
            )
            check_parse(name, str(key), kinds.stored(projected))
    kinds.revision_of(obj)
    for kind in ("pool", "block", "node", "bgppeer", "bgpconfiguration"):
        key = kinds.key_of(kind, obj)
        data = kinds.to_data(kind, obj)
        if key is not None:
            check_parse(kind, key, data)


def check_envelope(envelope: object) -> None:
    if not isinstance(envelope, dict):
        return
    kind, key, data = envelope.get("kind"), envelope.get("key"), envelope.get("data")
    if not isinstance(data, dict):
        return  # every store hands out a JSON object (or StoreCorrupt): the contract
    key = key if isinstance(key, str) else "k"
    known = isinstance(kind, str) and kind in index.BY_NAME  # any JSON value may be there
    kinds_to_try = [kind] if known else list(index.BY_NAME)
    for name in kinds_to_try:
        check_parse(str(name), key, data)
    check_kube(data)


def fuzz_one(data: bytes) -> None:
    try:
        envelope = loads("fuzz", data, empty="empty", garbage="not JSON")
    except StoreCorrupt:
        return
    check_envelope(envelope)


def envelope_bytes(kind: str, key: str, data: object) -> bytes:
    return json.dumps({"kind": kind, "key": key, "data": data}).encode("utf-8", "surrogatepass")


if __name__ == "__main__":
    from tests.fuzz import seeds
    from tests.fuzz.runner import main

    for seed in seeds("documents"):  # the models, built
        fuzz_one(seed)
    main(fuzz_one, ["datastore", "resources", "stores", "ipam"])
