"""``tabbyctl apply -f`` of a hostile file: YAML or JSON, one document or many.

Property: ``tabbyctl.resources.load_documents`` gives documents or refuses the file in one
line (a ``click.ClickException``); ``ResourceClient.apply`` of the documents writes them or
refuses them with a ``ResourceError`` (the errors tabbyctl prints in one line), never
another exception (a traceback from tabbyctl); what it wrote reads back.

Input bytes (atheris): the file (UTF-8, undecodable bytes replaced).
"""

from __future__ import annotations

import click
from hypothesis import strategies as st

from datastore.memory import MemoryStore
from resources.client import ResourceClient
from resources.errors import ResourceError
from tabbyctl.resources import load_documents
from tests.fuzz import hostile
from tests.unit.resources.test_models import VALID


def check_file(text: str) -> None:
    try:
        docs = load_documents(text, "fuzz.yaml")
    except click.ClickException:
        return
    client = ResourceClient(MemoryStore())
    try:
        applied = client.apply(docs)
    except ResourceError:
        return
    for a in applied:
        meta = a.resource.metadata
        assert client.get(a.resource.kind, meta.name, namespace=getattr(meta, "namespace", None))


def fuzz_one(data: bytes) -> None:
    check_file(data.decode("utf-8", "replace"))


#: Resources an operator applies (one valid document of each kind), each to be mutated.
BASES = [VALID[kind] for kind in sorted(VALID)]


@st.composite
def files(draw: st.DrawFn) -> str:
    import json

    import yaml

    docs = [
        draw(hostile.mutated(base))
        for base in draw(st.lists(st.sampled_from(BASES), min_size=1, max_size=3))
    ]
    if draw(st.booleans()):
        return json.dumps(docs if len(docs) > 1 else docs[0])
    return yaml.safe_dump_all(docs)


if __name__ == "__main__":
    from tests.fuzz import seeds
    from tests.fuzz.runner import main

    for seed in seeds("apply_yaml"):  # the models, built
        fuzz_one(seed)
    main(fuzz_one, ["tabbyctl", "resources", "datastore"])
