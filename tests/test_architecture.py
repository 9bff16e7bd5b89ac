"""The architecture rules of ``lit_speed/``, checked on its source.

1. Private names of other libraries (Lightning, DeepSpeed, torch, ...) are touched only in ``lit_speed/compat/``:
   no ``obj._name`` access outside ``self``/``cls``, no import of a private module or name, no ``getattr``-family
   call with a private name, no instance patch of another object's method, no call of an ancestor's method
   past the classes in between (``Parent.method(self)``), and no override of a library class's private method.
2. The import graph (module-level and function-level imports) has no cycle, and a component package
   (``lit_speed/<component>/``) imports another only through the public names of ``lit_speed/__init__.py`` or
   one of the :data:`SHARED_MODULES` (documented in :mod:`lit_speed.interfaces`). The runner (:data:`TOP_PACKAGE`)
   composes every component; nothing else imports it. ``lit_speed/`` itself holds only ``__init__.py`` and shared
   modules.
"""
from __future__ import annotations

import ast
import importlib
import inspect
from pathlib import Path

import pytest

import lit_speed

ROOT = Path(lit_speed.__file__).resolve().parent
COMPAT = "lit_speed.compat"

#: Modules every component may import (besides ``lit_speed``'s public names); see ``lit_speed/interfaces.py``.
SHARED_MODULES = (
    "lit_speed.interfaces",   # the protocols components talk through
    "lit_speed.run_contract",  # the protocols components report to the runner through
    "lit_speed.compat",       # the one door to private Lightning/DeepSpeed/torch names (a package)
    "lit_speed.tables",       # start-up and end-of-run tables
    "lit_speed.step_logging",  # cheap per-step self.log of changing values
    "lit_speed.oom",          # out-of-memory errors in all their disguises
    "lit_speed.tensors",      # checks over whole tensors without a tensor-sized temporary (finite)
    "lit_speed.data.pipeline",  # loader building blocks every DataModule uses
    "lit_speed.tuning",       # choices timed on this machine (optimizer kernels, Muon dtype, ...), cached per machine
    "lit_speed.precision.modes",  # the precision-mode table: one ModeSpec per mode, asked instead of literals
    "lit_speed.memory.model_state",  # the one model-state memory calculator (planner and ZeroStrategy)
    "lit_speed.memory.host_memory",  # the one reading of the host memory a process can use (cgroup limit, MemTotal)
)

#: The top floor: the Hydra runner, which composes every component (it may import any); no other module imports it.
TOP_PACKAGE = "lit_speed.run"

#: Underscore names that are public API of their owner, not private access. Names of the form ``_name_``
#: ("sunder") are public too: reserved hook and key names such as Enum's ``_generate_next_value_`` and Hydra's
#: ``_target_``.
PUBLIC_UNDERSCORE_NAMES = {
    "_fields": "namedtuple's documented list of field names",
    "_exit": "os._exit: the standard library's documented exit without interpreter clean-up",
}

_GETATTR_FAMILY = ("getattr", "setattr", "hasattr", "delattr")


def _is_private(name: str) -> bool:
    """``_name`` and ``__name``, but not ``__dunder__``, ``_sunder_`` or the names in PUBLIC_UNDERSCORE_NAMES."""
    return name.startswith("_") and not name.endswith("_") and name not in PUBLIC_UNDERSCORE_NAMES


def _is_self(node: ast.AST) -> bool:
    return isinstance(node, ast.Name) and node.id in ("self", "cls")


def _root_name(node: ast.AST) -> str | None:
    while isinstance(node, ast.Attribute):
        node = node.value
    return node.id if isinstance(node, ast.Name) else None


# ---------------------------------------------------------------------------------------------- 1. private access
def private_accesses(source: str, filename: str = "<module>") -> list[str]:
    """Every private access in ``source``, as ``"file:line: what"`` lines (empty when there is none)."""
    tree = ast.parse(source, filename)
    functions = {n.name for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))}
    found = []
    for node in ast.walk(tree):
        what = _private_access(node, functions)
        if what:
            found.append(f"{filename}:{node.lineno}: {what}")
    return sorted(set(found))


