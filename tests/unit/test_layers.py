"""The import graph of the installed package, read with ``ast``: no circle between modules, and the
arrows point the way the layout says (README, "Layout"):

- ``consumer_kit.store`` knows nothing of the pipeline, the coordinator, tracing, HTTP, the command or
  any source: the store owns the SQL, everything else calls it;
- sources (``consumer_kit.sources``) build on the core's public names only: no store module, no
  pipeline, app, command, coordinator or testing module;
- the core imports no source, except the command (``consumer_kit.cli``), which runs them all.

An import under ``if TYPE_CHECKING:`` is for the type checker only: it closes no circle at run time,
so circles ignore it; the layer rules do not (a type from a forbidden layer is still a dependency on it).
An import inside a function counts like one at the top: it runs, later.
"""

from __future__ import annotations

import ast
import os
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import consumer_kit

ROOT = Path(consumer_kit.__file__).parent


@dataclass(frozen=True)
class Import:
    source: str  # the importing module
    target: str  # the imported module (a package's __init__ when a name comes from the package)
    line: int
    typing_only: bool


def modules() -> dict[str, Path]:
    """Every module of the package, by dotted name (``consumer_kit.sources`` through its folder)."""
    found = {}
    # os.walk, not Path.rglob: consumer_kit/sources is a link to the repository's sources/ folder.
    paths = [Path(top, file) for top, _dirs, files in os.walk(ROOT, followlinks=True) for file in files]
    for path in sorted(p for p in paths if p.suffix == ".py"):
        parts = ("consumer_kit", *path.relative_to(ROOT).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        found[".".join(parts)] = path
    return found


def _typing_blocks(tree: ast.Module) -> set[int]:
    """Line numbers inside ``if TYPE_CHECKING:`` blocks."""
    lines: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If):
            test = node.test
            name = test.id if isinstance(test, ast.Name) else test.attr if isinstance(test, ast.Attribute) else ""
            if name == "TYPE_CHECKING":
                for child in node.body:
                    lines.update(range(child.lineno, (child.end_lineno or child.lineno) + 1))
    return lines


def imports(known: dict[str, Path]) -> Iterator[Import]:
    """Every import of one package module by another."""
    for name, path in known.items():
        tree = ast.parse(path.read_text(), str(path))
        typing = _typing_blocks(tree)
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        for node in ast.walk(tree):
            targets: list[str] = []
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                    base = ".".join([*anchor, base] if base else anchor)
                # `from package import module` imports the module; `from module import name`, the module.
                targets = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in known else base for alias in node.names]
            for target in targets:
                while target and target not in known:  # `import a.b.c` of a package module: its longest known prefix
                    target = target.rpartition(".")[0]
                if target and target != name:
                    yield Import(name, target, node.lineno, node.lineno in typing)


def _circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for nxt in graph.get(node, ()):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def _under(module: str, *layers: str) -> bool:
    return any(module == layer or module.startswith(layer + ".") for layer in layers)


ALL = list(imports(modules()))


def _lines(found: list[Import]) -> str:
    return "\n".join(sorted({f"{i.source}:{i.line} imports {i.target}" for i in found}))


def test_the_graph_is_read() -> None:
    # The test can fail: it sees the imports it must judge (a parse that found nothing would pass anything).
    edges = {(i.source, i.target) for i in ALL}
    assert ("consumer_kit.app", "consumer_kit.pipeline") in edges
    assert ("consumer_kit.sources.webhooks", "consumer_kit.sources.webhooks.source") in edges
    assert any(i.typing_only for i in ALL)
    assert _circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_no_circle_between_modules() -> None:
    graph: dict[str, set[str]] = {}
    for each in ALL:
        if not each.typing_only:
            graph.setdefault(each.source, set()).add(each.target)
    circles = _circles(graph)
    detail = [f"circle of {len(c)}:\n" + _lines([i for i in ALL if {i.source, i.target} <= set(c)
                                                  and not i.typing_only]) for c in circles]
    assert not circles, "\n".join(detail)


