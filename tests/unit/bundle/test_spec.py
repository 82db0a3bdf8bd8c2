"""What the bundle ships, read from its recipe without building it: the product's packages
(the layers of tests/unit/repository/test_layers.py) and never the repository's lab.

packaging/tabby.spec collects every module of the packages it lists (hidden imports) and
nothing else of the repository; the wheel (pyproject.toml) carries the same packages.
"""

from __future__ import annotations

import ast
import tomllib
from typing import Any

from tests import REPO_ROOT as ROOT
from tests.unit.repository.test_layers import PRODUCT

SPEC = ROOT / "packaging" / "tabby.spec"


def _spec() -> ast.Module:
    return ast.parse(SPEC.read_text(), str(SPEC))


def _assigned(tree: ast.Module, name: str) -> Any:
    """The literal last assigned to ``name`` at the top of the spec."""
    found = None
    for node in tree.body:
        if (
            isinstance(node, ast.Assign)
            and any(isinstance(t, ast.Name) and t.id == name for t in node.targets)
            and isinstance(node.value, ast.List)
        ):
            found = ast.literal_eval(node.value)
    assert found is not None, f"no literal {name} = [...] in {SPEC.name}"
    return found


def _analysis_keyword(tree: ast.Module, keyword: str) -> ast.expr:
    for node in ast.walk(tree):
        if (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Name)
            and node.func.id == "Analysis"
        ):
            for kw in node.keywords:
                if kw.arg == keyword:
                    return kw.value
    raise AssertionError(f"Analysis(...) in {SPEC.name} has no {keyword}=")


def test_the_spec_collects_the_product_packages_only() -> None:
    packages = _assigned(_spec(), "PACKAGES")
    assert "lab" not in packages
    assert sorted(packages) == sorted(PRODUCT)


def test_the_spec_excludes_the_lab() -> None:
    excludes = ast.literal_eval(_analysis_keyword(_spec(), "excludes"))
    assert "lab" in excludes


def test_the_spec_carries_no_file_of_the_lab() -> None:
    datas = _analysis_keyword(_spec(), "datas")
    strings = [n.value for n in ast.walk(datas) if isinstance(n, ast.Constant)]
    assert "lab" not in strings, ast.unparse(datas)


def test_the_wheel_carries_the_product_packages_only() -> None:
    with open(ROOT / "pyproject.toml", "rb") as f:
        include = tomllib.load(f)["tool"]["setuptools"]["packages"]["find"]["include"]
    assert sorted(include) == sorted(f"{p}*" for p in PRODUCT)


def test_the_readers_can_fail() -> None:
    """The readers find what a spec that ships the lab would say."""
    tree = ast.parse(
        'PACKAGES = ["bundle"]\nPACKAGES = ["bundle", "lab"]\n'
        'a = Analysis(["x"], datas=[(os.path.join(ROOT, "lab", "p.c"), "lab")], excludes=[])\n'
    )
    assert _assigned(tree, "PACKAGES") == ["bundle", "lab"]
    assert ast.literal_eval(_analysis_keyword(tree, "excludes")) == []
    datas = _analysis_keyword(tree, "datas")
    assert "lab" in [n.value for n in ast.walk(datas) if isinstance(n, ast.Constant)]
