"""packaging/image.py as a module, for the tests that check it.

It is a script, not a package module: a ``packaging/__init__.py`` would shadow PyPI's
``packaging``, which pip, pytest and PyInstaller import.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

NAME = "tabby_packaging_image"
PATH = Path(__file__).resolve().parents[1] / "packaging" / "image.py"


def load() -> ModuleType:
    if NAME in sys.modules:
        return sys.modules[NAME]
    spec = importlib.util.spec_from_file_location(NAME, PATH)
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[NAME] = module  # dataclasses look their module up while the class is made
    spec.loader.exec_module(module)
    return module
