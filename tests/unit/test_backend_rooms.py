"""A store backend is what it says: one module builds it (its settings section, its client, its probe)
and one line registers it (``connector/store/backends.py``). No other module of the connector names the
store a backend speaks to in its code (names, attributes, imports, strings; comments and docstrings may
say why a wrapper exists), so a second backend is added without touching the config, the stack or the
sides."""

from __future__ import annotations

import ast
import dataclasses
from pathlib import Path

import pytest

from connector.config import ConfigError, load_config
from connector.store.backend import Backend
from connector.store.backends import BACKENDS, DEFAULT_BACKEND

ROOT = Path(__file__).resolve().parents[2]
# The Mooncake backend's modules, and the registry's one line.
BACKEND_MODULES = {
    "connector/store/mooncake_config.py",
    "connector/store/mooncake.py",
    "connector/store/segment.py",
    "connector/store/backends.py",
}


def _docstrings(tree: ast.AST) -> set[int]:
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef) and node.body:
            first = node.body[0]
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant):
                found.add(id(first.value))
    return found


def _named(node: ast.AST, docstrings: set[int]) -> str | None:
    """What ``node`` names in code: an identifier, an attribute, an import, or a string that is no docstring."""
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        return node.attr
    if isinstance(node, ast.alias | ast.FunctionDef | ast.ClassDef):
        return node.name
    if isinstance(node, ast.ImportFrom):
        return node.module
    if isinstance(node, ast.arg):
        return node.arg
    if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docstrings:
        return node.value
    return None


def test_no_connector_module_outside_the_backend_names_mooncake():
    named = []
    for path in sorted((ROOT / "connector").rglob("*.py")):
        module = path.relative_to(ROOT).as_posix()
        if module in BACKEND_MODULES:
            continue
        tree = ast.parse(path.read_text())
        docstrings = _docstrings(tree)
        for node in ast.walk(tree):
            text = _named(node, docstrings)
            if text and "mooncake" in text.lower():
                named.append(f"{module}:{getattr(node, 'lineno', '?')} {text[:60]!r}")
    assert not named, "names the Mooncake backend outside it: " + "; ".join(named)


def test_the_default_backend_is_a_registered_backend_and_its_section_is_the_configs():
    assert isinstance(BACKENDS[DEFAULT_BACKEND], Backend)
    config = load_config({DEFAULT_BACKEND: {"master_server_address": "127.0.0.1:1"}})
    assert config.store_backend == DEFAULT_BACKEND
    assert isinstance(config.backend, BACKENDS[DEFAULT_BACKEND].settings)


def test_the_stack_asks_the_registered_backend_for_its_client_its_probe_and_its_name(monkeypatch):
    """A backend registered under the default's name is what every store is opened from: nothing else
    knows which client it makes."""
    from connector.store.stack import open_store_stack

    from .scripted_store import ScriptedStore

    opened = []
    registered = dataclasses.replace(
        BACKENDS[DEFAULT_BACKEND],
        open=lambda config: opened.append(config.backend.global_segment_size) or ScriptedStore(),
        probe=lambda config: None,
    )
    monkeypatch.setitem(BACKENDS, DEFAULT_BACKEND, registered)
    config = load_config({"master_server_address": "127.0.0.1:1", "global_segment_size": 1 << 20})
    open_store_stack(config, "reader").close()
    assert opened == [0]  # a reader lends nothing: the backend's own ``lending_nothing``


def test_an_unknown_backend_is_one_sentence():
    with pytest.raises(ConfigError) as caught:
        load_config({"store_backend": "redis", "master_server_address": "127.0.0.1:1"})
    assert str(caught.value) == (
        f'kvtool connector config: field \'store_backend\' is "redis"; it should be one of "{DEFAULT_BACKEND}"'
    )


def test_a_config_is_written_as_a_config_gives_it_and_read_back_the_same():
    """``model_dump`` names the section by its backend (what kvtool prints and passes on), never ``backend``."""
    config = load_config({"master_server_address": "127.0.0.1:1", "global_segment_size": "1MB", "hash_unit": 4})
    written = config.model_dump(mode="json")
    assert "backend" not in written and written[DEFAULT_BACKEND]["global_segment_size"] == 1 << 20
    assert load_config(written) == config
