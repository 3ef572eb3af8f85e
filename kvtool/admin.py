"""The Mooncake master's admin HTTP endpoints (its metrics port).

The master does not URL-decode query strings, so keys go into URLs raw; kvtool's keys use only
``[a-z0-9/]``, which need no escaping.
"""

from __future__ import annotations

import time

import httpx

from kvtool.errors import ServerError


def key_exists(admin_url: str, key: str, timeout_s: float = 5.0) -> bool:
    url = f"{admin_url.rstrip('/')}/query_key?key={key}"
    try:
        answer = httpx.get(url, timeout=timeout_s)
    except httpx.HTTPError as exc:
        raise ServerError(f"the Mooncake master admin at {admin_url} did not answer: {exc}") from None
    return answer.status_code == 200 and bool(answer.json().get("success"))


def wait_for_key(admin_url: str, key: str, timeout_s: float = 60.0, poll_s: float = 0.05) -> bool:
    """Wait until ``key`` is in the store; False if it is not there after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while True:
        if key_exists(admin_url, key):
            return True
        if time.monotonic() >= deadline:
            return False
        time.sleep(poll_s)
