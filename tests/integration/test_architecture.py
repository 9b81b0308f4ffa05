"""The dependency rule: the pure core never reaches torch.distributed, torch.cuda or the shell.

The core modules are parsed, not imported, so a violation is found even in code that never runs.
The core is the package ``functional_fsdp/core/``; inside it, dependencies point one way:
``errors``, ``_tree``, ``comm`` → ``layout`` → ``records`` → ``codec`` → ``transitions``.
"""

from __future__ import annotations

import ast
import functools
from pathlib import Path

import pytest

PACKAGE = "functional_fsdp"

# Several tests walk every file of the package: each source is parsed once per session (the
# trees are only read).
_parse = functools.lru_cache(maxsize=None)(ast.parse)
ROOT = Path(__file__).resolve().parents[2] / PACKAGE
CORE_DIR = ROOT / "core"
# Every module of the core, found on disk (a new one cannot escape the checks below; each
# must also say what it may import in ALLOWED_INTERNAL).
CORE = tuple(sorted(p.stem for p in CORE_DIR.glob("*.py") if p.stem != "__init__"))
FORBIDDEN = ("torch.distributed", "torch.cuda", f"{PACKAGE}.shell")

# Which core modules each core module may import (the dependency direction).
ALLOWED_INTERNAL = {
    "errors": set(),
    "_tree": set(),
    "comm": {"errors"},
    "layout": {"errors"},
    "records": {"errors", "_tree", "layout"},
    "compression": {"errors", "layout", "records", "comm"},
    "reduction": {"errors", "_tree", "layout", "records", "comm", "compression"},
    "codec": {"errors", "layout", "records", "comm"},
    "tensor_parallel": {"errors", "layout", "records", "comm"},
    "reproducible": {"errors", "_tree", "layout", "records", "comm", "reduction"},
    "recovery": {"errors", "records", "comm", "transitions"},
    "transitions": {"errors", "_tree", "layout", "records", "reduction", "comm", "codec"},
    # (reproducible: finish_reductions lands a reproducible tree's reduction as it lands others)
    "coalesce": {"errors", "records", "comm", "reduction", "reproducible", "transitions"},
    "lifecycle": {"errors"},
    "plan": {"coalesce"},
    "traced": {"records"},
    "overlap": set(),
}


def test_every_core_module_declares_its_dependencies() -> None:
    assert set(CORE) == set(ALLOWED_INTERNAL), (
        f"declare the core modules {sorted(set(CORE) - set(ALLOWED_INTERNAL))} in "
        f"ALLOWED_INTERNAL (what each may import); drop {sorted(set(ALLOWED_INTERNAL) - set(CORE))}"
    )


def _resolve(module: str, node: ast.ImportFrom) -> str:
    """Absolute name of the module an ``ImportFrom`` reads from (relative imports resolved)."""
    if node.level == 0:
        return node.module or ""
    package = f"{PACKAGE}.{module}".split(".")[: -node.level]
    return ".".join(package + ([node.module] if node.module else []))


def imported_names(source: str, module: str) -> set[str]:
    """Every module (and ``from x import name`` as ``x.name``) that ``source`` imports."""
    names: set[str] = set()
    for node in ast.walk(_parse(source)):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = _resolve(module, node)
            names.add(base)
            names.update(f"{base}.{alias.name}" for alias in node.names)
    return names


def attribute_chains(source: str) -> set[str]:
    """Dotted attribute chains such as ``torch.cuda.synchronize`` (uses without an import)."""
    chains: set[str] = set()
    for node in ast.walk(_parse(source)):
        if isinstance(node, ast.Attribute):
            parts = []
            cur: ast.expr = node
            while isinstance(cur, ast.Attribute):
                parts.append(cur.attr)
                cur = cur.value
            if isinstance(cur, ast.Name):
                chains.add(".".join([cur.id, *reversed(parts)]))
    return chains


def violations(source: str, module: str) -> list[str]:
    found = imported_names(source, module) | attribute_chains(source)
    return sorted(n for n in found for bad in FORBIDDEN if n == bad or n.startswith(bad + "."))


@pytest.mark.parametrize("module", CORE)
def test_core_module_does_not_reach_distributed_cuda_or_shell(module: str) -> None:
    path = CORE_DIR / f"{module}.py"
    assert path.is_file(), f"core module {path} is missing"
    bad = violations(path.read_text(), f"core.{module}")
    assert not bad, (
        f"{PACKAGE}/core/{module}.py must stay pure but uses {bad}; move that code to the shell"
    )


