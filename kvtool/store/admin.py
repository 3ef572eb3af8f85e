"""The store's admin side: what kvtool inspect and kvtool bench ask of a store besides objects.

``StoreAdmin`` is the interface (list keys, one key's existence, stored sizes, metrics, health) that
inspect, bench, smoke and the tests type against; ``open_admin`` gives the one for an admin URL.
``MooncakeAdmin`` implements it over the Mooncake master's admin HTTP endpoints (its metrics port);
a second backend's admin is one class here and a line in ``open_admin``. The master does not
URL-decode query strings, so keys go into URLs raw; kvtool's keys use only ``[a-z0-9/]``, which need
no escaping. The module-level functions are Mooncake's calls by URL.
"""

from __future__ import annotations

import time
from typing import Protocol

import httpx

from kvtool import web
from kvtool import prometheus
from kvtool.errors import ServerError, UserError


class StoreAdmin(Protocol):
    url: str  # where it is, as messages name it

    def keys(self) -> list[str]: ...

    def exists(self, key: str) -> bool: ...

    def sizes(self, keys: list[str]) -> dict[str, int | None]: ...

    def metrics(self) -> dict[str, float]: ...

    def key_count(self) -> float | None: ...

    def healthy(self) -> bool: ...

    def role(self) -> str | None: ...  # in a high-availability group: leader or standby; else None


class MooncakeAdmin:
    """``StoreAdmin`` over a Mooncake master's admin URL (e.g. http://127.0.0.1:9003)."""

    def __init__(self, url: str):
        self.url = url

    def keys(self) -> list[str]:
        return all_keys(self.url)

    def exists(self, key: str) -> bool:
        return key_exists(self.url, key)

    def sizes(self, keys: list[str]) -> dict[str, int | None]:
        return object_sizes(self.url, keys)

    def metrics(self) -> dict[str, float]:
        return prometheus.samples(metrics_text(self.url))

    def key_count(self) -> float | None:
        return prometheus.total(metrics_text(self.url), "master_key_count")

    def healthy(self) -> bool:
        try:
            return web.get(f"{self.url.rstrip('/')}/health", timeout=2.0).status_code == 200
        except httpx.HTTPError:
            return False

    def role(self) -> str | None:
        """``leader`` or ``standby`` for a master of a high-availability group (its ``/role``); None for a
        master that does not say (not in HA mode, or an older one)."""
        try:
            answer = web.get(f"{self.url.rstrip('/')}/role", timeout=2.0)
        except httpx.HTTPError:
            return None
        role = answer.text.strip() if answer.status_code == 200 else ""
        return role if role in ("leader", "standby") else None


def open_admin(url: str) -> StoreAdmin:
    """The store's admin at ``url`` (a Mooncake master's admin URL: its --metrics_port)."""
    return MooncakeAdmin(url)


def key_exists(admin_url: str, key: str, timeout_s: float = 5.0) -> bool:
    url = f"{admin_url.rstrip('/')}/query_key?key={key}"
    try:
        answer = web.get(url, timeout=timeout_s)
    except httpx.HTTPError as exc:
        raise ServerError(f"the Mooncake master admin at {admin_url} did not answer: {exc}") from None
    return answer.status_code == 200 and bool(answer.json().get("success"))


def wait_for_key(admin: StoreAdmin, key: str, timeout_s: float = 60.0, poll_s: float = 0.05) -> bool:
    """Wait until ``key`` is in the store; False if it is not there after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while True:
        if admin.exists(key):
            return True
        if time.monotonic() >= deadline:
            return False
        time.sleep(poll_s)


def wait_for_quiet_key_count(
    admin: StoreAdmin, timeout_s: float, quiet_s: float, above: float | None = None, poll_s: float = 0.1
) -> tuple[float | None, bool]:
    """Wait until the store's key count is above ``above`` (when given) and then has not changed for
    ``quiet_s``: the durability signal for a connector that names no key to wait for. Returns the
    last count seen and whether it went quiet within ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    last, quiet_since = None, time.monotonic()
    while time.monotonic() < deadline:
        count = admin.key_count()
        now = time.monotonic()
        if count != last or (above is not None and (count is None or count <= above)):
            last, quiet_since = count, now
        elif now - quiet_since >= quiet_s:
            return count, True
        time.sleep(poll_s)
    return last, False


# ---- listing and metrics (kvtool inspect) --------------------------------------------------

# Keys per /batch_query_keys call: keeps the raw URL short (a key is under 80 characters).
BATCH_QUERY_KEYS = 50


def admin_get(admin_url: str, path: str, timeout_s: float = 10.0) -> httpx.Response:
    """GET an admin endpoint; a dead or wrong address is a one-sentence ServerError.

    ``path`` goes into the URL raw (the master does not URL-decode). A 404 from the master for a
    missing key is an answer, so only other failures, and pages that are not the master's, raise.
    """
    url = f"{admin_url.rstrip('/')}{path}"
    try:
        answer = web.get(url, timeout=timeout_s)
    except httpx.InvalidURL as exc:
        raise UserError(
            f"{admin_url!r} is not a usable admin URL ({exc}); give one like http://127.0.0.1:9003"
        ) from None
    except httpx.UnsupportedProtocol:
        raise UserError(f"{admin_url!r} is not an http:// URL; give one like http://127.0.0.1:9003") from None
    except httpx.HTTPError as exc:
        raise ServerError(
            f"the Mooncake master admin at {admin_url} did not answer ({type(exc).__name__}: {exc}); "
            "is the master running, and is this its --metrics_port?"
        ) from None
    if answer.status_code >= 500 or (answer.status_code != 200 and not _is_master_json(answer)):
        raise ServerError(
            f"{url} answered HTTP {answer.status_code}: {admin_url} does not look like a Mooncake master's "
            "admin port (its --metrics_port)"
        )
    return answer


def _is_master_json(answer: httpx.Response) -> bool:
    try:
        return "success" in answer.json()
    except ValueError:
        return False


def all_keys(admin_url: str, timeout_s: float = 30.0) -> list[str]:
    """Every key in the store (``/get_all_keys``: plain text, one key a line)."""
    answer = admin_get(admin_url, "/get_all_keys", timeout_s)
    return [line for line in answer.text.splitlines() if line]


def object_sizes(admin_url: str, keys: list[str], timeout_s: float = 10.0) -> dict[str, int | None]:
    """Stored size in bytes of each key's first replica (``/batch_query_keys``); None if it is gone."""
    sizes: dict[str, int | None] = {}
    for start in range(0, len(keys), BATCH_QUERY_KEYS):
        chunk = keys[start : start + BATCH_QUERY_KEYS]
        answer = admin_get(admin_url, "/batch_query_keys?keys=" + ",".join(chunk), timeout_s)
        try:
            data = answer.json().get("data") or {}
        except ValueError:
            raise ServerError(f"{admin_url}/batch_query_keys did not answer JSON") from None
        for key in chunk:
            entry = data.get(key) or {}
            replicas = entry.get("values") or []
            sizes[key] = replicas[0].get("size_") if entry.get("ok") and replicas else None
    return sizes


def metrics_text(admin_url: str, timeout_s: float = 10.0) -> str:
    """The master's Prometheus metrics page."""
    answer = admin_get(admin_url, "/metrics", timeout_s)
    if "master_key_count" not in answer.text:
        raise ServerError(f"{admin_url}/metrics has no master_key_count: it is not a Mooncake master's admin port")
    return answer.text
