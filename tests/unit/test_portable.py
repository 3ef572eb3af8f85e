"""Results as they are committed (kvtool/portable.py): the paths of the machine that made them written
as a user types them; and held over the repository: no committed file names such a path."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

from kvtool.portable import REPO_ROOT, machine_prefixes, portable, portable_text

# A machine's: its checkout, its home directory, the folder the checkout lies in, its temporary folder.
PREFIXES = [("/srv/ci/kvtool", "."), ("/home/ci", "~"), ("/srv/ci", ".."), ("/tmp", "$TMPDIR")]


def test_a_command_and_its_paths_are_written_as_a_user_types_them():
    command = ["/srv/ci/kvtool/kvtool/cli.py", "bench", "--model", "/home/ci/.cache/kvtool/models/bench-llama"]
    command += ["--log-dir", "/tmp/kvb/logs", "--workload", "trace:/srv/ci/shared/traces/t.jsonl"]
    written = [portable_text(part, PREFIXES) for part in command]
    assert written == [
        "kvtool",
        "bench",
        "--model",
        "~/.cache/kvtool/models/bench-llama",
        "--log-dir",
        "$TMPDIR/kvb/logs",
        "--workload",
        "trace:../shared/traces/t.jsonl",
    ]
    assert portable_text("/srv/ci/kvtool/.venv/bin/python -m x", PREFIXES) == ".venv/bin/python -m x"
    assert portable_text("/srv/ci/kvtool", PREFIXES) == "."
    assert portable_text("/usr/bin/kvtool", PREFIXES) == "kvtool"  # the entry point, wherever installed


def test_a_result_keeps_its_shape_and_its_numbers():
    result = {"command": [str(REPO_ROOT / "kvtool" / "cli.py"), "bench"], "n": 3, "f": 0.5, "none": None}
    result["nested"] = [{"log_dir": str(REPO_ROOT / "logs" / "x")}, True]
    assert portable(result) == {
        "command": ["kvtool", "bench"],
        "n": 3,
        "f": 0.5,
        "none": None,
        "nested": [{"log_dir": "logs/x"}, True],
    }


def test_the_checkout_is_named_before_the_folder_it_lies_in():
    prefixes = machine_prefixes(Path("/tmp/clone/kvtool"))
    assert [written for _, written in prefixes][0] == "."
    assert portable_text("/tmp/clone/kvtool/benchmarks/x.json", prefixes) == "benchmarks/x.json"


# A path of a machine: the checkout's own, a home directory, a temporary folder, the workplace.
MACHINE_PATH = re.compile(r"(?<![\w.~$-])/(root|home|tmp|work)/")


def committed() -> list[Path]:
    names = subprocess.run(["git", "ls-files"], cwd=REPO_ROOT, capture_output=True, text=True, check=True).stdout
    return [REPO_ROOT / name for name in names.split() if not name.endswith(".png")]


def test_no_committed_result_or_command_names_a_path_of_the_machine_that_made_it():
    checkout = str(REPO_ROOT)
    found = []
    for path in committed():
        relative = path.relative_to(REPO_ROOT).as_posix()
        try:
            text = path.read_text()
        except (UnicodeDecodeError, FileNotFoundError):
            continue
        if checkout in text:
            found.append(f"{relative}: this checkout's path")
        # Results and their commands anywhere; the machine's own folders in code and docs too (a /tmp/
        # in a README example is a user's choice, not a result's).
        pattern = MACHINE_PATH if relative.startswith("benchmarks/") else re.compile(r"(?<![\w.~$-])/(root|home|work)/")
        if (match := pattern.search(text)) is not None and relative != "tests/unit/test_portable.py":
            line = text.count("\n", 0, match.start()) + 1
            found.append(f"{relative}:{line}")
    assert not found, found
