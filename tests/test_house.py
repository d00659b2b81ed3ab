"""The house rules a newcomer relies on, read from the source: no module
anywhere in the checkout longer than 600 lines (the tools' subpackages and
the tests too), no class of the engine plugin, telemetry, tracing or
dashboards that sets more than 25 attributes in its ``__init__``, one
attribute of ours on vLLM's scheduler object."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from harness import REPO

FOLDERS = ("vllm_patch", "telemetry", "tracing", "dashboards")
MAX_LINES = 600
MAX_INIT_ATTRIBUTES = 25
#: module -> why it may be longer (with the benchmark figure that says so);
#: empty: no exception stands
LONG_MODULES: dict[str, str] = {}
#: test modules longer than MAX_LINES for now, each to be split by concern
#: (shared set-up in a small helper module beside them); an entry goes once
#: its module is at most MAX_LINES. Empty: every test module is within it
LONG_TEST_MODULES: tuple[str, ...] = ()
#: "module:Class" -> why its __init__ may set more attributes
WIDE_CLASSES: dict[str, str] = {}

MODULES = sorted(p for folder in FOLDERS for p in (REPO / folder).rglob("*.py"))
#: every module of the checkout, in every folder (the installed ones, the
#: tools' subpackages, the tests), but the virtual environment and caches
NOT_OURS = {".venv", ".git", ".cache", "build"}
ALL_MODULES = sorted(p for p in REPO.rglob("*.py")
                     if not NOT_OURS & set(p.relative_to(REPO).parts))
#: The modules whose classes are mixed over vLLM's ``Scheduler``: what they
#: set on ``self`` (and their class-level data) lives on vLLM's object.
SCHEDULER_MIXINS = ("vllm_patch/scheduler.py", "vllm_patch/core.py",
                    "vllm_patch/residency.py", "vllm_patch/preemption.py")
#: Attributes of ours on vLLM's scheduler object: one, the output-rate state
#: (``output_rate``, ``ledger.OutputRateState``); everything else of ours
#: (the limiter, the limits, the watcher, the observers, each step's ledger)
#: is in it.
MAX_SCHEDULER_ATTRIBUTES = 1


def init_attributes(cls: ast.ClassDef) -> set[str]:
    """Attributes ``self.X`` assigned anywhere in the class's ``__init__``."""
    found: set[str] = set()
    for item in cls.body:
        if isinstance(item, ast.FunctionDef) and item.name == "__init__":
            for node in ast.walk(item):
                targets = (node.targets if isinstance(node, ast.Assign)
                           else [node.target] if isinstance(node, (ast.AnnAssign, ast.AugAssign))
                           else [])
                for target in targets:
                    for sub in ast.walk(target):
                        if (isinstance(sub, ast.Attribute) and isinstance(sub.value, ast.Name)
                                and sub.value.id == "self"):
                            found.add(sub.attr)
    return found


def self_attributes(tree: ast.AST) -> set[str]:
    """What the classes of ``tree`` keep on their instances: ``self.X``
    assigned in any method, and data set in the class body (not methods)."""
    found: set[str] = set()
    for cls in [n for n in ast.walk(tree) if isinstance(n, ast.ClassDef)]:
        for item in cls.body:
            # (a bare annotation declares a host attribute: nothing is set;
            # ``name = Class.method`` names a method, no data)
            if isinstance(item, ast.Assign) and isinstance(item.value, ast.Attribute) and \
                    isinstance(item.value.value, ast.Name) and item.value.value.id[:1].isupper():
                continue
            if isinstance(item, ast.Assign) or (isinstance(item, ast.AnnAssign) and item.value):
                targets = item.targets if isinstance(item, ast.Assign) else [item.target]
                found.update(t.id for t in targets if isinstance(t, ast.Name))
        for node in ast.walk(cls):
            targets = (node.targets if isinstance(node, ast.Assign)
                       else [node.target] if isinstance(node, (ast.AnnAssign, ast.AugAssign))
                       else [])
            for target in targets:
                elts = target.elts if isinstance(target, ast.Tuple) else [target]
                found.update(t.attr for t in elts
                             if isinstance(t, ast.Attribute) and isinstance(t.value, ast.Name)
                             and t.value.id == "self")
    return found


def properties(tree: ast.AST) -> set[str]:
    """The properties the classes of ``tree`` define."""
    return {item.name for cls in ast.walk(tree) if isinstance(cls, ast.ClassDef)
            for item in cls.body if isinstance(item, ast.FunctionDef)
            and any(isinstance(d, ast.Name) and d.id == "property" for d in item.decorator_list)}