@pytest.mark.parametrize("module", CORE)
def test_core_dependencies_point_one_way(module: str) -> None:
    names = imported_names((CORE_DIR / f"{module}.py").read_text(), f"core.{module}")
    internal = {n.split(".")[2] for n in names if n.startswith(PACKAGE + ".core.")}
    internal = {n for n in internal if n in ALLOWED_INTERNAL}
    assert internal <= ALLOWED_INTERNAL[module], (
        f"{module} imports {sorted(internal - ALLOWED_INTERNAL[module])}, against the dependency direction"
    )


@pytest.mark.parametrize(
    ("source", "module"),
    [
        ("import torch.distributed as dist", "core.layout"),
        ("import torch.distributed", "core.layout"),
        ("from torch.distributed import ReduceOp", "core.layout"),
        ("from torch import distributed", "core.layout"),
        ("from torch import cuda", "core.records"),
        ("import torch.cuda", "core.records"),
        ("import torch\ntorch.cuda.synchronize()", "core.records"),
        ("import torch\nx = torch.distributed.get_rank()", "core.records"),
        ("from ..shell import fully_shard", "core.transitions"),
        ("from ..shell.comm import ProcessGroupComm", "core.transitions"),
        ("from .. import shell", "core.transitions"),
        ("from functional_fsdp.shell import api", "core.transitions"),
        ("def f():\n    import torch.distributed\n", "core.comm"),
    ],
)
def test_checker_catches_violations(source: str, module: str) -> None:
    assert violations(source, module), f"the checker missed: {source!r}"


@pytest.mark.parametrize(
    "source",
    [
        "import torch",
        "from .comm import Communicator",
        "import torch.nn.functional as F",
        "x = torch.distributions",
    ],
)
def test_checker_allows_pure_code(source: str) -> None:
    assert not violations(source, "core.transitions")


def test_relative_imports_resolve() -> None:
    node = _parse("from ..comm import Work").body[0]
    assert isinstance(node, ast.ImportFrom)
    assert _resolve("testing._world", node) == f"{PACKAGE}.comm"
    node = _parse("from ..core.comm import Work").body[0]
    assert isinstance(node, ast.ImportFrom)
    assert _resolve("testing._world", node) == f"{PACKAGE}.core.comm"
    node = _parse("from . import layout as L").body[0]
    assert isinstance(node, ast.ImportFrom)
    assert _resolve("core.records", node) == f"{PACKAGE}.core"
    assert "functional_fsdp.core.layout" in imported_names(
        "from . import layout as L", "core.records"
    )


_FRESH_IMPORTS = r"""
import json, sys, torch
base = set(sys.modules)
import functional_fsdp
import functional_fsdp.core, functional_fsdp.core.layout, functional_fsdp.core.records
import functional_fsdp.core.transitions, functional_fsdp.core.comm, functional_fsdp.core.codec
import functional_fsdp.core.tensor_parallel, functional_fsdp.testing
import functional_fsdp.core.coalesce, functional_fsdp.core.lifecycle
added = set(sys.modules) - base
bad = ("torch.distributed", "torch.cuda", "functional_fsdp.shell", "functional_fsdp.functional")
out = {"core": sorted(m for m in added if m.startswith(bad))}
import functional_fsdp.functional.optim, functional_fsdp.functional.transforms
import functional_fsdp.functional.schedules, functional_fsdp.functional.hyperparams
from functional_fsdp.functional import adamw, chain, clip_by_global_norm
out["optimizer_half"] = sorted(m for m in sys.modules if m.startswith("functional_fsdp.shell"))
from functional_fsdp.functional import make_train_step
out["step_half"] = "functional_fsdp.shell" in sys.modules
out["fully_shard_before"] = "functional_fsdp.shell.api.fully_shard" in sys.modules
from functional_fsdp import fully_shard  # the lazy top level still offers the shell
out["fully_shard_after"] = "functional_fsdp.shell.api.fully_shard" in sys.modules
print(json.dumps(out))
"""


