"""The store backends by name (the config's ``store_backend``). A backend is one module, which builds
its ``Backend`` (``backend.Backend``: its settings section, its client, its probe), and one line here;
no other module of the connector names the store a backend speaks to (a test holds it)."""

from __future__ import annotations

from typing import Union

from pydantic import BaseModel

from . import mooncake
from .backend import Backend

BACKENDS: dict[str, Backend] = {backend.name: backend for backend in (mooncake.BACKEND,)}
DEFAULT_BACKEND = next(iter(BACKENDS))
# The type of the config's ``backend`` field: any registered backend's settings.
_SETTINGS = tuple(backend.settings for backend in BACKENDS.values())
BackendSettings: type[BaseModel] = _SETTINGS[0] if len(_SETTINGS) == 1 else Union[_SETTINGS]  # type: ignore[assignment]  # noqa: UP007
