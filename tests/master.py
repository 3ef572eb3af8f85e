"""A real mooncake_master on loopback for tests (``kvtool.store.master.LocalMaster``); a master that
does not start fails the test that needs it."""

from __future__ import annotations

import pytest

from kvtool.errors import ServerError
from kvtool.procs import LOOPBACK
from kvtool.store.master import LocalMaster

__all__ = ["LOOPBACK", "Master"]


class Master(LocalMaster):
    def start(self, timeout_s: float = 30.0) -> Master:
        try:
            super().start(timeout_s)
        except ServerError as exc:
            pytest.fail(str(exc))
        return self
