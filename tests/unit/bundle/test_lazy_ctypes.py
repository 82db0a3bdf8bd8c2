"""packaging/pyimod03_ctypes.py, the bundle's stand-in for PyInstaller's bootstrap module:
PyInstaller's ctypes hooks installed at the first import of ctypes, not at every start."""

from __future__ import annotations

import importlib.util
import sys
import types
from pathlib import Path

import pytest

MODULE = Path(__file__).resolve().parents[3] / "packaging" / "pyimod03_ctypes.py"


def test_the_hooks_come_with_the_first_import_of_ctypes(monkeypatch: pytest.MonkeyPatch) -> None:
    spec = importlib.util.spec_from_file_location("tabby_lazy_ctypes", MODULE)
    assert spec is not None
    assert spec.loader is not None
    lazy = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(lazy)
    installed: list[types.ModuleType] = []
    eager = types.ModuleType("pyimod03_ctypes_eager")
    eager.install = lambda: installed.append(sys.modules["ctypes"])  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "pyimod03_ctypes_eager", eager)
    saved = sys.modules.pop("ctypes", None)
    before = list(sys.meta_path)
    try:
        lazy.install()
        assert len(sys.meta_path) == len(before) + 1
        import json  # another module: imported as usual, nothing installed

        assert json is not None
        assert not installed
        import ctypes  # the first import: the module runs, then the hooks go in

        assert installed == [ctypes]
        assert callable(ctypes.CDLL)
        assert sys.meta_path == before  # the finder stepped aside for good
        sys.modules.pop("ctypes")
        import ctypes as again  # noqa: F401  (imported as usual now)

        assert len(installed) == 1
    finally:
        sys.meta_path[:] = before
        if saved is not None:
            sys.modules["ctypes"] = saved


def test_the_spec_puts_it_in_place_of_pyinstallers() -> None:
    spec = (MODULE.parent / "tabby.spec").read_text()
    assert '"pyimod03_ctypes_eager"' in spec
    assert 'os.path.join(SPECPATH, "pyimod03_ctypes.py")' in spec