def _private_access(node: ast.AST, functions: set[str]) -> str | None:
    if isinstance(node, ast.Attribute) and _is_private(node.attr) and not _is_self(node.value):
        return f"private attribute {ast.unparse(node)}"
    if isinstance(node, ast.ImportFrom):
        names = [a.name for a in node.names]
        if any(_is_private(part) for part in (node.module or "").split(".")) or any(map(_is_private, names)):
            return f"private import from {node.module} import {', '.join(names)}"
    if isinstance(node, ast.Import):
        hidden = [a.name for a in node.names if any(_is_private(part) for part in a.name.split("."))]
        if hidden:
            return f"private import {', '.join(hidden)}"
    if isinstance(node, ast.Call):
        return _private_call(node)
    if isinstance(node, ast.Assign):
        for target in node.targets:
            patched = isinstance(node.value, ast.Lambda) or (isinstance(node.value, ast.Name)
                                                             and node.value.id in functions)
            if isinstance(target, ast.Attribute) and not _is_self(target.value) and patched:
                return f"instance patch {ast.unparse(target)} = {ast.unparse(node.value)[:40]}"
    return None


def _private_call(node: ast.Call) -> str | None:
    func = node.func
    if isinstance(func, ast.Name) and func.id in _GETATTR_FAMILY and len(node.args) >= 2:
        name = node.args[1]
        if isinstance(name, ast.Constant) and isinstance(name.value, str) and _is_private(name.value):
            return f"{func.id}(..., {name.value!r})"
    if isinstance(func, ast.Attribute) and node.args and _is_self(node.args[0]):
        root = _root_name(func)
        if root and root[:1].isupper():  # Parent.method(self) / Parent.prop.fset(self, ...)
            return f"ancestor call {ast.unparse(func)}(self, ...) past the classes in between"
    return None


def private_overrides(cls: type) -> list[str]:
    """Private methods ``cls`` defines that override a method of a base class from outside lit_speed."""
    found = []
    for name, value in vars(cls).items():
        if not (_is_private(name) and inspect.isfunction(value)):
            continue
        for base in cls.__mro__[1:]:
            if not base.__module__.startswith("lit_speed") and name in vars(base):
                found.append(f"{cls.__module__}.{cls.__qualname__}.{name} overrides {base.__module__}."
                             f"{base.__qualname__}.{name}")
                break
    return found


def _modules(root: Path = ROOT, package: str = "lit_speed") -> dict[str, Path]:
    """Dotted module name -> file, for every ``.py`` under ``root``."""
    modules = {}
    for path in sorted(root.rglob("*.py")):
        parts = list(path.relative_to(root).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        modules[".".join([package, *parts])] = path
    return modules


def _outside_compat(name: str) -> bool:
    return name != COMPAT and not name.startswith(COMPAT + ".")


def test_no_private_access_outside_compat() -> None:
    found = [line for name, path in _modules().items() if _outside_compat(name)
             for line in private_accesses(path.read_text(), str(path.relative_to(ROOT.parent)))]
    assert not found, ("private names touched outside lit_speed/compat/ (move each into a documented compat helper "
                       "and pin it in tests/compat/test_compat.py):\n" + "\n".join(found))


def test_no_private_override_of_a_library_method_outside_compat() -> None:
    found = []
    for name in _modules():
        if not _outside_compat(name):
            continue
        module = importlib.import_module(name)
        for cls in vars(module).values():
            if inspect.isclass(cls) and cls.__module__ == name:
                found += private_overrides(cls)
    assert not found, "override private library methods in a lit_speed/compat/ mixin instead:\n" + "\n".join(found)


def test_the_scanner_reports_each_kind_of_private_access() -> None:
    synthetic = '''
from torch._dynamo import eval_frame
from lightning.pytorch.loops import _FitLoop
import torch.utils._pytree
from lit_speed.precision.fp32_modules import _cast

def fit(trainer, loop, node, batch):
    trainer._foo.bar = 1
    getattr(trainer, "_signal_connector")
    def run():
        pass
    loop.run = run
    loop.decide = lambda: True
    self._mine = node._target_ if hasattr(batch, "_fields") else trainer.__dict__

class S(Parent):
    def setup(self):
        DDPStrategy.setup_environment(self)
        super().setup()
'''
    found = private_accesses(synthetic, "synthetic.py")
    expected = ["private import from torch._dynamo", "private import from lightning.pytorch.loops import _FitLoop",
                "private import torch.utils._pytree", "private import from lit_speed.precision.fp32_modules",
                "private attribute trainer._foo", "getattr(..., '_signal_connector')", "instance patch loop.run = run",
                "instance patch loop.decide", "ancestor call DDPStrategy.setup_environment(self"]
    for what in expected:
        assert any(what in line for line in found), f"{what!r} not reported in {found}"
    assert len(found) == len(expected), found  # self._mine, _target_, _fields, __dict__, super() are fine
    assert "synthetic.py:8: private attribute trainer._foo" in found


def test_the_override_check_reports_a_private_library_hook() -> None:
    from lightning.pytorch.strategies import DeepSpeedStrategy

    class Overriding(DeepSpeedStrategy):
        def _auto_select_batch_size(self) -> int:
            return 1

        def _own_helper(self) -> None:
            pass

    found = private_overrides(Overriding)
    assert len(found) == 1 and "Overriding._auto_select_batch_size overrides" in found[0]


# ---------------------------------------------------------------------------------------------- 2. import graph
def imports_of(path: Path, name: str, modules: dict[str, Path], package: str = "lit_speed",
               with_packages: bool = True) -> set[str]:
    """The ``package`` modules ``name`` imports anywhere in its file (functions included), as module names.

    Importing ``pkg.mod`` also runs ``pkg/__init__.py``: ``with_packages`` adds those packages (outside the
    importer's own), as the interpreter runs them; without it only the modules named in the source are listed.
    """
    tree = ast.parse(path.read_text(), str(path))
    is_package = path.name == "__init__.py"
    found: set[str] = set()
    for node in ast.walk(tree):
        targets: list[str] = []
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = name.split(".")[:len(name.split(".")) - node.level + (1 if is_package else 0)]
                base = ".".join(parts + ([node.module] if node.module else []))
            targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base for a in node.names]
        for target in targets:
            if target == package or target.startswith(package + "."):
                found.add(target if target in modules else target.rsplit(".", 1)[0])
    own = {".".join(name.split(".")[:i]) for i in range(1, name.count(".") + 2)}
    for target in list(found) if with_packages else []:
        parts = target.split(".")
        found.update(p for p in (".".join(parts[:i]) for i in range(2, len(parts))) if p not in own)
    found.discard(name)
    return found


