"""The architecture's layers, enforced (docs/architecture.md "Layers").

Every top-level package is one layer or one program. The test walks every import statement
of the product (module level, inside functions and under TYPE_CHECKING alike: a lazy import
is still a dependency) and fails on an arrow that points up a layer, on an arrow between two
programs that is not one of the few declared interfaces, on a module outside every layer,
and on an import cycle between files or between packages. It also checks, by running them,
that the paths every CNI call takes first (the tabby-node client, VERSION) import no
configuration model.
"""

from __future__ import annotations

import ast
import functools
import subprocess
import sys
from pathlib import Path

import pytest

from tests import REPO_ROOT as ROOT

#: Layer of a module: the longest matching prefix wins; an arrow may only point to the same
#: layer or a lower one. docs/architecture.md's table is this table.
LAYERS: dict[str, tuple[int, str]] = {
    # bundle/__init__.py: __version__; bundle/types.py: the types every layer shares (IP
    # address/network/interface, JSON), defined nowhere else (test_shared_types.py)
    "bundle": (0, "version and shared types"),
    "cni_protocol": (1, "foundations"),
    "datastore": (1, "foundations"),
    "daemon": (1, "foundations"),
    "dataplane": (1, "foundations"),  # the kernel: it applies what it is given
    "ipam.core": (2, "IPAM core"),
    "resources": (3, "resources"),
    "cni_config": (4, "configuration and policy"),
    "stores": (4, "configuration and policy"),
    "policy": (4, "configuration and policy"),
    "fanout": (4, "configuration and policy"),
    "bird": (5, "BIRD"),
    "ipam": (6, "CNI plugins"),
    "cni_plugin": (6, "CNI plugins"),
    "tabby_node": (7, "programs"),
    "tabbyctl": (7, "programs"),
    "kube_controllers": (7, "programs"),
    "typha": (7, "programs"),
    "lab": (7, "programs"),  # not product: the test tiers' and benches' lab (see FORBIDDEN)
    "bundle.entry": (8, "the bundle's entry"),
    "bundle.__main__": (8, "the bundle's entry"),
}
PACKAGES = sorted({prefix.split(".")[0] for prefix in LAYERS})
PROGRAMS = ("tabby_node", "tabbyctl", "kube_controllers", "typha", "lab")
#: What the bundle ships (packaging/tabby.spec): every package but the lab.
PRODUCT = [p for p in PACKAGES if p != "lab"]

#: The only arrows from one program to another: (importer package, imported module, why);
#: ``pkg.*`` allows the package and everything in it, else the module named exactly.
INTERFACES = [
    ("lab", "tabbyctl.demo.*", "the lab builds on the demos' lab and its processes"),
    ("tabbyctl", "tabby_node.status", "node status and diags read tabby-node's status file"),
    ("tabbyctl", "tabby_node", "the package's constants: default run dir, socket, log file"),
]

