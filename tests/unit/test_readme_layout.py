"""The README's layout names every module, and every path it quotes exists (issue 20: the layout and
"where things are" match the tree)."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
README = (ROOT / "README.md").read_text()
# Packages the layout names by their directory and a rule ("one module per workload"), not file by file.
BY_DIRECTORY = ("kvtool/bench/workloads/",)


def layout_block() -> str:
    section = README[README.index("## Layout") : README.index("## Where things are")]
    return section[section.index("```") + 3 : section.rindex("```")]


def test_the_layout_names_every_module_and_package():
    block = layout_block()
    modules = [*ROOT.joinpath("connector").rglob("*.py"), *ROOT.joinpath("kvtool").rglob("*.py")]
    missing = [
        str(path.relative_to(ROOT))
        for path in modules
        if path.name != "__init__.py"
        and not str(path.relative_to(ROOT)).startswith(BY_DIRECTORY)
        and path.name not in block
    ]
    assert not missing, f"modules the README's layout does not name: {missing}"
    packages = [
        p.name
        for top in ("kvtool", "connector")
        for p in ROOT.joinpath(top).iterdir()
        if p.is_dir() and p.name != "__pycache__"
    ]
    assert all(f"{name}/" in block for name in packages), packages


def test_every_path_the_readme_quotes_exists():
    quoted = set(re.findall(r"`((?:connector|kvtool|tests|benchmarks|configs|docs|scripts)/[^` ]*)`", README))
    assert quoted
    missing = [path for path in sorted(quoted) if not (ROOT / path.split("::")[0]).exists()]
    assert not missing, f"paths the README quotes that do not exist: {missing}"