def import_graph(root: Path = ROOT, package: str = "lit_speed", with_packages: bool = True) -> dict[str, set[str]]:
    """Module -> the modules it imports (see :func:`imports_of`), for every module under ``root``."""
    modules = _modules(root, package)
    return {name: imports_of(path, name, modules, package, with_packages) for name, path in modules.items()}


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of ``graph`` with more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        for nxt in sorted(graph.get(node, ())):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def _component(name: str, graph: dict[str, set[str]], package: str = "lit_speed") -> str | None:
    """The component package a module belongs to (``None`` for top-level modules and shared packages)."""
    parts = name.split(".")
    if len(parts) < 2 or _is_shared(f"{package}.{parts[1]}", package):
        return None
    prefix = f"{package}.{parts[1]}."
    return parts[1] if any(other.startswith(prefix) for other in graph) else None


def _shared(package: str) -> tuple[str, ...]:
    return tuple(s.replace("lit_speed", package, 1) for s in SHARED_MODULES)


def _is_shared(name: str, package: str = "lit_speed") -> bool:
    return name == package or any(name == s or name.startswith(s + ".") for s in _shared(package))


def _in_top(name: str, package: str = "lit_speed") -> bool:
    top = TOP_PACKAGE.replace("lit_speed", package, 1)
    return name == top or name.startswith(top + ".")


def layering_violations(graph: dict[str, set[str]], package: str = "lit_speed") -> list[str]:
    """Imports of one component package by another, and of a component by a shared module (use a graph of the
    imports named in the source: importing a shared module runs its package's ``__init__``, which is allowed)."""
    found = []
    for name, targets in sorted(graph.items()):
        if _in_top(name, package):  # the runner composes the components: it may import any of them
            continue
        own = _component(name, graph, package)
        shared = _is_shared(name, package) and name != package
        for target in sorted(targets):
            if _in_top(target, package):
                found.append(f"{name} imports {target} (the runner: components report to it through run_contract)")
                continue
            if _is_shared(target, package) or (own is not None and _component(target, graph, package) == own):
                continue
            if own is not None or shared:
                found.append(f"{name} imports {target}")
    return found


def test_lit_speed_import_graph_has_no_cycle() -> None:
    assert cycles(import_graph()) == []


def test_components_import_each_other_only_through_public_names_or_shared_modules() -> None:
    violations = layering_violations(import_graph(with_packages=False))
    assert not violations, ("import the class from lit_speed (add it to lit_speed/__init__.py) or move the helper "
                            "into a shared module (SHARED_MODULES):\n" + "\n".join(violations))


def test_names_imported_from_lit_speed_itself_are_public() -> None:
    exported = set(lit_speed.__all__)
    for name, path in _modules().items():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module == "lit_speed" and not node.level:
                assert {a.name for a in node.names} <= exported, f"{name}: {ast.unparse(node)}"


def test_the_package_root_holds_only_its_face_and_shared_modules() -> None:
    loose = sorted(f"lit_speed.{p.stem}" for p in ROOT.glob("*.py") if p.name != "__init__.py")
    assert [m for m in loose if m not in SHARED_MODULES] == [], (
        "a module at lit_speed/'s root is neither the package face nor a shared module: move it into the component "
        "package it belongs to (the runner's into lit_speed/run/), or declare it shared")