#: Arrows forbidden although the layers would allow them: (importer prefix, imported prefix).
FORBIDDEN = [
    # The lab is not product: it may import the product, never the other way round (the
    # bundle does not carry it: tests/unit/bundle/test_spec.py).
    *((product, "lab") for product in PRODUCT),
    # The foundations stand alone: the store knows no CNI, the protocol no store, the kernel
    # neither (the plugin gives the dataplane's errors their CNI codes: cni_plugin.cni_codes).
    ("datastore", "cni_protocol"),
    ("cni_protocol", "datastore"),
    ("dataplane", "cni_protocol"),
    ("dataplane", "datastore"),
    ("dataplane", "daemon"),
    ("cni_protocol", "dataplane"),
    ("datastore", "dataplane"),
    ("ipam.core", "cni_protocol"),
    ("resources", "cni_protocol"),
    ("policy", "cni_protocol"),
    # The kernel side applies what it is given: it knows no policy (the policy state, its nft
    # text and what a trace says are policy's), no plugin and no configuration.
    ("dataplane", "policy"),
    ("dataplane", "cni_plugin"),
    ("dataplane", "cni_config"),
    ("dataplane", "ipam"),
    ("dataplane", "resources"),
    ("bird", "datastore"),
    ("bird", "resources"),
    # The policy engine and its incremental form are pure: no kernel, no store.
    ("policy.engine", "dataplane"),
    ("policy.engine", "datastore"),
    ("policy.engine", "resources"),
    ("policy.incremental", "dataplane"),
    ("policy.incremental", "datastore"),
    ("policy.incremental", "resources"),
    ("policy.calico", "dataplane"),
    ("policy.calico", "datastore"),
    ("policy.calico", "resources"),
    # The core and stores stay cheap to import: no pydantic on the CNI hot path.
    ("ipam.core", "pydantic"),
    ("datastore", "pydantic"),
    ("cni_protocol", "pydantic"),
    ("policy.engine", "pydantic"),
    ("policy.calico", "pydantic"),
    # What a standalone call reads of a configuration validated before (cni_config.known).
    ("cni_config.values", "pydantic"),
    ("cni_config.known", "pydantic"),
    ("cni_plugin.values", "pydantic"),
    ("ipam.values", "pydantic"),
    # prometheus_client (~50 ms to import) is for the daemons alone: never on a binary's path.
    *(
        (binary_path, "prometheus_client")
        for binary_path in (
            "cni_protocol",
            "cni_config",
            "cni_plugin",
            "dataplane",
            "datastore",
            "ipam",
            "resources",
            "bundle.entry",
            "tabby_node.client",
        )
    ),
    # The configured store is opened on every CNI call: no pydantic (the Kubernetes
    # store maps documents with the plain-dict forms of resources, never the models).
    ("stores", "pydantic"),
    ("stores", "resources.storage"),
    ("stores", "resources.client"),
    # The Kubernetes client is tabby-kube-controllers' (and the lab's) alone.
    *(
        (other, "kubernetes")
        for other in ("cni_protocol", "cni_plugin", "ipam", "datastore", "tabby_node", "tabbyctl")
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


def group_of(module: str) -> str:
    """The LAYERS prefix a module belongs to."""
    best = ""
    for prefix in LAYERS:
        if (module == prefix or module.startswith(prefix + ".")) and len(prefix) > len(best):
            best = prefix
    return best


def module_name(path: Path) -> str:
    rel = path.relative_to(ROOT).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _is_module(dotted: str) -> bool:
    base = ROOT / Path(*dotted.split("."))
    return base.with_suffix(".py").exists() or (base / "__init__.py").exists()


def imports_of(path: Path) -> list[tuple[int, str]]:
    """(line, imported module) for every import statement in the file."""
    return _imports_in(path, path.read_text())


@functools.cache
def _imports_in(path: Path, text: str) -> list[tuple[int, str]]:
    """imports_of for ``text``, the file's content: each file parsed once for the ~70
    tests that walk the product (by its content, so a file written anew is parsed anew)."""
    tree = ast.parse(text, str(path))
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
                if _is_module(candidate):
                    out.append((node.lineno, candidate))
    return out


def product_files() -> list[Path]:
    return sorted(
        p for pkg in PACKAGES if (ROOT / pkg).is_dir() for p in (ROOT / pkg).rglob("*.py")
    )


def product_modules() -> dict[str, set[str]]:
    """Every product module and the product modules it imports."""
    graph: dict[str, set[str]] = {}
    for path in product_files():
        targets = {t for _, t in imports_of(path) if t.split(".")[0] in PACKAGES}
        graph[module_name(path)] = {t for t in targets if _is_module(t)}
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one member (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[list[str]] = []
    counter = 0

    def visit(v: str) -> None:
        nonlocal counter
        index[v] = low[v] = counter
        counter += 1
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                out.append(sorted(component))

    sys.setrecursionlimit(max(sys.getrecursionlimit(), 10_000))
    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def _package_imports_itself(module: str, target: str) -> bool:
    """``pkg/__init__.py`` importing its own submodules (a package's facade) is not a
    cycle with those submodules' imports of the package's siblings."""
    return target.startswith(module + ".")


def test_every_product_module_has_a_layer() -> None:
    missing = [module_name(p) for p in product_files() if layer_of(module_name(p)) is None]
    assert not missing, f"modules outside every declared layer: {missing}"


def test_every_top_level_package_is_declared() -> None:
    """A new top-level package must be given a layer (and a line in docs/architecture.md)."""
    skip = {"tests", "bench", "packaging", "conf-examples", "build", "dist", "manifests"}
    found = {
        p.name
        for p in ROOT.iterdir()
        if p.is_dir() and (p / "__init__.py").exists() and p.name not in skip
    }
    assert found <= set(PACKAGES), f"undeclared top-level packages: {sorted(found - set(PACKAGES))}"


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


def test_programs_meet_only_through_their_interfaces() -> None:
    wrong = []
    for path in product_files():
        me = module_name(path)
        mine = me.split(".")[0]
        if mine not in PROGRAMS:
            continue
        for line, target in imports_of(path):
            theirs = target.split(".")[0]
            if theirs == mine or theirs not in PROGRAMS:
                continue
            if not any(
                importer == mine and _allows(allowed, target) for importer, allowed, _ in INTERFACES
            ):
                wrong.append(f"{path.relative_to(ROOT)}:{line}: {me} imports {target}")
    assert not wrong, "one program reaching into another:\n" + "\n".join(wrong)


def _allows(allowed: str, target: str) -> bool:
    if allowed.endswith(".*"):
        base = allowed[:-2]
        return target == base or target.startswith(base + ".")
    return target == allowed


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


def test_no_import_cycle_between_files() -> None:
    graph = product_modules()
    graph = {m: {t for t in ts if not _package_imports_itself(m, t)} for m, ts in graph.items()}
    found = cycles(graph)
    assert not found, "files that import each other (directly or around a loop):\n" + "\n".join(
        " <-> ".join(c) for c in found
    )


def test_no_import_cycle_between_packages() -> None:
    """Packages as the layer table groups them (``ipam.core`` apart from the plugin in
    ``ipam``; ``bundle``'s version apart from its entry)."""
    graph: dict[str, set[str]] = {}
    for module, targets in product_modules().items():
        mine = group_of(module)
        for t in targets:
            theirs = group_of(t)
            if theirs != mine:
                graph.setdefault(mine, set()).add(theirs)
    found = cycles(graph)
    assert not found, "packages that import each other:\n" + "\n".join(
        " <-> ".join(c) for c in found
    )


def test_the_walker_can_fail(tmp_path: Path) -> None:
    """The test itself must be able to fail: a function-level import is found, the cycle
    finder finds a loop, the table places modules where docs/architecture.md says."""
    found = {t for _, t in imports_of(ROOT / "cni_plugin" / "plugin.py")}
    assert "dataplane.model" in found  # imported inside functions only
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []
    assert layer_of("dataplane.nft") == (1, "foundations")
    assert layer_of("policy.state") == (4, "configuration and policy")
    assert layer_of("ipam.core.block") == (2, "IPAM core")
    assert layer_of("ipam.plugin") == (6, "CNI plugins")
    assert layer_of("bundle.entry") == (8, "the bundle's entry")
    assert layer_of("bundle") == (0, "version and shared types")


_PROBE = """
import os, sys
os.environ.update({{"CNI_COMMAND": "{command}", "TABBY_NODE_SOCKET": "/nonexistent/sock"}})
from tabby_node.client import try_node
try_node("tabby", os.environ, b'{{"cniVersion":"1.1.0"}}', "0")
from bundle import entry
if "{command}" == "VERSION":
    entry._version_answer(b'{{"cniVersion":"1.1.0"}}')
heavy = sorted(m for m in ("pydantic", "cni_plugin.config", "cni_config", "ipam.config",
                           "pyroute2", "click", "prometheus_client") if m in sys.modules)
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
