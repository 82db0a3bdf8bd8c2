"""IPAM stores: the protocol (``base``), ``memory`` for tests, ``file`` (the default).

Import the implementation you need (``from ipam.store.file import FileStore``); this package
only re-exports the contract, so importing it stays cheap.
"""

from ipam.store.base import KINDS, Doc, Store

__all__ = ["KINDS", "Doc", "Store"]