def test_shared_modules_exist_and_are_documented() -> None:
    modules = _modules()
    documented = importlib.import_module("lit_speed.interfaces").__doc__
    for shared in SHARED_MODULES:
        assert shared in modules, f"{shared} is declared shared but does not exist"
        assert f"``{shared}``" in documented, f"{shared} is not listed in lit_speed/interfaces.py's docstring"


@pytest.fixture()
def synthetic_package(tmp_path: Path) -> Path:
    files = {
        "__init__.py": "",
        "tables.py": "",
        "alpha/__init__.py": "from pkg.alpha.core import A\n",
        "alpha/core.py": "from pkg.beta.core import B\nfrom pkg import tables\n",
        "beta/__init__.py": "",
        "beta/core.py": "def late():\n    from pkg.alpha import core\n",
        "run/__init__.py": "",
        "run/runner.py": "from pkg.alpha.core import A\nfrom pkg.beta import core\n",
        "run/checks.py": "from pkg.run import runner\n",
    }
    for rel, text in files.items():
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text(text)
    return tmp_path


def test_the_graph_checks_report_a_cycle_and_a_cross_component_import(synthetic_package: Path) -> None:
    graph = import_graph(synthetic_package, "pkg")
    assert "pkg.alpha" in graph["pkg.beta.core"]  # function-level import, and the package it runs
    assert cycles(graph) == [["pkg.alpha", "pkg.alpha.core", "pkg.beta.core"]]
    violations = layering_violations(import_graph(synthetic_package, "pkg", with_packages=False), "pkg")
    assert violations == ["pkg.alpha.core imports pkg.beta.core", "pkg.beta.core imports pkg.alpha.core"]


def test_the_runner_may_import_every_component_and_nothing_imports_it(synthetic_package: Path) -> None:
    (synthetic_package / "beta" / "late.py").write_text("from pkg.run.runner import train\n")
    violations = layering_violations(import_graph(synthetic_package, "pkg", with_packages=False), "pkg")
    assert not [v for v in violations if v.startswith("pkg.run")]  # the runner imports alpha and beta freely
    assert "pkg.beta.late imports pkg.run.runner (the runner: components report to it through run_contract)" \
        in violations


# --------------------------------------------------------------------------- 1b. patches of other libraries' modules
_MODULE_CALLS = ("import_module", "__import__")


def _is_module_lookup(value: ast.AST) -> bool:
    """``sys.modules[...]``, ``sys.modules.get(...)``, ``importlib.import_module(...)``, ``__import__(...)``."""
    if isinstance(value, ast.Subscript):
        return ast.unparse(value.value) == "sys.modules"
    if isinstance(value, ast.Call):
        func = ast.unparse(value.func)
        return func == "sys.modules.get" or func.split(".")[-1] in _MODULE_CALLS
    return False


def _is_module(name: str) -> bool:
    import importlib.util

    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError, AttributeError):
        return False


def _module_names(tree: ast.AST, own: str = "lit_speed") -> set[str]:
    """Names bound to another library's module anywhere in ``tree``: ``import x.y [as m]``, ``from x import y`` where
    ``x.y`` is a module, and ``m = sys.modules[...]`` / ``importlib.import_module(...)`` lookups."""
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names |= {a.asname or a.name.split(".")[0] for a in node.names if not a.name.startswith(own)}
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level and not node.module.startswith(own):
            names |= {a.asname or a.name for a in node.names if _is_module(f"{node.module}.{a.name}")}
        elif isinstance(node, ast.Assign) and _is_module_lookup(node.value):
            names |= {t.id for t in node.targets if isinstance(t, ast.Name)}
    return names


def module_patches(source: str, filename: str = "<module>") -> list[tuple[int, str, ast.AST]]:
    """Assignments into another library's module (``deepspeed.initialize = f``, ``utils.x = y`` after
    ``utils = sys.modules.get(...)``, ``setattr(module, ...)``), as ``(line, what, node)``."""
    tree = ast.parse(source, filename)
    modules = _module_names(tree)
    found = []
    for node in ast.walk(tree):
        targets = node.targets if isinstance(node, ast.Assign) else \
            [node.target] if isinstance(node, (ast.AugAssign, ast.AnnAssign)) else []
        for target in targets:
            for leaf in (target.elts if isinstance(target, ast.Tuple) else [target]):
                if isinstance(leaf, ast.Attribute) and (_root_name(leaf) in modules or _is_module_lookup(leaf.value)):
                    found.append((node.lineno, f"module global {ast.unparse(leaf)} = ...", node))
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in ("setattr", "delattr") \
                and node.args and (_root_name(node.args[0]) in modules or _is_module_lookup(node.args[0])):
            found.append((node.lineno, f"{node.func.id}({ast.unparse(node.args[0])}, ...)", node))
    return sorted(found, key=lambda f: f[0])