def rel(path: Path) -> str:
    return path.relative_to(REPO).as_posix()


@pytest.mark.parametrize("path", ALL_MODULES, ids=rel)
def test_modules_stay_short(path):
    lines = len(path.read_text().splitlines())
    if rel(path) in LONG_MODULES:
        return
    if rel(path) in LONG_TEST_MODULES:
        assert lines > MAX_LINES, f"{rel(path)} is short now: take it out of LONG_TEST_MODULES"
        return
    assert lines <= MAX_LINES, (
        f"{rel(path)} has {lines} lines (at most {MAX_LINES}): split it by concern")


@pytest.mark.parametrize("path", MODULES, ids=rel)
def test_classes_set_few_attributes(path):
    tree = ast.parse(path.read_text(), rel(path))
    wide = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.ClassDef):
            attributes = init_attributes(node)
            if len(attributes) > MAX_INIT_ATTRIBUTES and f"{rel(path)}:{node.name}" not in WIDE_CLASSES:
                wide[node.name] = len(attributes)
    assert not wide, f"{rel(path)}: __init__ sets more than {MAX_INIT_ATTRIBUTES} attributes: {wide}"


def test_vllms_scheduler_carries_one_attribute_of_ours():
    ours: set[str] = set()
    aliases: set[str] = set()
    for module in SCHEDULER_MIXINS:
        tree = ast.parse((REPO / module).read_text(), module)
        ours |= self_attributes(tree)
        aliases |= {name for name in properties(tree) if name.startswith("output_rate")}
    internal = sorted(name for name in ours if name.startswith("_orl_"))
    assert not internal, f"per-step or internal state on vLLM's scheduler: {internal}"
    assert "output_rate" in ours
    assert len(ours) <= MAX_SCHEDULER_ATTRIBUTES, (
        f"{len(ours)} attributes of ours on vLLM's scheduler (at most "
        f"{MAX_SCHEDULER_ATTRIBUTES}): keep them in the state object: {sorted(ours)}")
    assert not aliases, f"properties of ours on vLLM's scheduler (read the state's fields): {aliases}"


def test_the_checks_see_what_they_check():
    """The attribute count reads what a class sets (so the rule can fail)."""
    tree = ast.parse(
        "class A:\n"
        "    def __init__(self):\n"
        "        self.a = 1\n"
        "        self.b: int = 2\n"
        "        self.a += 1\n"
        "        if True:\n"
        "            self.c, self.d = 3, 4\n")
    assert init_attributes(tree.body[0]) == {"a", "b", "c", "d"}
    mixin = ast.parse(
        "class M:\n"
        "    flag = False\n"
        "    declared: int\n"
        "    hook = Base.method\n"
        "    data = config.value\n"
        "    @property\n"
        "    def alias(self):\n"
        "        return 1\n"
        "    def f(self):\n"
        "        self.x = 1\n"
        "        self.y, self.z.w = 2, 3\n"
        "        self.running[:] = []\n"
        "        self.n += 1\n")
    assert self_attributes(mixin) == {"flag", "data", "x", "y", "n"}
    assert properties(mixin) == {"alias"}
    assert len(MODULES) > 20
    assert all(m in {rel(p) for p in MODULES} for m in LONG_MODULES)
    assert all(m in {rel(p) for p in ALL_MODULES} for m in LONG_TEST_MODULES)
    # the line bound reads every folder of the checkout, subpackages too
    folders = {rel(p).split("/")[0] for p in ALL_MODULES}
    assert {*FOLDERS, "scripts", "tests"} <= folders, folders
    assert "scripts/twin/run.py" in {rel(p) for p in ALL_MODULES}
    assert not any(NOT_OURS & set(p.relative_to(REPO).parts) for p in ALL_MODULES)


def test_the_parser_imports_nothing_heavy():
    """``config`` (the options and the limits file) imports no vLLM, no
    Redis, no YAML until a file is read, and of the project only a limit's
    value parser and the shared state's option parser."""
    import subprocess
    import sys

    code = ("import sys, vllm_output_rate.config; "
            "print(' '.join(sorted(m for m in sys.modules if m.split('.')[0] in "
            "('vllm', 'redis', 'yaml', 'torch', 'vllm_output_rate'))))")
    loaded = set(subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                                check=True).stdout.split())
    assert loaded == {"vllm_output_rate", "vllm_output_rate.config",
                      "vllm_output_rate.limit_values", "vllm_output_rate.shared_settings"}, loaded
