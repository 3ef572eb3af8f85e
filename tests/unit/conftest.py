"""Fixtures the unit tests of serve-pair share."""

from __future__ import annotations

import json
from pathlib import Path

import pytest


@pytest.fixture
def model_dir(tmp_path: Path) -> Path:
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({"vocab_size": 1024}))
    return model


@pytest.fixture
def processes(tmp_path: Path):
    """Real processes a test starts (cheap ones: ``sleep``), stopped after it."""
    from kvtool.procs import ProcessSet

    procs = ProcessSet(tmp_path / "logs")
    yield procs
    procs.stop_all(grace_s=1)
