"""docs/architecture.md matches the tree: it names every connector module, every path it quotes
(from the repository, or from connector/ or kvtool/ where it walks inside one) exists, and its walk
of a consumer hit is one the code takes, within the issue's bounds (10 modules, 4 packages)."""

from __future__ import annotations

import re
from pathlib import Path

from .test_code_shape import imported, module_name

ROOT = Path(__file__).resolve().parents[2]
DOC = (ROOT / "docs" / "architecture.md").read_text()


def test_every_connector_module_is_named():
    modules = [p for p in ROOT.joinpath("connector").rglob("*.py") if p.name != "__init__.py"]
    missing = [str(p.relative_to(ROOT)) for p in modules if p.name not in DOC]
    assert not missing, f"connector modules docs/architecture.md does not name: {missing}"


def test_every_quoted_path_exists():
    quoted = set(re.findall(r"`([\w./-]+/[\w.-]*)`", DOC))
    assert quoted
    missing = [
        path
        for path in sorted(quoted)
        if not any((base / path).exists() for base in (ROOT, ROOT / "connector", ROOT / "kvtool"))
    ]
    assert not missing, f"paths docs/architecture.md quotes that do not exist: {missing}"


def hit_walk() -> list[str]:
    """The connector modules the "consumer hit, room by room" walk opens, in order (its first
    paragraph, up to where it counts them)."""
    section = DOC.split("### A consumer hit, room by room", 1)[1].split(" modules in ", 1)[0]
    return re.findall(r"`([\w/]+\.py)`", section)


def test_the_hit_walk_stays_within_ten_modules_in_four_packages():
    walk = hit_walk()
    assert walk[0] == "connector.py", "the walk starts at the facade vLLM loads"
    assert len(walk) == len(set(walk)) <= 10, walk
    packages = {path.split("/")[0] for path in walk if "/" in path}
    assert len(packages) <= 4, packages
    missing = [path for path in walk if not (ROOT / "connector" / path).is_file()]
    assert not missing, missing


def test_the_hit_walk_is_a_path_the_imports_take():
    """Each module the walk opens is imported, directly or through others, by the facade: the walk
    is the code's, not a list of names."""
    paths = {module_name(p): p for p in ROOT.joinpath("connector").rglob("*.py")}
    known = set(paths)
    reached, frontier = set(), ["connector.connector"]
    while frontier:
        name = frontier.pop()
        if name not in reached:
            reached.add(name)
            frontier.extend(imported(paths[name], name, known))
    walked = ["connector." + path.removesuffix(".py").replace("/", ".") for path in hit_walk()]
    assert not [name for name in walked if name not in reached]