def test_the_store_imports_no_layer_above_it() -> None:
    above = ("consumer_kit.pipeline", "consumer_kit.coordinator", "consumer_kit.tracing", "consumer_kit.app",
             "consumer_kit.context", "consumer_kit.http", "consumer_kit.cli", "consumer_kit.sources",
             "consumer_kit.testing", "consumer_kit.outbox", "consumer_kit.replay")
    wrong = [i for i in ALL if _under(i.source, "consumer_kit.store") and _under(i.target, *above)]
    assert not wrong, _lines(wrong)


def test_sources_import_only_public_names_of_the_core() -> None:
    forbidden = ("consumer_kit.store", "consumer_kit.pipeline", "consumer_kit.app", "consumer_kit.cli",
                 "consumer_kit.coordinator", "consumer_kit.testing")
    wrong = [i for i in ALL if _under(i.source, "consumer_kit.sources") and _under(i.target, *forbidden)]
    assert not wrong, _lines(wrong)


def test_the_core_imports_no_source_but_the_command_runs_them() -> None:
    wrong = [i for i in ALL if not _under(i.source, "consumer_kit.sources", "consumer_kit.cli")
             and _under(i.target, "consumer_kit.sources")]
    assert not wrong, _lines(wrong)


MAX_MODULE_LINES = 500
MAX_FUNCTION_LINES = 60


def test_modules_and_functions_are_of_a_size_to_read() -> None:
    # A function longer than a screen says why in its docstring, with the words "Kept whole".
    too_long = []
    for name, path in modules().items():
        text = path.read_text()
        if text.count("\n") > MAX_MODULE_LINES:
            too_long.append(f"{name}: {text.count(chr(10))} lines")
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                length = (node.end_lineno or node.lineno) - node.lineno + 1
                if length > MAX_FUNCTION_LINES and "kept whole" not in (ast.get_docstring(node) or "").lower():
                    too_long.append(f"{name}.{node.name} (line {node.lineno}): {length} lines")
    assert not too_long, "\n".join(too_long)


def _third_party(module: str) -> bool:
    top = module.split(".")[0]
    return top not in ("consumer_kit", "__future__") and top not in sys.stdlib_module_names


INTERNAL_MODULES = ("uvicorn.protocols", "moto.moto_server", "moto.core.utils")
"""Modules of dependencies that are their implementation, not their API, though not named with a ``_``."""


def test_no_private_name_of_another_object_or_library() -> None:
    # A dependency's private attribute skips its own error handling and changes without notice: nothing
    # in the package reads or replaces another object's ``_name`` (its own, on self or cls, only), nor
    # imports a dependency's private or internal module or name.
    found = []
    for name, path in modules().items():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.startswith("__"):
                owner = node.value
                if isinstance(owner, ast.Name) and owner.id in ("self", "cls"):
                    continue
                if isinstance(owner, ast.Call) and isinstance(owner.func, ast.Name) and owner.func.id == "super":
                    continue
                found.append(f"{name}:{node.lineno}: {ast.unparse(node)}")
            elif isinstance(node, ast.ImportFrom) and not node.level and node.module and _third_party(node.module):
                private = [a.name for a in node.names if a.name.startswith("_")]
                if private or any(part.startswith("_") for part in node.module.split(".")) \
                        or _under(node.module, *INTERNAL_MODULES):
                    names = ", ".join(a.name for a in node.names)
                    found.append(f"{name}:{node.lineno}: from {node.module} import {names}")
            elif isinstance(node, ast.Import):
                for alias in node.names:
                    if _third_party(alias.name) and (any(p.startswith("_") for p in alias.name.split("."))
                                                     or _under(alias.name, *INTERNAL_MODULES)):
                        found.append(f"{name}:{node.lineno}: import {alias.name}")
    assert not found, "\n".join(found)
