"""The store interface every backend implements and every extra wraps (time-outs, the circuit
breaker, fault injection), and what a backend registers (``Backend``: its settings section, its
client, its probe; ``backends.BACKENDS``). No imports of its own: backends and wrappers depend on
it, never the other way (the staging types are named for type checks only; what a backend reads of
the connector's config is ``StoreConfig``, so the config may know the backends without a circle)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from enum import Enum
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from pydantic import BaseModel

    from .staging import Lease, Region


class PutOutcome(str, Enum):
    STORED = "stored"
    NO_SPACE = "no_space"
    # Refused for space by a store that holds nothing it held before: a restarted master whose segments
    # are not mounted yet (``refusals``). Backends answer NO_SPACE; the saver tells the two apart.
    NOT_READY = "not_ready"
    FAILED = "failed"


class KVStore(Protocol):
    def exists(self, keys: Sequence[str]) -> list[bool]: ...

    def get(self, keys: Sequence[str], object_bytes: int = 0) -> list[bytes | None]:
        """Objects for ``keys``; None where the key is missing or its transfer failed.

        ``object_bytes`` (the expected size of each) lets the store split a large batch."""
        ...

    def put(self, key: str, value: bytes) -> PutOutcome: ...

    def put_many(self, items: Sequence[tuple[str, bytes]], replace: bool = False) -> PutOutcome:
        """Put several small objects in one call; one outcome for all (STORED: every one is stored).
        ``replace``: a key already stored takes the new value (else the first put wins)."""
        ...

    # Zero-copy transfers (objects): straight between the store and registered host memory.

    def register(self, address: int, nbytes: int) -> None:
        """Register host memory that ``get_into`` and ``put_from`` regions lie in (a staging area);
        raises ``StoreError`` when the store refuses it."""
        ...

    def get_into(self, keys: Sequence[str], regions: Sequence[Region], lease: Lease) -> list[int]:
        """Read each key's object into its region (one batch); per key the bytes read, or 0 or a
        negative code where it is missing or its transfer failed. ``regions`` lie in ``lease``: a call
        that may outlive its caller (a time-out) holds the lease until it returns."""
        ...

    def put_from(self, items: Sequence[tuple[str, Region]], lease: Lease) -> list[PutOutcome]:
        """Put each key's object from its region (one batch); an outcome per key (a key already stored
        counts as stored and keeps its value). ``lease`` as in ``get_into``."""
        ...

    def remove(self, key: str) -> int: ...

    def close(self) -> None: ...


class StoreConfig(Protocol):
    """What a backend reads of the connector's config (``config.KVToolConfig``): its own section and how
    long a connection may take."""

    @property
    def backend(self) -> Any: ...

    @property
    def connect_timeout_s(self) -> float: ...


@dataclass(frozen=True)
class Backend:
    """A store backend as the connector knows it: one module builds it, one line registers it
    (``backends.BACKENDS``). Nothing outside that module names the store it speaks to."""

    name: str  # the config's ``store_backend`` and the name of the backend's own section in it
    settings: type[BaseModel]  # that section's type: ``config.backend``
    # Its fields as every config before the section gave them, at the top level (moved into the section),
    # and the options that name where more of them are read (``load_config``).
    flat_fields: tuple[str, ...]
    options: tuple[str, ...]
    # ``raw`` (the extra config, as given) with what those options name merged into the section, and
    # the options popped; returns where the settings came from, for the log. Raises ``ConfigError``.
    read_settings: Callable[[dict[str, Any]], str]
    open: Callable[[StoreConfig], KVStore]  # the client (raises ``StoreError`` when unreachable)
    # Whether a client can be set up, asked first where that may stall the caller: None, or why not.
    probe: Callable[[StoreConfig], str | None] | None
    describe: Callable[[Any], str]  # "the <store> at <where>", for logs and errors
    lending_nothing: Callable[[Any], Any]  # the settings of a client that lends the store no memory
    client_identity: Callable[[Any], tuple]  # settings a process's clients may share one client under