def _restored_in_finally(function: ast.AST, target: str) -> bool:
    """``function`` is a ``@contextmanager`` whose ``finally`` assigns ``target`` back."""
    decorated = any(ast.unparse(d).split(".")[-1] == "contextmanager" for d in getattr(function, "decorator_list", []))
    restores = {ast.unparse(leaf) for node in ast.walk(function) if isinstance(node, ast.Try)
                for stmt in node.finalbody for sub in ast.walk(stmt) if isinstance(sub, ast.Assign)
                for t in sub.targets for leaf in (t.elts if isinstance(t, ast.Tuple) else [t])}
    return decorated and target in restores


def unscoped_patches(source: str, filename: str = "<module>") -> list[str]:
    """The module patches of ``source`` not made inside a ``@contextmanager`` that restores them in ``finally``."""
    tree = ast.parse(source, filename)
    functions = [n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))]
    found = []
    for line, what, node in module_patches(source, filename):
        owner = min((f for f in functions if f.lineno <= line <= f.end_lineno), default=None,
                    key=lambda f: f.end_lineno - f.lineno)
        targets = [ast.unparse(leaf) for t in getattr(node, "targets", []) for leaf in
                   (t.elts if isinstance(t, ast.Tuple) else [t]) if isinstance(leaf, ast.Attribute)]
        if owner is None or not targets or not all(_restored_in_finally(owner, t) for t in targets):
            found.append(f"{filename}:{line}: {what}")
    return found


def test_no_module_global_patch_of_another_library_outside_compat() -> None:
    found = [f"{path.relative_to(ROOT.parent)}:{line}: {what}" for name, path in _modules().items()
             if _outside_compat(name) for line, what, _ in module_patches(path.read_text(), str(path))]
    assert not found, ("a module global of another library is rebound outside lit_speed/compat/: make it a scoped "
                       "compat helper (a @contextmanager that restores it in finally):\n" + "\n".join(found))


def test_compat_patches_are_scoped_and_restored() -> None:
    found = [line for name, path in _modules().items() if not _outside_compat(name)
             for line in unscoped_patches(path.read_text(), str(path.relative_to(ROOT.parent)))]
    assert not found, "a compat patch that is not restored after its with block:\n" + "\n".join(found)


# the rebinding lit_speed/strategies/ds_accelerator.py made for good until issue 25, and the scoped form it became
OLD_DS_ACCELERATOR = '''
import sys

def use_deepspeed_accelerator(name):
    accelerator = make(name)
    utils = sys.modules.get("deepspeed.runtime.utils")
    if utils is not None:
        utils.torch_memory_reserved = accelerator.memory_reserved
        utils.torch_max_memory_reserved = accelerator.max_memory_reserved
'''
SCOPED = '''
import importlib
from contextlib import contextmanager

@contextmanager
def follow(accelerator):
    utils = importlib.import_module("deepspeed.runtime.utils")
    original = utils.torch_memory_reserved
    utils.torch_memory_reserved = accelerator.memory_reserved
    try:
        yield
    finally:
        utils.torch_memory_reserved = original
'''


def test_the_scanner_catches_module_global_rebinding() -> None:
    found = [what for _, what, _ in module_patches(OLD_DS_ACCELERATOR)]
    assert found == ["module global utils.torch_memory_reserved = ...",
                     "module global utils.torch_max_memory_reserved = ..."]
    assert len(unscoped_patches(OLD_DS_ACCELERATOR)) == 2  # not even in compat would it pass: nothing restores it
    assert unscoped_patches(SCOPED) == [] and len(module_patches(SCOPED)) == 2  # the restore in finally counts too
    others = "import deepspeed\nimport torch.nn as nn\nfrom deepspeed import comm\ndef f(x):\n    deepspeed.x = 1\n" \
             "    nn.Linear = x\n    setattr(comm, 'y', 2)\n    x.y = 3\n"
    assert [w for _, w, _ in module_patches(others)] == ["module global deepspeed.x = ...",
                                                         "module global nn.Linear = ...", "setattr(comm, ...)"]


