"""The architecture's layers, enforced (README "Architecture").

Walks every import statement of the product (module level, inside functions and under
TYPE_CHECKING alike: a lazy import is still a dependency) and fails on an arrow that goes the
wrong way. Also checks, by running them, that the paths every CNI call takes first (the
tabby-node client, VERSION) import no configuration model.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("cni_plugin", "ipam")

#: Layer of a module: the longest matching prefix wins. Lower numbers are lower layers.
LAYERS: dict[str, tuple[int, str]] = {
    "cni_plugin": (1, "protocol"),  # the package itself holds only __version__
    "cni_plugin.cni": (1, "protocol"),
    "ipam": (2, "datastore library"),
    "ipam.core": (2, "datastore library"),
    "ipam.store": (2, "datastore library"),
    "ipam.resources": (2, "datastore library"),
    "cni_plugin.config": (3, "adapters and dataplane"),
    "cni_plugin.plugin": (3, "adapters and dataplane"),
    "cni_plugin.dataplane": (3, "adapters and dataplane"),
    "ipam.config": (3, "adapters and dataplane"),
    "ipam.plugin": (3, "adapters and dataplane"),
    "ipam.cni_codes": (3, "adapters and dataplane"),
    "cni_plugin.entry": (4, "programs"),
    "cni_plugin.__main__": (4, "programs"),
    "cni_plugin.node": (4, "programs"),
    "cni_plugin.ctl": (4, "programs"),
}

#: Arrows forbidden although the layers would allow them: (importer prefix, imported prefix).
FORBIDDEN = [
    # The datastore library stands alone: no CNI protocol in the allocator, stores or resources.
    ("ipam.core", "cni_plugin"),
    ("ipam.store", "cni_plugin"),
    ("ipam.resources", "cni_plugin"),
    # The dataplane knows the protocol's errors, never the plugins or their configuration.
    ("cni_plugin.dataplane", "cni_plugin.plugin"),
    ("cni_plugin.dataplane", "cni_plugin.config"),
    ("cni_plugin.dataplane", "ipam"),
    # The node agent does not reach into the CLI.
    ("cni_plugin.node", "cni_plugin.ctl"),
    # The core and stores stay cheap to import: no pydantic on the CNI hot path.
    ("ipam.core", "pydantic"),
    ("ipam.store", "pydantic"),
    ("cni_plugin.cni", "pydantic"),
    # prometheus_client (~50 ms to import) is tabby-node's alone: never on a binary's path.
    *(
        (binary_path, "prometheus_client")
        for binary_path in (
            "cni_plugin.cni",
            "cni_plugin.config",
            "cni_plugin.plugin",
            "cni_plugin.dataplane",
            "cni_plugin.entry",
            "cni_plugin.node.client",
            "ipam",
        )
    ),
]


def layer_of(module: str) -> tuple[int, str] | None:
    best = None
    for prefix, layer in LAYERS.items():
        if (module == prefix or module.startswith(prefix + ".")) and (
            best is None or len(prefix) > len(best[0])
        ):
            best = (prefix, layer)
    return best[1] if best else None


def module_name(path: Path) -> str:
    rel = path.relative_to(ROOT).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def imports_of(path: Path) -> list[tuple[int, str]]:
    """(line, imported module) for every import statement in the file."""
    tree = ast.parse(path.read_text(), str(path))
    me = module_name(path)
    package = me if path.name == "__init__.py" else me.rpartition(".")[0]
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - (node.level - 1)]
                target = ".".join([*base, node.module] if node.module else base)
            else:
                target = node.module or ""
            out.append((node.lineno, target))
            # "from pkg import mod" imports pkg.mod when mod is a module
            for a in node.names:
                candidate = f"{target}.{a.name}"
                if (ROOT / Path(*candidate.split("."))).with_suffix(".py").exists() or (
                    ROOT / Path(*candidate.split(".")) / "__init__.py"
                ).exists():
                    out.append((node.lineno, candidate))
    return out


def product_files() -> list[Path]:
    return sorted(p for pkg in PACKAGES for p in (ROOT / pkg).rglob("*.py"))


def test_every_product_module_has_a_layer() -> None:
    missing = [module_name(p) for p in product_files() if layer_of(module_name(p)) is None]
    assert not missing, f"modules outside every declared layer: {missing}"


def test_no_import_goes_up_a_layer() -> None:
    wrong = []
    for path in product_files():
        me = module_name(path)
        mine = layer_of(me)
        assert mine is not None
        for line, target in imports_of(path):
            theirs = layer_of(target)
            if theirs is not None and theirs[0] > mine[0]:
                wrong.append(
                    f"{path.relative_to(ROOT)}:{line}: {me} ({mine[1]}) imports "
                    f"{target} ({theirs[1]})"
                )
    assert not wrong, "imports that go up a layer:\n" + "\n".join(wrong)


@pytest.mark.parametrize(("importer", "imported"), FORBIDDEN)
def test_forbidden_arrows(importer: str, imported: str) -> None:
    wrong = []
    for path in product_files():
        me = module_name(path)
        if not (me == importer or me.startswith(importer + ".")):
            continue
        for line, target in imports_of(path):
            if target == imported or target.startswith(imported + "."):
                wrong.append(f"{path.relative_to(ROOT)}:{line}: imports {target}")
    assert not wrong, f"{importer} must not import {imported}:\n" + "\n".join(wrong)


def test_the_walker_sees_lazy_and_relative_imports(tmp_path: Path) -> None:
    """The test itself must be able to fail: a function-level relative import is found."""
    found = dict((t, n) for n, t in imports_of(ROOT / "cni_plugin" / "cni" / "invoke.py"))
    assert "cni_plugin.cni.errors" in found
    found = {t for _, t in imports_of(ROOT / "cni_plugin" / "plugin.py")}
    assert "cni_plugin.dataplane.model" in found  # imported inside functions only
    assert layer_of("cni_plugin.node.policy.nft") == (4, "programs")
    assert layer_of("cni_plugin.cni.skel") == (1, "protocol")


_PROBE = """
import os, sys
os.environ.update({{"CNI_COMMAND": "{command}", "TABBY_NODE_SOCKET": "/nonexistent/sock"}})
from cni_plugin.node.client import try_node
try_node("tabby", os.environ, b'{{"cniVersion":"1.1.0"}}', "0")
from cni_plugin import entry
if "{command}" == "VERSION":
    entry._version_answer(b'{{"cniVersion":"1.1.0"}}')
heavy = sorted(m for m in ("pydantic", "cni_plugin.config", "ipam.config", "pyroute2", "click",
                           "prometheus_client") if m in sys.modules)
print(",".join(heavy))
"""


@pytest.mark.parametrize("command", ["VERSION", "ADD"])
def test_fast_paths_import_no_model(command: str) -> None:
    """The tabby-node client and VERSION run before any configuration is parsed: they
    must never load pydantic or the models (start-up cost is the headline number)."""
    out = subprocess.run(
        [sys.executable, "-c", _PROBE.format(command=command)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    assert out == "", f"loaded on the fast path: {out}"
