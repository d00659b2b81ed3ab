"""The project's imports point one way: tools -> dashboards ->
telemetry/tracing -> the engine plugin. Read from every module's source (all
imports, also those inside functions), not from what happens to be loaded."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from harness import REPO

#: repository folder -> (installed package, layer); higher layers may import
#: lower ones, never the other way round
FOLDERS = {
    "vllm_patch": ("vllm_output_rate", 0),
    "telemetry": ("vllm_output_rate.telemetry", 1),
    "tracing": ("vllm_output_rate.tracing", 1),
    "dashboards": ("vllm_output_rate.dashboards", 2),
    "scripts": ("vllm_output_rate.tools", 3),
}
LAYER_NAMES = {0: "engine plugin", 1: "telemetry/tracing", 2: "dashboards", 3: "tools"}
#: import names that must not appear anywhere: the repository's folder names
#: (installed under ``vllm_output_rate``, generic on the package index) and
#: the tests
FORBIDDEN_TOP = {"vllm_patch", "telemetry", "tracing", "dashboards", "scripts", "tests", "harness"}


def project_modules() -> dict[str, Path]:
    """Installed module name -> file, for every module of the project."""
    modules = {}
    for folder, (package, _layer) in FOLDERS.items():
        for path in sorted((REPO / folder).rglob("*.py")):
            rel = path.relative_to(REPO / folder).with_suffix("")
            parts = [p for p in rel.parts if p != "__init__"]
            modules[".".join([package, *parts])] = path
    return modules


def layer_of(module: str) -> int | None:
    """The layer of an installed module name (None: not the project's)."""
    if module != "vllm_output_rate" and not module.startswith("vllm_output_rate."):
        return None
    best = 0
    for package, layer in FOLDERS.values():
        if module == package or module.startswith(package + "."):
            if package != "vllm_output_rate":
                return layer
    return best


def imports_of(path: Path, module: str) -> list[tuple[int, str]]:
    """(line, imported module) of every import statement in ``path``."""
    tree = ast.parse(path.read_text(), str(path))
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.extend((node.lineno, alias.name) for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:  # relative: resolve against the package
                base = package.split(".")
                base = base[: len(base) - node.level + 1]
                name = ".".join(base + ([node.module] if node.module else []))
            else:
                name = node.module or ""
            found.append((node.lineno, name))
            # `from pkg import submodule`
            found.extend((node.lineno, f"{name}.{alias.name}") for alias in node.names)
    return found


MODULES = project_modules()


def _edges() -> dict[str, set[str]]:
    edges: dict[str, set[str]] = {}
    for module, path in MODULES.items():
        targets = set()
        for _line, name in imports_of(path, module):
            if name in MODULES and name != module:
                targets.add(name)
        edges[module] = targets
    return edges


def test_every_folder_has_modules():
    for package, _ in FOLDERS.values():
        assert package in MODULES, package


@pytest.mark.parametrize("module", sorted(MODULES))
def test_no_upward_import(module):
    path = MODULES[module]
    own = layer_of(module)
    for line, name in imports_of(path, module):
        top = name.split(".")[0]
        assert top not in FORBIDDEN_TOP, f"{path}:{line} imports {name!r} (a folder name, not an installed one)"
        target = layer_of(name)
        if target is None:
            continue
        assert target <= own, (f"{path}:{line}: {LAYER_NAMES[own]} module {module} imports "
                               f"{name} ({LAYER_NAMES[target]}): imports point one way")


def test_no_import_circles():
    """No cycle among the project's modules (imports inside functions included)."""
    edges = _edges()
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(node: str) -> None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(edges.get(node, ())):
            if state.get(nxt) == 1:
                cycle = stack[stack.index(nxt):] + [nxt]
                pytest.fail("import circle: " + " -> ".join(cycle))
            if nxt not in state:
                visit(nxt)
        stack.pop()
        state[node] = 2

    for module in sorted(edges):
        if module not in state:
            visit(module)


def _python_files() -> list[Path]:
    skip = {".venv", ".git", ".cache", "build"}
    return [p for p in REPO.rglob("*.py") if not skip & set(p.relative_to(REPO).parts)]


@pytest.mark.parametrize("path", _python_files(), ids=lambda p: str(p.relative_to(REPO)))
def test_no_sys_path_edits(path):
    tree = ast.parse(path.read_text(), str(path))
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and node.attr == "path" and (
            isinstance(node.value, ast.Name) and node.value.id == "sys"
        ):
            pytest.fail(f"{path.relative_to(REPO)}:{node.lineno} touches sys.path")


def test_outside_tests_nothing_imports_the_tests():
    for module, path in MODULES.items():
        for line, name in imports_of(path, module):
            assert name.split(".")[0] not in ("tests", "harness", "conftest"), f"{path}:{line}"


def test_the_checker_sees_a_violation():
    """The checks above can fail: an engine module importing telemetry is an
    upward import, and a circle of two is a circle."""
    assert layer_of("vllm_output_rate.scheduler") == 0
    assert layer_of("vllm_output_rate.telemetry.engine") == 1
    assert layer_of("vllm_output_rate.tools.verify") == 3
    assert layer_of("os") is None
    tree_imports = imports_of(MODULES["vllm_output_rate.dashboards.config"],
                              "vllm_output_rate.dashboards.config")
    assert any(name.startswith("vllm_output_rate.telemetry") for _, name in tree_imports)
