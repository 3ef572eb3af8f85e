"""The shape issue 20 set for the code, held: no module over 450 lines anywhere in the project
(benchmarks and tests included), no function over 80 lines, every line as ``ruff format`` writes it
(no marker that keeps a line from it), and no import cycle among kvtool/ and
connector/ modules (imports inside functions and ``if TYPE_CHECKING:`` blocks included)."""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
MAX_MODULE_LINES = 450
MAX_FUNCTION_LINES = 80
PACKAGES = ("kvtool", "connector")


def sources() -> list[Path]:
    return [p for top in (*PACKAGES, "benchmarks", "tests", "scripts") for p in ROOT.joinpath(top).rglob("*.py")]


def test_no_module_is_over_450_lines():
    long = {str(p.relative_to(ROOT)): n for p in sources() if (n := len(p.read_text().splitlines())) > MAX_MODULE_LINES}
    assert not long, long


def test_no_function_is_over_80_lines():
    long = [
        f"{p.relative_to(ROOT)}:{node.lineno} {node.name} ({node.end_lineno - node.lineno + 1} lines)"
        for p in sources()
        for node in ast.walk(ast.parse(p.read_text()))
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef)
        and node.end_lineno - node.lineno + 1 > MAX_FUNCTION_LINES
    ]
    assert not long, long


def test_no_line_is_kept_from_the_formatter():
    """Lines are shaped by ``ruff format``, never packed past it: no skip or off marker anywhere."""
    marked = [
        f"{p.relative_to(ROOT)}:{number}"
        for p in sources()
        for number, line in enumerate(p.read_text().splitlines(), 1)
        if re.search(r"#\s*fmt:\s*(skip|off)\b", line)
    ]
    assert not marked, marked


def test_the_formatter_finds_nothing_to_change():
    done = subprocess.run(
        [sys.executable, "-m", "ruff", "format", "--check", *PACKAGES, "benchmarks", "tests", "scripts"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imported(path: Path, name: str, known: set[str]) -> set[str]:
    """The project modules ``path`` imports (any depth, deferred ones and ``if TYPE_CHECKING:`` ones
    too: a circle of types is a circle of concerns)."""
    tree = ast.parse(path.read_text())
    package = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = package[: len(package) - node.level + 1] if node.level else []
            module = ".".join([*base, *([node.module] if node.module else [])])
            found.add(module)
            found.update(f"{module}.{alias.name}" for alias in node.names)
    return {m for m in found if m in known and m != name}


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    for start in graph:
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, edges = work[-1]
            for nxt in edges:
                if nxt not in index:
                    index[nxt] = low[nxt] = len(index)
                    stack.append(nxt)
                    on_stack.add(nxt)
                    work.append((nxt, iter(sorted(graph[nxt]))))
                    break
                if nxt in on_stack:
                    low[node] = min(low[node], index[nxt])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
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
    return found


def test_no_import_cycles():
    paths = {module_name(p): p for top in PACKAGES for p in ROOT.joinpath(top).rglob("*.py")}
    known = set(paths)
    graph = {name: imported(path, name, known) for name, path in paths.items()}
    # A package's __init__ is imported on the way to any of its modules: an edge to it is no cycle.
    graph = {name: {m for m in deps if not name.startswith(f"{m}.")} for name, deps in graph.items()}
    assert not cycles(graph)


def test_the_cycle_finder_finds_a_cycle():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []
