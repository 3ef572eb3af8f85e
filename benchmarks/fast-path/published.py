"""What every fast-path script does with its result: names the commit it ran on, prints it, writes it."""

from __future__ import annotations

import json
import os
import platform
import subprocess
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]


def git_head() -> str:
    """The short hash of the checked-out commit (the configuration a result came from)."""
    return subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=REPO
    ).stdout.strip()


def provenance() -> dict[str, Any]:
    """What a result says about where it ran: this machine's cores, the Python, the commit."""
    return {"machine": {"cpus": os.cpu_count(), "python": platform.python_version()}, "head": git_head()}


def write_result(result: dict[str, Any], out: Path | None, echo: bool = True) -> None:
    """Print ``result`` as JSON (``echo``) and write it to ``out`` when one is given."""
    text = json.dumps(result, indent=2)
    if echo:
        print(text)
    if out:
        out.write_text(text + "\n")
