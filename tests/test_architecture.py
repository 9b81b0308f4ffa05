"""The dependency rule: the pure core never reaches torch.distributed, torch.cuda or the shell.

The core modules are parsed, not imported, so a violation is found even in code that never runs.
Inside the core, dependencies point one way: ``errors``, ``_tree``, ``comm`` → ``layout`` →
``records`` → ``transitions``.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = "functional_fsdp"
ROOT = Path(__file__).resolve().parent.parent / PACKAGE
CORE = ("_tree", "errors", "layout", "records", "transitions", "comm")
FORBIDDEN = ("torch.distributed", "torch.cuda", f"{PACKAGE}.shell")

# Which core modules each core module may import (the dependency direction).
ALLOWED_INTERNAL = {
    "errors": set(),
    "_tree": set(),
    "comm": set(),
    "layout": {"errors"},
    "records": {"errors", "_tree", "layout"},
    "transitions": {"errors", "_tree", "layout", "records", "comm"},
}


def _resolve(module: str, node: ast.ImportFrom) -> str:
    """Absolute name of the module an ``ImportFrom`` reads from (relative imports resolved)."""
    if node.level == 0:
        return node.module or ""
    package = f"{PACKAGE}.{module}".split(".")[: -node.level]
    return ".".join(package + ([node.module] if node.module else []))


def imported_names(source: str, module: str) -> set[str]:
    """Every module (and ``from x import name`` as ``x.name``) that ``source`` imports."""
    names: set[str] = set()
    for node in ast.walk(ast.parse(source)):
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
    for node in ast.walk(ast.parse(source)):
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
    path = ROOT / f"{module}.py"
    assert path.is_file(), f"core module {path} is missing"
    bad = violations(path.read_text(), module)
    assert not bad, (
        f"{PACKAGE}/{module}.py must stay pure but uses {bad}; move that code to the shell"
    )


@pytest.mark.parametrize("module", CORE)
def test_core_dependencies_point_one_way(module: str) -> None:
    names = imported_names((ROOT / f"{module}.py").read_text(), module)
    internal = {n.split(".")[1] for n in names if n.startswith(PACKAGE + ".")}
    internal = {n for n in internal if n in ALLOWED_INTERNAL}
    assert internal <= ALLOWED_INTERNAL[module], (
        f"{module} imports {sorted(internal - ALLOWED_INTERNAL[module])}, against the dependency direction"
    )


@pytest.mark.parametrize(
    ("source", "module"),
    [
        ("import torch.distributed as dist", "layout"),
        ("import torch.distributed", "layout"),
        ("from torch.distributed import ReduceOp", "layout"),
        ("from torch import distributed", "layout"),
        ("from torch import cuda", "records"),
        ("import torch.cuda", "records"),
        ("import torch\ntorch.cuda.synchronize()", "records"),
        ("import torch\nx = torch.distributed.get_rank()", "records"),
        ("from .shell import fully_shard", "transitions"),
        ("from .shell.comm import ProcessGroupComm", "transitions"),
        ("from . import shell", "transitions"),
        ("from functional_fsdp.shell import api", "transitions"),
        ("def f():\n    import torch.distributed\n", "comm"),
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
    assert not violations(source, "transitions")


def test_relative_imports_resolve() -> None:
    node = ast.parse("from ..comm import Work").body[0]
    assert isinstance(node, ast.ImportFrom)
    assert _resolve("testing._world", node) == f"{PACKAGE}.comm"
    node = ast.parse("from . import layout as L").body[0]
    assert isinstance(node, ast.ImportFrom)
    assert _resolve("records", node) == PACKAGE
    assert "functional_fsdp.layout" in imported_names("from . import layout as L", "records")
