"""tabby's stand-in for PyInstaller's bootstrap module of this name (packaging/tabby.spec
puts it in the bundle in place of PyInstaller's, which is kept as ``pyimod03_ctypes_eager``).

PyInstaller's ``install()`` imports ctypes at the start of every process of a bundle that
holds ctypes, to make ``ctypes.CDLL`` & co. look in the bundle's directory first. tabby's
bundle holds ctypes (namespace entry, libnftables), but the process a CNI call starts
mostly forwards the call to tabby-node and never uses it: importing it cost ~2 ms of CPU per
call. Here ``install()`` only arranges for PyInstaller's hooks to be installed the first time
ctypes is imported, so a process that needs ctypes gets exactly what it got before.

Bootstrap code: it runs before the import machinery is complete and imports nothing but
``sys`` at module level.
"""

import sys


class _CtypesImport:
    """A meta path finder that steps aside for the first import of ``ctypes``: the module
    is found and loaded by the finders after it, and PyInstaller's hooks installed as soon
    as it has run."""

    def find_spec(self, name, path=None, target=None):
        if name != "ctypes":
            return None
        sys.meta_path.remove(self)  # once: from now on ctypes is imported as usual
        for finder in sys.meta_path:
            find = getattr(finder, "find_spec", None)
            spec = find(name, path, target) if find is not None else None
            if spec is not None:
                spec.loader = _HookedLoader(spec.loader)
                return spec
        return None


class _HookedLoader:
    """``loader``, with PyInstaller's ctypes hooks installed once the module has run."""

    def __init__(self, loader):
        self._loader = loader

    def create_module(self, spec):
        return self._loader.create_module(spec)

    def exec_module(self, module):
        self._loader.exec_module(module)
        import pyimod03_ctypes_eager

        pyimod03_ctypes_eager.install()  # its ``import ctypes`` is the module just run

    def __getattr__(self, name):
        return getattr(self._loader, name)


def install():
    sys.meta_path.insert(0, _CtypesImport())
