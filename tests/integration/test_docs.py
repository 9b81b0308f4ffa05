"""Every ```python snippet in docs/*.md runs (single process) or is marked as skipped.

The convention (also in ``docs/testing.md``): the blocks of one file run in order in one shared
namespace, like a notebook, in a temporary working directory. A block whose first line starts
with ``# doctest: +SKIP`` (followed by the reason, e.g. ``(needs 2 ranks)``) is only compiled:
use it for snippets that need several ranks or a model defined elsewhere. Multi-rank code is
run for real by the examples (``examples/``) and the multi-process tests.
"""

from __future__ import annotations

import pathlib
import re
from typing import Any

import pytest

DOCS = pathlib.Path(__file__).resolve().parents[2] / "docs"
SKIP = "# doctest: +SKIP"
BLOCK = re.compile(r"^```python\n(.*?)^```", re.S | re.M)

# Files whose multi-rank snippets do not carry the marker yet (owned elsewhere): their blocks
# are compiled but not run. Remove a file from here once its blocks are marked.
UNMARKED: set[str] = set()


def _blocks(path: pathlib.Path) -> list[tuple[int, str]]:
    text = path.read_text()
    return [(text[: m.start()].count("\n") + 2, m.group(1)) for m in BLOCK.finditer(text)]


FILES = sorted(p.name for p in DOCS.glob("*.md") if _blocks(p))


def test_every_doc_with_snippets_is_collected() -> None:
    assert {"functional.md", "tour.md", "testing.md"} <= set(FILES)


