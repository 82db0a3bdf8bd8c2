"""A served store for the group commits' tests: one store for every call, as tabby-node's
(``stores.Served`` without its view), and the settings that name it."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

T = TypeVar("T")


class Settings:
    datastore_type = "file"
    data_dir = "/nowhere"
    lock_timeout_seconds = 10.0


class Stores:
    """One store for every call, as tabby-node's served store; ``runs`` counts the runs."""

    def __init__(self, store: Any) -> None:
        self.store = store
        self.runs = 0

    def run(self, settings: object, fn: Callable[[Any], T], *, cached: bool = True) -> T:
        self.runs += 1
        return fn(self.store)
