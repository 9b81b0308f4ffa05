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

DOCS = pathlib.Path(__file__).resolve().parent.parent / "docs"
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