def test_only_strategies_drive_the_deepspeed_engine() -> None:
    found = [f"{path.relative_to(ROOT.parent)}:{node.lineno}" for name, path in _modules().items()
             if not name.startswith("lit_speed.strategies") for node in ast.walk(ast.parse(path.read_text()))
             if isinstance(node, ast.Attribute) and node.attr == "deepspeed_engine"]
    assert not found, ("only lit_speed/strategies/ touches a DeepSpeed engine; ask the strategy through "
                       "lit_speed.interfaces (AccumulationFollower) instead:\n" + "\n".join(found))


# ---------------------------------------------------------------------------------------------- 3. one home per fact
#: Files of ``lit_speed/`` that may spell a precision mode as a string constant besides the mode table (issue 25: at
#: most 3): the GPU table's grid of measured cells, which also holds ``tf32``, a setting and not a mode.
MODE_LITERAL_FILES = {"lit_speed/reporting/gpu_table.py"}
MODE_TABLE = "lit_speed/precision/modes.py"


def mode_literals(source: str, names: set[str]) -> list[int]:
    """Lines of ``source`` with a string constant that is exactly one of ``names`` (docstrings are prose: not counted)."""
    tree = ast.parse(source)
    docstrings = {id(node.body[0].value) for node in ast.walk(tree)
                  if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and node.body
                  and isinstance(node.body[0], ast.Expr) and isinstance(node.body[0].value, ast.Constant)}
    return sorted({node.lineno for node in ast.walk(tree) if isinstance(node, ast.Constant)
                   and isinstance(node.value, str) and node.value in names and id(node) not in docstrings})


def test_precision_modes_are_spelt_only_in_the_mode_table() -> None:
    from lit_speed.precision.modes import TABLE

    found = {}
    for path in _modules().values():
        rel = str(path.relative_to(ROOT.parent))
        lines = mode_literals(path.read_text(), set(TABLE))
        if lines and rel != MODE_TABLE:
            found[rel] = lines
    assert len(MODE_LITERAL_FILES) <= 3
    assert set(found) <= MODE_LITERAL_FILES, ("ask lit_speed.precision.modes (spec(mode).<fact>, BASELINE, ...) instead "
                                              f"of spelling a mode: {dict(sorted(found.items()))}")


def test_the_literal_scanner_skips_docstrings_and_finds_code() -> None:
    source = '''"""bf16-mixed in prose."""
def f(mode="32-true"):
    """32-true too."""
    return mode == "bf16-mixed" or "bf16-mixed-ish"
'''
    assert mode_literals(source, {"32-true", "bf16-mixed"}) == [2, 4]


def test_every_component_package_has_its_test_folder() -> None:
    """The README's map (``tests in tests/<component>/``) holds: a folder of tests per package, ``run/`` in
    ``tests/run/`` (issue 34)."""
    tests = ROOT.parent / "tests"
    packages = sorted(p.name for p in ROOT.iterdir() if (p / "__init__.py").is_file())
    missing = [f"lit_speed/{name}/ -> tests/{name}/" for name in packages if not list((tests / name).glob("test_*.py"))]
    assert not missing, f"packages without tests in their folder: {missing}"


#: the longest a module may grow before it is split along its seams (issue 34)
MAX_MODULE_LINES = 400


def test_no_module_is_longer_than_the_limit() -> None:
    long = {str(p.relative_to(ROOT.parent)): n for p in sorted(ROOT.rglob("*.py"))
            if (n := len(p.read_text().splitlines())) > MAX_MODULE_LINES}
    assert not long, f"modules over {MAX_MODULE_LINES} lines (split them along their seams): {long}"


# ----------------------------------------------------------------------------------- 4. one reading of the config
#: The one function that tells what a config's ``_target_`` names are (issue 51): it imports each and compares the
#: classes (``issubclass``); nothing else reads what a class is from the spelling of its target.
CONFIG_FACTS = "lit_speed/strategies/config_facts.py"
_STRING_TESTS = ("endswith", "startswith", "find", "rfind", "index", "count", "removesuffix", "removeprefix")
_PATTERN_CALLS = ("search", "match", "fullmatch", "fnmatch", "findall")


_STRING_OF = ("str", "repr", "format")  # calls whose value is the string of their argument


