"""The environment a tabby program was given, before the frozen bundle's loader changed it.

PyInstaller's bootloader starts every program of the onedir bundle with the bundle's library
directory (``sys._MEIPASS``, ``<bundle>/_internal``) in front of ``LD_LIBRARY_PATH``, and
keeps the value it was given in ``LD_LIBRARY_PATH_ORIG`` (absent when there was none). The
program itself needs that only at its own start (the dynamic loader reads the variable once);
its children must not inherit it: BIRD, ``nft``, ``ip`` or a delegated CNI plugin would load
the bundle's copies of libssl, libreadline or libz instead of their own (in the container
image the bundle and the Debian root are different builds; a runtime's own library path, such
as containerd's, would be hidden behind the bundle's). :func:`restore` puts the original back
into ``os.environ`` once, first thing at the entry (``bundle.entry.main``), so every child
and every environment a CNI call hands on (tabby-node's socket, delegated plugins) is the
runtime's. Standard library only: the entry runs it on every CNI call.
"""

from __future__ import annotations

import os
import sys

TYPE_CHECKING = False  # collections.abc would import collections (~2 ms on every CNI call)
if TYPE_CHECKING:
    from collections.abc import Mapping, MutableMapping

LIBRARY_PATH = "LD_LIBRARY_PATH"
SAVED = "LD_LIBRARY_PATH_ORIG"


def original(env: Mapping[str, str], bundle_dir: str | None) -> dict[str, str]:
    """``env`` as it was before the bootloader of the bundle in ``bundle_dir`` (its
    ``_MEIPASS``; None: not frozen, ``env`` is returned as it is) changed it: the saved value
    back in ``LD_LIBRARY_PATH``, or no ``LD_LIBRARY_PATH`` at all when the bootloader made it
    (then it is exactly the bundle's directory)."""
    out = dict(env)
    if bundle_dir is None:
        return out
    saved = out.pop(SAVED, None)
    if saved is not None:
        out[LIBRARY_PATH] = saved
    elif out.get(LIBRARY_PATH) == bundle_dir:
        del out[LIBRARY_PATH]
    return out


def bundle_dir() -> str | None:
    """The running bundle's library directory; None when not frozen."""
    if not getattr(sys, "frozen", False):
        return None
    found = getattr(sys, "_MEIPASS", None)
    return found if isinstance(found, str) else None


def restore(environ: MutableMapping[str, str] | None = None, where: str | None = None) -> None:
    """Put :func:`original` into ``environ`` (default ``os.environ``) in place."""
    target: MutableMapping[str, str] = os.environ if environ is None else environ
    where = bundle_dir() if where is None else where
    if where is None or (SAVED not in target and LIBRARY_PATH not in target):
        return
    wanted = original(target, where)
    for key in (LIBRARY_PATH, SAVED):
        if key in wanted:
            target[key] = wanted[key]
        elif key in target:
            del target[key]