@pytest.mark.parametrize("name", FILES)
def test_doc_snippets_run(name: str, tmp_path: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    namespace: dict[str, Any] = {"__name__": f"docs_{name.removesuffix('.md')}"}
    ran = 0
    for line, code in _blocks(DOCS / name):
        compiled = compile(code, f"docs/{name}:{line}", "exec")
        if code.lstrip().startswith(SKIP) or name in UNMARKED:
            continue
        exec(compiled, namespace)
        ran += 1
    if name not in UNMARKED:
        assert ran > 0 or all(c.lstrip().startswith(SKIP) for _, c in _blocks(DOCS / name))


def test_fsdp2_mapping_covers_every_method_and_argument() -> None:
    """docs/fsdp2_mapping.md names every public FSDPModule method and fully_shard argument of
    the installed torch (each with "same", "beyond" or a reason), so a new FSDP2 API shows up."""
    import inspect

    from torch.distributed.fsdp import FSDPModule, fully_shard

    doc = (DOCS / "fsdp2_mapping.md").read_text()
    methods = [
        n for n in FSDPModule.__dict__ if not n.startswith("_") and callable(getattr(FSDPModule, n))
    ]
    missing = [n for n in methods if f"`{n}" not in doc]
    missing += [p for p in inspect.signature(fully_shard).parameters if f"`{p}`" not in doc]
    assert not missing, f"docs/fsdp2_mapping.md does not mention {missing}"


def _api_names() -> list[tuple[str, str]]:
    """``(module, name)`` for every name in a ``| name | what |`` table of docs/api.md: a
    section whose heading names a module (``functional_fsdp.functional``) lists that module's
    names; a dotted name is relative to ``functional_fsdp`` (or absolute); ```m`: `a`, `b```
    lists ``m.a`` and ``m.b``. Built-in exception names given in parentheses are not listed."""
    import builtins

    module, header, out = "functional_fsdp", None, []
    for line in (DOCS / "api.md").read_text().splitlines():
        if line.startswith("#"):
            if line.startswith("## "):
                named = re.search(r"\(`(functional_fsdp\.[\w.]+)`", line)
                module = named.group(1) if named else "functional_fsdp"
            header = None
            continue
        if not line.startswith("|"):
            header = None
            continue
        first = line.strip("|").split("|")[0].strip()
        if header is None:
            header = first
            continue
        if header != "name" or set(first) <= set("-: "):
            continue
        prefix = ""
        for m in re.finditer(r"`([^`]+)`(:?)", first):
            name = m.group(1).split("(")[0].strip()
            if m.group(2):  # `core.recovery`: `regroup`, ...
                prefix = name + "."
            elif name != "..." and not hasattr(builtins, name):
                out.append((module, prefix + name))
    return out


def _resolve(module: str, name: str) -> Any:
    import importlib

    if "." not in name:
        namespace: dict[str, Any] = {}
        exec(f"from {module} import {name}", namespace)  # what a user writes
        return namespace[name]
    parts = name.removeprefix("functional_fsdp.").split(".")
    obj, path = importlib.import_module("functional_fsdp"), "functional_fsdp"
    for part in parts:  # an attribute (functional_fsdp.errors) or a submodule not loaded yet
        path += "." + part
        obj = getattr(obj, part) if hasattr(obj, part) else importlib.import_module(path)
    return obj


def test_every_name_api_md_lists_is_importable() -> None:
    """``from functional_fsdp import name`` (or the section's module) works for every name the
    API reference lists, the error classes included."""
    names = _api_names()
    assert ("functional_fsdp", "UnrecoverableLossError") in names
    assert ("functional_fsdp", "ReproducibilityError") in names
    assert len(names) > 80  # the parser found the tables
    missing = []
    for module, name in names:
        try:
            _resolve(module, name)
        except (ImportError, AttributeError) as e:
            missing.append(f"{module}: {name} ({e})")
    assert not missing, "docs/api.md lists names that do not import:\n" + "\n".join(missing)


def test_every_error_class_is_importable_from_the_top_level() -> None:
    import functional_fsdp
    from functional_fsdp.core import errors

    for name in errors.__all__:
        assert getattr(functional_fsdp, name) is getattr(errors, name)
        assert name in functional_fsdp.__all__


def test_api_md_lists_every_field_of_rebuilt() -> None:
    """docs/recovery.md's loop reads ``rb.epoch``; the reference lists it (and every field)."""
    import attrs

    from functional_fsdp.shell.recovery.rebuild import Rebuilt

    text = (DOCS / "api.md").read_text()
    listed = re.search(r"return `Rebuilt` \(([^)]*)\)", text)
    assert listed is not None
    names = set(re.findall(r"`(\w+)`", listed.group(1)))
    assert names == {f.name for f in attrs.fields(Rebuilt)} | {"spare"}


def test_the_recovery_docs_name_the_store_prefixes_the_code_uses() -> None:
    """The launcher's first world is epoch 0 of the scheme the rebuilt worlds use."""
    import inspect

    from functional_fsdp.shell import launch
    from functional_fsdp.shell.recovery import rebuild

    assert launch._EPOCH0 == "ffsdp-epoch0/"
    assert 'f"ffsdp-epoch{epoch}/"' in inspect.getsource(rebuild)
    for name in ("recovery.md", "design.md"):
        text = (DOCS / name).read_text()
        assert "`ffsdp-epoch0/`" in text and "ffsdp-epoch<k>/" in text, name
        assert "`epoch0/`" not in text, name


def _test_functions() -> dict[str, bool]:
    """Every test function of ``tests/``: whether an ``xfail`` mark decorates it."""
    import ast

    out: dict[str, bool] = {}
    for path in DOCS.parent.joinpath("tests").rglob("test_*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.FunctionDef) and node.name.startswith("test_"):
                marks = [ast.unparse(d) for d in node.decorator_list]
                out[node.name] = out.get(node.name, False) or any("xfail" in m for m in marks)
    return out


def test_fsdp2_mapping_names_tests_that_exist_and_xfails_that_are_marked() -> None:
    """Each test docs/fsdp2_mapping.md names exists (a function or a module), and a row that
    calls its test an xfail (a known failure) names one that is marked so: a fixed failure
    must not stay documented as open."""
    tests = _test_functions()
    modules = {p.stem for p in DOCS.parent.joinpath("tests").rglob("test_*.py")}
    for line in (DOCS / "fsdp2_mapping.md").read_text().splitlines():
        for name in re.findall(r"\b(test_\w+)", line):
            assert name in tests or name in modules, f"docs/fsdp2_mapping.md names {name}"
            if "xfail" in line and name in tests:
                assert tests[name], f"docs/fsdp2_mapping.md calls {name} an xfail; it passes"


def test_muon_md_says_which_single_process_it_matches() -> None:
    """docs/muon.md's "0.0 from one process" is against a single process given the mean of the
    per-rank gradients; against a full-batch one the distance is not 0 and is stated."""
    doc = " ".join((DOCS / "muon.md").read_text().split())
    assert "given exactly the mean of the per-rank gradients" in doc
    assert "Against a single process trained on the full batch" in doc
    assert "9.7e-4 from the full-batch one" in doc