def _holds_target(node: ast.AST, tainted: set[str], returns: set[str]) -> bool:
    """Whether the value of ``node`` is (or is built from) a ``_target_`` string: ``x._target_``,
    ``x.get("_target_")``, ``x["_target_"]``, a function that returns one, a name bound to one, or an expression of
    those; a comparison (``"_target_" in node``: a key test) is a bool, not a target."""
    if isinstance(node, ast.Compare):
        return False
    if isinstance(node, ast.Attribute) and node.attr == "_target_":
        return True
    if isinstance(node, ast.Name):
        return node.id in tainted
    if isinstance(node, ast.Call):  # str(target), target.lower(), a function that returns a target, x.get(...)
        func = node.func
        name = func.id if isinstance(func, ast.Name) else func.attr if isinstance(func, ast.Attribute) else ""
        if name in returns:
            return True
        if name in ("get", "select") and any(isinstance(a, ast.Constant) and a.value == "_target_" for a in node.args):
            return True
        if isinstance(func, ast.Name):
            return name in _STRING_OF and any(_holds_target(a, tainted, returns) for a in node.args)
        return isinstance(func, ast.Attribute) and _holds_target(func.value, tainted, returns)
    if isinstance(node, ast.Subscript) and isinstance(node.slice, ast.Constant) and node.slice.value == "_target_":
        return True
    if isinstance(node, (ast.ListComp, ast.SetComp, ast.GeneratorExp)):
        return _holds_target(node.elt, tainted, returns)
    if isinstance(node, ast.DictComp):
        return _holds_target(node.key, tainted, returns) or _holds_target(node.value, tainted, returns)
    return any(_holds_target(child, tainted, returns) for child in ast.iter_child_nodes(node)
               if not isinstance(child, (ast.expr_context, ast.comprehension)))


def _bound_names(target: ast.AST) -> list[str]:
    return [n.id for n in ast.walk(target) if isinstance(n, ast.Name)]


def _scopes(tree: ast.AST) -> list[ast.AST]:
    """The module and each function: a name bound to a ``_target_`` is followed within its scope."""
    return [tree, *(n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)))]


def _scope_nodes(scope: ast.AST) -> list[ast.AST]:
    """The nodes of ``scope`` outside the functions it defines."""
    out, todo = [], list(ast.iter_child_nodes(scope))
    while todo:
        node = todo.pop()
        out.append(node)
        if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            todo.extend(ast.iter_child_nodes(node))
    return out


def _tainted_names(nodes: list[ast.AST], returns: set[str]) -> set[str]:
    tainted: set[str] = set()
    while True:
        before = len(tainted)
        for node in nodes:
            if isinstance(node, (ast.Assign, ast.AnnAssign, ast.NamedExpr)) and node.value is not None:
                if _holds_target(node.value, tainted, returns):
                    targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                    tainted.update(name for t in targets for name in _bound_names(t))
            elif isinstance(node, (ast.For, ast.comprehension)) and _holds_target(node.iter, tainted, returns):
                tainted.update(_bound_names(node.target))
        if len(tainted) == before:
            return tainted


def _returning_target(tree: ast.AST) -> set[str]:
    """Functions of ``tree`` that return a ``_target_`` value (to a fixed point)."""
    returns: set[str] = set()
    while True:
        before = len(returns)
        for scope in _scopes(tree)[1:]:
            if isinstance(scope, ast.Lambda):
                continue
            nodes = _scope_nodes(scope)
            tainted = _tainted_names(nodes, returns)
            if any(isinstance(r, ast.Return) and r.value is not None and _holds_target(r.value, tainted, returns)
                   for r in nodes):
                returns.add(scope.name)
        if len(returns) == before:
            return returns


def target_string_matches(source: str, filename: str = "<module>", returning: set[str] = frozenset()) -> list[str]:
    """Every place ``source`` reads what a ``_target_`` is from its spelling: a suffix, prefix or substring test
    (``.endswith(``, ``.startswith(``, ``"DDP" in target``, a regular expression) on a ``_target_`` value or a name
    bound to one, as ``"file:line: what"``. ``returning``: functions of other modules that return a target."""
    tree = ast.parse(source, filename)
    returns = _returning_target(tree) | set(returning)
    found = []
    for scope in _scopes(tree):
        nodes = _scope_nodes(scope)
        tainted = _tainted_names(nodes, returns)

        def holds(node: ast.AST) -> bool:
            return _holds_target(node, tainted, returns)

        for node in nodes:
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
                if node.func.attr in _STRING_TESTS and holds(node.func.value) or \
                        node.func.attr in _PATTERN_CALLS and any(holds(a) for a in node.args):
                    found.append(f"{filename}:{node.lineno}: {ast.unparse(node)[:80]}")
            if isinstance(node, ast.Compare) and any(isinstance(op, (ast.In, ast.NotIn)) for op in node.ops):
                left = node.left
                if isinstance(left, ast.Constant) and isinstance(left.value, str) and left.value != "_target_" \
                        and any(holds(c) for c in node.comparators):
                    found.append(f"{filename}:{node.lineno}: {ast.unparse(node)[:80]}")
    return sorted(set(found))


def _scanned_files() -> list[Path]:
    scripts = ROOT.parent / "scripts"
    return [*sorted(ROOT.rglob("*.py")), *sorted(scripts.glob("*.py"))]