@pytest.fixture(scope="module")
def fresh_imports() -> dict[str, object]:
    """What a fresh interpreter loads as it imports, in turn, the core, the functional
    optimizer half, the step half and the top level's ``fully_shard`` (one interpreter for
    the two tests below: each start imports torch, about 3 core-seconds)."""
    import json
    import subprocess
    import sys

    out = subprocess.run(
        [sys.executable, "-c", _FRESH_IMPORTS], capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_importing_the_core_loads_no_shell_in_a_fresh_process(fresh_imports: dict) -> None:
    """What a user sees: importing the core adds no shell, functional API or torch.distributed
    module beyond those ``import torch`` itself loads (checked in a fresh interpreter)."""
    assert fresh_imports["core"] == [], f"importing the core loaded {fresh_imports['core']}"
    assert not fresh_imports["fully_shard_before"] and fresh_imports["fully_shard_after"]


def test_the_functional_optimizer_half_loads_no_shell(fresh_imports: dict) -> None:
    """``functional/``'s optimizers, transforms and schedules are shell-free: importing them in
    a fresh interpreter loads no ``functional_fsdp.shell`` module (the step half does)."""
    loaded = fresh_imports["optimizer_half"]
    assert loaded == [], f"the optimizer half loaded {loaded}"
    assert fresh_imports["step_half"]


def _module_level_imports(path: Path, module: str) -> set[str]:
    """Package modules ``module`` imports at module level (not inside functions), including
    those under ``if TYPE_CHECKING:``: a cycle hidden from the interpreter is still a coupling."""
    tree = _parse(path.read_text())
    found: set[str] = set()

    def visit(body: list[ast.stmt]) -> None:
        for node in body:
            if isinstance(node, ast.Import):
                found.update(a.name for a in node.names)
            elif isinstance(node, ast.ImportFrom):
                base = _resolve(module, node)
                found.add(base)
                found.update(f"{base}.{a.name}" for a in node.names)
            elif isinstance(node, (ast.If, ast.Try, ast.With)):
                visit(node.body)

    visit(tree.body)
    return found


def test_no_import_cycles_in_the_package() -> None:
    modules = {}
    for path in ROOT.rglob("*.py"):
        rel = path.relative_to(ROOT).with_suffix("")
        parts = [p for p in rel.parts if p != "__init__"]
        name = ".".join(parts)
        modules[name] = path
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        is_pkg = path.name == "__init__.py"
        ctx = f"{name}.__init__" if is_pkg and name else (name or "__init__")
        deps = set()
        for imp in _module_level_imports(path, ctx):
            if not imp.startswith(PACKAGE):
                continue
            rest = imp[len(PACKAGE) + 1 :]
            while rest and rest not in modules:
                rest = rest.rpartition(".")[0]
            if rest in modules and rest != name:
                deps.add(rest)
        graph[name] = deps
    # A package importing its own submodules is how packages work; a submodule that imports
    # its package's __init__ (which imports it) is not a cycle Python trips on either.
    for name in graph:
        graph[name] = {d for d in graph[name] if not name.startswith(d + ".") and d != ""}
    state: dict[str, int] = {}
    stack: list[str] = []

    def dfs(n: str) -> None:
        state[n] = 1
        stack.append(n)
        for d in sorted(graph.get(n, ())):
            if state.get(d) == 1:
                cycle = stack[stack.index(d) :] + [d]
                raise AssertionError(f"import cycle: {' -> '.join(cycle)}")
            if d not in state:
                dfs(d)
        stack.pop()
        state[n] = 2

    for n in sorted(graph):
        if n not in state:
            dfs(n)


def test_functional_api_uses_only_the_shells_public_package() -> None:
    """``functional/`` is a layer on top of the shell: it imports ``functional_fsdp.shell``
    (its public exports), never a shell module's internals."""
    bad = {}
    for path in (ROOT / "functional").glob("*.py"):
        names = imported_names(path.read_text(), f"functional.{path.stem}")
        reach = sorted(n for n in names if n.startswith(f"{PACKAGE}.shell."))
        reach = [n for n in reach if n.rpartition(".")[0] != f"{PACKAGE}.shell"]
        if reach:
            bad[path.name] = reach
    assert not bad, f"functional/ reaches into shell internals: {bad}"


def test_functions_stay_small() -> None:
    """No library function over 80 lines. (Files have no line cap: they are split by concept,
    never by count; a 700-line file that holds one concept beats two halves.)"""
    project = ROOT.parent
    long_functions = {}
    for path in ROOT.rglob("*.py"):
        for node in ast.walk(_parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                n = (node.end_lineno or node.lineno) - node.lineno + 1
                if n > 80:
                    long_functions[f"{path.relative_to(project)}:{node.name}"] = n
    assert not long_functions, f"split these functions (over 80 lines): {long_functions}"


def test_functional_api_raises_only_named_errors() -> None:
    """Every exception ``functional/`` raises is an ``FSDPError`` subclass (which also
    subclasses the built-in a user would catch): no bare ``ValueError`` / ``TypeError``."""
    bare = []
    for path in (ROOT / "functional").glob("*.py"):
        for node in ast.walk(_parse(path.read_text())):
            if isinstance(node, ast.Raise) and isinstance(node.exc, ast.Call):
                func = node.exc.func
                if isinstance(func, ast.Name) and func.id in {"ValueError", "TypeError"}:
                    bare.append(f"{path.name}:{node.lineno}")
    assert not bare, f"raise a functional_fsdp.core.errors type instead: {bare}"


def test_every_test_module_that_spawns_ranks_is_marked_multiprocess() -> None:
    """``-m 'not multiprocess'`` must leave only single-process tests: a module that uses a
    real gloo world (the ``world2``/``world4`` fixtures, ``World``, ``run_local``) carries the
    marker."""
    tests = ROOT.parent / "tests"  # every folder of it
    spawns = ("world2", "world4", "from _dist import World", "run_local(")
    unmarked = [
        p.name
        for p in sorted(tests.rglob("test_*.py"))
        if p.name != Path(__file__).name  # this file names the fixtures without using them
        and any(s in (text := p.read_text()) for s in spawns)
        and "mark.multiprocess" not in text
    ]
    assert not unmarked, f"add pytestmark = pytest.mark.multiprocess to {unmarked}"


def test_the_files_collected_first_exist() -> None:
    """``conftest.HEAVY_FIRST`` orders the suite by name: a renamed or moved file would drop
    out of it silently (and finish last again)."""
    from conftest import HEAVY_FIRST

    tests = ROOT.parent / "tests"
    missing = [name for name in HEAVY_FIRST if not (tests / name).is_file()]
    assert not missing, f"tests/conftest.py HEAVY_FIRST names files that do not exist: {missing}"


# ------------------------------------------------------------------ who writes a group's state

# A parameter group and its parameters own their state: only their modules assign their
# fields (the group's three rooms: the group, its gradients, its lending; the hooks, the
# functional path, the setters, summon and deepcopy call methods).
GROUP_OWNERS = (
    "shell/engine/group.py",
    "shell/engine/gradients.py",
    "shell/engine/lending.py",
    "shell/engine/param.py",
)
GROUP_TYPES = {"ParamGroup", "ShardedParam"}
# Names that hold a group or a parameter object by convention, besides those inferred below.
GROUP_NAMES = {"g", "group", "grp", "gr", "tg", "pg", "sp"}
# Attributes that hold a group (``FSDPState.group``, ``GatherCall.group``).
GROUP_ATTRS = {"group"}
GROUP_LISTS = {"sharded_params", "_groups", "_unique_groups", "groups"}
# Known writes that are to go, listed so that nothing else slips in (none today). Strict: an
# entry no longer found fails, so it is removed with the write.
KNOWN_GROUP_WRITES: dict[str, list[str]] = {}


def _names_a_group_type(annotation: ast.expr | None) -> bool:
    if annotation is None:
        return False
    for node in ast.walk(annotation):
        text = node.value if isinstance(node, ast.Constant) else None  # "ParamGroup | None"
        if isinstance(text, str) and any(t in text for t in GROUP_TYPES):
            return True
        if isinstance(node, ast.Name) and node.id in GROUP_TYPES:
            return True
        if isinstance(node, ast.Attribute) and node.attr in GROUP_TYPES:
            return True
    return False


def _lists_groups(e: ast.expr) -> bool:
    """``x.sharded_params``, ``groups``, ``_groups(m, r)``, ``list(groups)``."""
    if isinstance(e, ast.Call) and isinstance(e.func, ast.Name):
        if e.func.id in GROUP_LISTS:
            return True
        return e.func.id in {"list", "tuple", "sorted", "reversed"} and _lists_groups(e.args[0])
    if isinstance(e, ast.Attribute):
        return e.attr in GROUP_LISTS
    return isinstance(e, ast.Name) and (e.id in GROUP_LISTS or e.id.endswith("groups"))


def _loop_names(target: ast.expr, it: ast.expr) -> list[str]:
    """The names a loop binds to groups: ``for g in groups``, ``for i, g in enumerate(...)``,
    ``for sp, t in zip(g.sharded_params, ts)`` (only ``sp``)."""
    if isinstance(it, ast.Call) and isinstance(it.func, ast.Name) and it.args:
        pairs: list[tuple[ast.expr, ast.expr]] = []
        if isinstance(target, ast.Tuple) and it.func.id == "zip":
            pairs = list(zip(target.elts, it.args))
        elif isinstance(target, ast.Tuple) and it.func.id == "enumerate" and len(target.elts) == 2:
            pairs = [(target.elts[1], it.args[0])]
        if pairs:
            return [n for t, a in pairs for n in _loop_names(t, a)]
    return _bound_names(target) if _lists_groups(it) else []


def _is_group(e: ast.expr, names: set[str]) -> bool:
    """Whether ``e`` evaluates to a group or a parameter object (by name, attribute,
    subscript of a list of them, or construction)."""
    if isinstance(e, ast.Name):
        return e.id in names
    if isinstance(e, ast.Attribute):
        return e.attr in GROUP_ATTRS
    if isinstance(e, ast.Subscript):
        return _lists_groups(e.value)
    if isinstance(e, ast.Call):
        f = e.func
        if isinstance(f, ast.Name) and f.id in GROUP_TYPES:
            return True
        return isinstance(f, ast.Attribute) and f.attr == "clone" and _is_group(f.value, names)
    return False


def _bound_names(target: ast.expr) -> list[str]:
    if isinstance(target, ast.Name):
        return [target.id]
    if isinstance(target, (ast.Tuple, ast.List)):
        return [n for t in target.elts for n in _bound_names(t)]
    if isinstance(target, ast.Starred):
        return _bound_names(target.value)
    return []


def _group_names(tree: ast.AST) -> set[str]:
    """The conventional names plus every name annotated, assigned or iterated as a group."""
    names = set(GROUP_NAMES)
    for _ in range(3):  # aliases of aliases
        for node in ast.walk(tree):
            if isinstance(node, ast.arg) and _names_a_group_type(node.annotation):
                names.add(node.arg)
            elif isinstance(node, ast.AnnAssign) and _names_a_group_type(node.annotation):
                names.update(_bound_names(node.target))
            elif isinstance(node, ast.Assign) and _is_group(node.value, names):
                for t in node.targets:
                    names.update(_bound_names(t))
            elif isinstance(node, ast.NamedExpr) and _is_group(node.value, names):
                names.add(node.target.id)
            elif isinstance(node, (ast.For, ast.comprehension)):
                names.update(_loop_names(node.target, node.iter))
    return names


def _written_targets(node: ast.AST) -> list[ast.expr]:
    if isinstance(node, ast.Assign):
        targets = list(node.targets)
    elif isinstance(node, (ast.AugAssign, ast.AnnAssign)):
        targets = [node.target]
    elif isinstance(node, ast.Delete):
        targets = list(node.targets)
    else:
        return []
    flat: list[ast.expr] = []
    while targets:
        t = targets.pop()
        if isinstance(t, (ast.Tuple, ast.List)):
            targets.extend(t.elts)
        elif isinstance(t, ast.Starred):
            targets.append(t.value)
        else:
            flat.append(t)
    return flat


def group_writes(source: str) -> list[str]:
    """Every statement of ``source`` that assigns (or deletes) a field of a group or of a
    parameter object: ``g.x = ...``, ``s.group.x += ...``, ``g.x[i] = ...``, ``del g.x``,
    ``setattr(g, ...)``, ``object.__setattr__(g, ...)``."""
    tree = _parse(source)
    names = _group_names(tree)
    found = []
    for node in ast.walk(tree):
        for t in _written_targets(node):
            owner = t.value if isinstance(t, ast.Subscript) else t
            if isinstance(owner, ast.Attribute) and _is_group(owner.value, names):
                found.append(f"line {getattr(node, 'lineno', '?')}: {ast.unparse(t)}")
        if isinstance(node, ast.Call) and node.args:
            f = node.func
            setter = (isinstance(f, ast.Name) and f.id in {"setattr", "delattr"}) or (
                isinstance(f, ast.Attribute) and f.attr in {"__setattr__", "__delattr__"}
            )
            if setter and _is_group(node.args[0], names):
                found.append(f"line {node.lineno}: {ast.unparse(node)}")
    return found


def test_only_the_group_and_its_parameters_write_their_state() -> None:
    """Nobody outside the group's modules (``engine/group.py``, ``gradients.py``,
    ``lending.py``) and ``engine/param.py`` assigns a field of a ``ParamGroup`` or a
    ``ShardedParam``: the hooks, the functional path, the ``FSDPModule`` setters (which replace the frozen ``GroupConfig`` through ``ParamGroup.configure``),
    summon and deepcopy call the group's methods."""
    bad, known = {}, {}
    for path in sorted(ROOT.rglob("*.py")):
        rel = path.relative_to(ROOT).as_posix()
        if rel in GROUP_OWNERS:
            continue
        allowed = KNOWN_GROUP_WRITES.get(rel, [])
        found = group_writes(path.read_text())
        known[rel] = sorted(f.partition(": ")[2] for f in found if f.partition(": ")[2] in allowed)
        if found := [f for f in found if f.partition(": ")[2] not in allowed]:
            bad[rel] = found
    assert not bad, f"call a ParamGroup / ShardedParam method instead of writing its fields: {bad}"
    gone = {k: v for k, v in KNOWN_GROUP_WRITES.items() if known.get(k) != v}
    assert not gone, f"these known writes are gone: remove them from KNOWN_GROUP_WRITES: {gone}"


@pytest.mark.parametrize(
    "source",
    [
        "g.training_state = TrainingState.IDLE",
        "s.group.forward_done += 1",
        "self.group.full_outputs = None",
        "state.group.reshard_after_forward: bool = False",
        "g.sharded_params[0] = t",
        "del group.pending",
        "a, g.comm = 1, c",
        "setattr(g, 'comm', c)",
        "object.__setattr__(group, 'state', s)",
        "def f(x: ParamGroup) -> None:\n    x.state = s",
        "def f(x: 'ParamGroup | None') -> None:\n    x.state = s",
        "x = st.group\nx.forward_users = 2",
        "y = st.group\nz = y\nz.slot = None",
        "for q in _groups(m, True):\n    q.divide_factor = 2.0",
        "for q in groups:\n    q.force_sum = True",
        "for q in grp.sharded_params:\n    q.full = None",
        "for i, q in enumerate(groups):\n    q.name = str(i)",
        "for t, q in zip(ts, grp.sharded_params):\n    q.full = t",
        "q = g.sharded_params[0]\nq.sharded = p",
        "new = ParamGroup(layout)\nnew.reduce_state = s",
        "new = g.clone(h)\nnew.reduce_state = s",
        "if (q := s.group) is not None:\n    q.config = c",
    ],
)
def test_group_write_checker_catches_violations(source: str) -> None:
    assert group_writes(source), f"the checker missed: {source!r}"


@pytest.mark.parametrize(
    "source",
    [
        "self.group = group",
        "st.group = group",
        "p.grad = x",
        "call.sources = ()",
        "state.depth = 0",
        "g.configure(divide_factor=2.0)",
        "x = g.state.flat\nx.foo = 1",
        "for q, full in zip(g.sharded_params, fulls):\n    full.grad = None",
    ],
)
def test_group_write_checker_allows_other_writes(source: str) -> None:
    assert not group_writes(source), source


# The control flags that live in the life cycle's record (core/lifecycle.py Phase) now.
CONTROL_FLAGS = (
    "training_state",
    "ran_forward",
    "ran_post_backward",
    "forward_done",
    "grad_uses",
    "backward_uses",
    "keep_for_double_backward",
    "lent_open",
    "_own_open",
    "_outputs_fresh",
    # the root's iteration (core/lifecycle.py RootPhase)
    "in_forward",
    "callback_queued",
    "interrupted",
    "order_recorded",
)
# Where each control record is written: the interpreter's advance and the constructor.
CONTROL_WRITERS = {
    "phase": {
        ("shell/engine/group.py", "_event"),
        ("shell/engine/group.py", "__init__"),
        # a functional call's own life cycle (the group's stays idle on that path)
        ("shell/engine/functional_path.py", "event"),
        ("shell/engine/functional_path.py", "__init__"),
    },
    "root_phase": {("shell/api/state.py", "_root_event"), ("shell/api/state.py", "__init__")},
}


def _assigned_attributes(tree: ast.AST) -> list[tuple[str, str, int]]:
    """``(function, attribute, line)`` for every ``x.attr = ...`` / ``x.attr += ...``."""
    found = []
    for fn in ast.walk(tree):
        if not isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        for node in ast.walk(fn):
            targets: list[ast.expr] = []
            if isinstance(node, ast.Assign):
                targets = list(node.targets)
            elif isinstance(node, (ast.AugAssign, ast.AnnAssign)):
                targets = [node.target]
            for t in targets:
                for sub in ast.walk(t):
                    if isinstance(sub, ast.Attribute):
                        found.append((fn.name, sub.attr, node.lineno))
    return found


def test_the_control_state_has_one_writer() -> None:
    """A group's control state is its ``phase`` record (a functional call's too), the root's
    its ``root_phase``, each written only where its machine advances (``ParamGroup._event``,
    ``GatherCall.event``, ``FSDPState._root_event``) and set up (``__init__``); the flags they
    replaced are written nowhere in the package."""
    bad = []
    for path in sorted(ROOT.rglob("*.py")):
        rel = path.relative_to(ROOT).as_posix()
        for fn, attr, line in _assigned_attributes(_parse(path.read_text())):
            if attr in CONTROL_FLAGS:
                bad.append(f"{rel}:{line} {fn} writes .{attr}")
            if attr in CONTROL_WRITERS and (rel, fn) not in CONTROL_WRITERS[attr]:
                bad.append(f"{rel}:{line} {fn} writes .{attr}")
    assert not bad, f"advance the life cycle (ParamGroup._event) instead: {bad}"


def test_control_state_checker_sees_writes() -> None:
    src = "def f(g):\n    g.ran_forward = True\n    g.phase, x = 1, 2\n    g.forward_done += 1\n"
    found = {(fn, attr) for fn, attr, _ in _assigned_attributes(_parse(src))}
    assert {("f", "ran_forward"), ("f", "phase"), ("f", "forward_done")} <= found


COMM_CLASSES = {"ScopedComm", "CustomCollectiveComm", "ProcessGroupComm", "SimulatedComm"}


def _class_tests(tree: ast.AST) -> list[tuple[str, int]]:
    """``isinstance(x, C)`` calls in ``tree`` whose class (or one of a tuple's) is a
    communicator class: ``(class, line)``."""
    found = []
    for node in ast.walk(tree):
        if not (isinstance(node, ast.Call) and getattr(node.func, "id", None) == "isinstance"):
            continue
        if len(node.args) != 2:
            continue
        kinds = node.args[1].elts if isinstance(node.args[1], ast.Tuple) else [node.args[1]]
        for k in kinds:
            name = k.id if isinstance(k, ast.Name) else getattr(k, "attr", None)
            if name in COMM_CLASSES:
                found.append((name, node.lineno))
    return found


def test_communicators_declare_capabilities_instead_of_being_tested_for_their_class() -> None:
    """Outside ``shell/comm/`` (where the communicator classes live) nothing asks a
    communicator's class: it reads ``capabilities(comm)`` (``CommCapabilities``), ``coalesces``,
    ``supports_pieces`` or ``base``, so a new communicator works by declaring them."""
    bad = []
    for path in sorted(ROOT.rglob("*.py")):
        rel = path.relative_to(ROOT).as_posix()
        if rel.startswith("shell/comm/"):
            continue
        bad += [
            f"{rel}:{line} isinstance(..., {c})"
            for c, line in _class_tests(_parse(path.read_text()))
        ]
    assert not bad, f"read capabilities(comm) instead: {bad}"


def test_class_test_checker_sees_tests() -> None:
    src = "def f(c):\n    return isinstance(c, (int, ScopedComm)) or isinstance(c, m.CustomCollectiveComm)\n"
    assert {c for c, _ in _class_tests(_parse(src))} == {"ScopedComm", "CustomCollectiveComm"}
