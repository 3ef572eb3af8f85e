"""docs/architecture.md matches the tree: it names every connector module, and every path it quotes
(from the repository, or from connector/ or kvtool/ where it walks inside one) exists."""

from __future__ import annotations

import re
from pathlib import Path

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