def test_target_strings_are_never_matched_by_their_spelling() -> None:
    files = {str(path.relative_to(ROOT.parent)): path.read_text() for path in _scanned_files()}
    returning = {name for source in files.values() for name in _returning_target(ast.parse(source))}
    found = [line for rel, source in files.items() if rel != CONFIG_FACTS
             for line in target_string_matches(source, rel, returning)]
    assert not found, ("a _target_ is read by its spelling (renaming the class would silently change the answer): "
                       "ask lit_speed.strategies.config_facts.config_facts (it imports the class) instead:\n"
                       + "\n".join(found))


def test_the_target_scanner_finds_each_kind_of_spelling_match() -> None:
    synthetic = '''
def target_of(node):
    return str(node.get("_target_", ""))

def f(cfg, node, strategy):
    if not target_of(cfg.model).endswith("HFCausalLM"):
        return
    target = str(strategy._target_)
    if "DDP" in target or target.startswith("lightning."):
        pass
    callbacks = [target_of(v) for v in node.values()]
    chunked = any(t.endswith("ChunkedLMLoss") for t in callbacks)
    ok = "_target_" in node and node.name.endswith("x") and "a" in node.name
    if str(node.get("_target_", "")).endswith(".PEFTAdapters"):
        pass
'''
    found = target_string_matches(synthetic, "s.py")
    assert sorted(int(line.split(":")[1]) for line in found) == [6, 9, 9, 12, 14], found


# ------------------------------------------------------------------------------------- 5. the config composed once
#: Runs ``scripts/train.py`` in this interpreter with every Hydra composition (``ConfigLoaderImpl.
#: load_configuration``: ``compose()``, ``@hydra.main``, a sweep's) and every config check counted into a file.
COUNTING_DRIVER = '''
import runpy, sys
from pathlib import Path

log, script = Path(sys.argv[1]), sys.argv[2]
from hydra._internal.config_loader_impl import ConfigLoaderImpl

def counted(name, original):
    def call(*args, **kwargs):
        with log.open("a") as f:
            f.write(name + "\\n")
        return original(*args, **kwargs)
    return call

ConfigLoaderImpl.load_configuration = counted("compose", ConfigLoaderImpl.load_configuration)
from lit_speed.run import config_rules
config_rules.check_config = counted("check", config_rules.check_config)
sys.argv = [script, *sys.argv[3:]]
runpy.run_path(script, run_name="__main__")
'''


def train_script_events(args: list[str], tmp_path: Path) -> tuple[int, list[str], str]:
    """``(exit status, events, stderr)`` of ``scripts/train.py args`` run through :data:`COUNTING_DRIVER`."""
    import os
    import subprocess
    import sys

    log = tmp_path / "events.txt"
    repo = ROOT.parent
    env = {**os.environ, "HYDRA_FULL_ERROR": "0", "LIT_SPEED_ROOT": str(repo), "DS_ACCELERATOR": "cpu",
           "PYTHONPATH": os.pathsep.join([str(repo), os.environ.get("PYTHONPATH", "")])}
    result = subprocess.run([sys.executable, "-c", COUNTING_DRIVER, str(log), str(repo / "scripts" / "train.py"),
                             *args], cwd=repo, capture_output=True, text=True, timeout=600, env=env)
    events = log.read_text().split() if log.exists() else []
    return result.returncode, events, result.stderr


def test_a_train_script_run_composes_its_config_once_and_checks_it_once(tmp_path: Path) -> None:
    tiny = ["trainer.max_steps=1", "trainer.limit_val_batches=0", "validate=false", "logger=none", "callbacks=none",
            "trainer.enable_progress_bar=false", "trainer.enable_model_summary=false", f"hydra.run.dir={tmp_path}"]
    status, events, stderr = train_script_events(tiny, tmp_path)
    assert status == 0, stderr[-3000:]
    assert events.count("compose") == 1, f"the config was composed {events.count('compose')} times: {events}"
    assert events.count("check") == 1, f"the config was checked {events.count('check')} times: {events}"
    assert (tmp_path / "summary.json").is_file()


def test_a_refused_config_is_refused_before_the_run_starts(tmp_path: Path) -> None:
    status, events, stderr = train_script_events(["seed=1.5", f"hydra.run.dir={tmp_path / 'run'}"], tmp_path)
    assert status == 2 and stderr.strip().splitlines()[-1] == ("Config error: seed=1.5: expected an integer or null. "
                                                              "Fix: seed=42 (or seed=null for no seeding)"), stderr
    assert events == ["compose", "check"]
    assert not (tmp_path / "run" / ".hydra").exists()  # the job never began (Hydra writes .hydra/ first)
