"""The house docs/architecture.md draws: no folder of `lifecycle/` or `replay/`
holds more than 16 modules of its own, and no modules import each other, directly or around a
circle (every import counted, those inside functions too)."""

from __future__ import annotations

from pathlib import Path

import grimp
import pytest

from tests.conftest import REPO

MAX_MODULES = 16


def test_no_folder_holds_more_than_16_modules() -> None:
    crowded = {
        str(folder.relative_to(REPO)): count
        for root in ("lifecycle", "replay")
        for folder in [REPO / root, *(p for p in (REPO / root).rglob("*") if p.is_dir())]
        if (count := sum(1 for f in folder.glob("*.py") if f.name != "__init__.py")) > MAX_MODULES
    }
    assert not crowded, crowded


def circles(graph: grimp.ImportGraph) -> list[list[str]]:
    """Each set of modules that import one another around a circle (strongly connected
    components of more than one module), by Tarjan's algorithm without recursion."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    for root in sorted(graph.modules):
        if root in index:
            continue
        work = [(root, iter(sorted(graph.find_modules_directly_imported_by(root))))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            module, imported = work[-1]
            step = next(imported, None)
            if step is not None:
                if step not in index:
                    index[step] = low[step] = len(index)
                    stack.append(step)
                    on_stack.add(step)
                    work.append((step, iter(sorted(graph.find_modules_directly_imported_by(step)))))
                elif step in on_stack:
                    low[module] = min(low[module], index[step])
                continue
            work.pop()
            if work:
                parent = work[-1][0]
                low[parent] = min(low[parent], low[module])
            if low[module] == index[module]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == module:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return found


def test_no_modules_import_each_other() -> None:
    graph = grimp.build_graph("lifecycle", "replay", include_external_packages=False)
    assert circles(graph) == []


def test_a_circle_is_found(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The check itself: two modules of a package made here that import each other (one of
    them inside a function), and a third that imports one of them without being imported
    back."""
    package = tmp_path / "circled"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "a.py").write_text("def f():\n    from circled import b\n")
    (package / "b.py").write_text("from circled import a\n")
    (package / "c.py").write_text("from circled import a\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    graph = grimp.build_graph("circled", include_external_packages=False)
    assert circles(graph) == [["circled.a", "circled.b"]]
