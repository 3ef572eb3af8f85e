"""The connector's counters: one list (connector/metrics.py COUNTERS), the names the code counts, and the
operator's guide's table (docs/operators-guide.md), held together."""

import ast
import re
from pathlib import Path

from connector.metrics import COUNTERS, counter_help

ROOT = Path(__file__).resolve().parents[2]


def counted_names() -> set[str]:
    """Every counter name the connector's code passes to a Counters.add, a counts dict or a stats key: a
    literal name, or an f-string's literal prefix (a family)."""
    names: set[str] = set()
    for path in (ROOT / "connector").glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "add":
                first = node.args[0] if node.args else None
            elif (
                isinstance(node, ast.Subscript)
                and isinstance(node.value, ast.Name)
                and node.value.id
                in (
                    "counts",
                    "taken",
                )
            ):
                first = node.slice
            else:
                continue
            if isinstance(first, ast.Constant) and isinstance(first.value, str):
                names.add(first.value)
            elif isinstance(first, ast.JoinedStr) and isinstance(first.values[0], ast.Constant):
                names.add(first.values[0].value + "<>")
    return names


def test_every_name_the_code_counts_has_its_entry():
    families = {key[: key.index("<")] for key in COUNTERS if key.endswith(">")}
    undocumented = set()
    for name in counted_names():
        if name.endswith("<>"):
            if name[:-2] not in families:
                undocumented.add(name)
        elif name not in COUNTERS and not any(name.startswith(prefix) for prefix in families):
            undocumented.add(name)
    # The loader's per-kind counts are built from a kind name alone (an f-string with no literal prefix);
    # they are listed one by one below.
    assert undocumented <= {"<>"}, sorted(undocumented)
    for kind in ("block", "tail", "state"):
        assert f"{kind}_objects_loaded" in COUNTERS


def test_a_family_member_gets_its_familys_help_with_its_label():
    assert counter_help("load_failures_checksum").endswith("[checksum]")
    assert counter_help("saves_stored").startswith("save objects by outcome")
    assert counter_help("saves_dropped_budget") == COUNTERS["saves_dropped_budget"]  # its own entry wins


def test_the_operators_guide_table_is_the_catalogue():
    guide = (ROOT / "docs" / "operators-guide.md").read_text()
    table = guide[guide.index("<!-- metrics table") : guide.index("<!-- end of metrics table -->")]
    rows = re.findall(r"^\| `vllm:kvtool_(.+)_total` \| (.+) \|$", table, flags=re.MULTILINE)
    assert rows == list(COUNTERS.items())
