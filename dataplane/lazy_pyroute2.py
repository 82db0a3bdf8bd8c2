"""Import pyroute2's netlink core without running its package ``__init__``.

``pyroute2/__init__.py`` imports nearly every family pyroute2 has (IPDB, NDB, conntrack,
ethtool, nftables...) and ``pyroute2/iproute/__init__.py`` a mock IPRoute: ~95 of the
~180 ms it costs to import ``IPRoute`` in a fresh process, and a CNI call is always a fresh
process. :func:`prepare` registers the ``pyroute2`` package without executing its
``__init__`` so that the message classes tabby uses (``pyroute2.netlink.rtnl.*msg``) load
only what they need. Nothing is lost for other code in the same process: the first access
to a name the real ``__init__`` would have defined runs that ``__init__`` then, and
submodules (``from pyroute2 import config``) are imported as submodules as usual.
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
import types


class _LazyPackage(types.ModuleType):
    def __getattr__(self, name: str) -> object:
        if name.startswith("__"):
            raise AttributeError(name)
        full = f"{self.__name__}.{name}"
        if importlib.util.find_spec(full) is not None:
            return importlib.import_module(full)
        # A name the real package __init__ exports: run it now, once, in this module.
        spec = self.__spec__
        if spec is None or spec.loader is None or self.__dict__.get("_tabby_initialised"):
            raise AttributeError(name)
        self.__dict__["_tabby_initialised"] = True
        spec.loader.exec_module(self)
        return self.__dict__[name] if name in self.__dict__ else super().__getattribute__(name)


def prepare(package: str = "pyroute2") -> None:
    """Register ``package`` lazily, unless something imported it already."""
    if package in sys.modules:
        return
    spec = importlib.util.find_spec(package)
    if spec is None or spec.submodule_search_locations is None:
        return  # let the normal import report the problem
    module = importlib.util.module_from_spec(spec)
    module.__class__ = _LazyPackage
    sys.modules[package] = module
    parent, _, child = package.rpartition(".")
    if parent:
        setattr(sys.modules[parent], child, module)
