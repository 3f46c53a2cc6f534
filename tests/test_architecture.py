"""The shape of the package: a one-way import graph, and a command line that starts without torch."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

import rlinfluence

PACKAGE = Path(rlinfluence.__file__).parent


def _module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)



def _imports(tree: ast.AST) -> list[ast.Import | ast.ImportFrom]:
    """Every import of ``tree``, inside functions and under ``if TYPE_CHECKING`` too: an annotation
    that names another module's class ties the two modules as an import does."""
    found, todo = [], [tree]
    while todo:
        node = todo.pop()
        if isinstance(node, ast.Import | ast.ImportFrom):
            found.append(node)
        todo.extend(ast.iter_child_nodes(node))
    return found


def module_imports() -> dict[str, set[str]]:
    """Every module of the package -> the package modules it imports, at module level or inside a
    function (a lazy import is an edge too: it runs whenever the function does)."""
    modules = {_module_name(p): p for p in PACKAGE.rglob("*.py")}
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        edges = set()
        for node in _imports(ast.parse(path.read_text())):
            targets = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                [node.module or ""] if isinstance(node, ast.ImportFrom) and node.level == 0 else []
            if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                targets += [f"{node.module}.{a.name}" for a in node.names]
            edges |= {t for t in targets if t in modules and t != name}
        graph[name] = edges
    return graph


def test_the_package_imports_form_no_circle():
    graph = module_imports()
    state: dict[str, int] = {}

    def visit(node: str, path: list[str]) -> None:
        state[node] = 1
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                pytest.fail(f"import circle: {' -> '.join(path[path.index(nxt):] + [nxt])}")
            if nxt not in state:
                visit(nxt, path + [nxt])
        state[node] = 2

    for module in sorted(graph):
        if module not in state:
            visit(module, [module])


def _reachable(graph: dict[str, set[str]], start: str) -> set[str]:
    seen, todo = set(), [start]
    while todo:
        for nxt in graph[todo.pop()] - seen:
            seen.add(nxt)
            todo.append(nxt)
    return seen


@pytest.mark.parametrize(("module", "never"), [
    ("rlinfluence.influence", ("rlinfluence.ppo", "rlinfluence.filters")),  # it scores any policy for anyone
    ("rlinfluence.ppo", ("rlinfluence.analysis", "rlinfluence.cli")),  # training never depends on analysis
    ("rlinfluence.filters", ("rlinfluence.analysis", "rlinfluence.ppo")),
    ("rlinfluence.config", ("rlinfluence.ppo", "rlinfluence.filters", "rlinfluence.influence")),
    ("rlinfluence.analysis", ("rlinfluence.experiments",)),  # what both use sits below both
    ("rlinfluence.experiments", ("rlinfluence.analysis",)),
    *((m, ("rlinfluence.analysis", "rlinfluence.experiments", "rlinfluence.ppo")) for m in
      ("rlinfluence.statistics", "rlinfluence.executor", "rlinfluence.sections", "rlinfluence.pages",
       "rlinfluence.restore", "rlinfluence.sources")),
])
def test_the_one_way_rules_hold(module, never):
    graph = module_imports()
    starts = [m for m in graph if m == module or m.startswith(module + ".")]
    reached = set().union(*(_reachable(graph, s) for s in starts))
    assert not [m for m in reached if any(m == n or m.startswith(n + ".") for n in never)]
    assert not any("rlinfluence.cli" in edges for name, edges in graph.items() if name != "rlinfluence.__main__")


def test_the_command_line_imports_no_torch_scipy_or_pandas():
    code = ("import sys, rlinfluence.cli; "
            "print(sorted(m for m in ('torch', 'scipy', 'pandas', 'transformers') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"
    for args in (["--help"], ["train", "--help"], ["--version"]):
        code = (f"import sys, rlinfluence.cli\ntry:\n    rlinfluence.cli.main({args!r})\nexcept SystemExit:\n    pass\n"
                "print('modules', sorted(m for m in ('torch', 'scipy', 'pandas') if m in sys.modules))")
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
        assert out.strip().splitlines()[-1] == "modules []", (args, out[-300:])
