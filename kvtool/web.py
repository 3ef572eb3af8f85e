"""HTTP calls that do not build a TLS context each time.

``httpx.get``, ``httpx.post`` and ``httpx.stream`` make a client per call, and every client loads the CA
bundle into a new SSL context, even for an ``http://`` URL: about 25 ms of CPU on a 2-core machine. The
supervisor of ``serve-pair`` checks the master's health twice a second, so it spent about 5% of a core
on it, in 25 ms bursts that landed inside the engines' prefills on the same host; a ``kvtool bench``
request paid it inside the time to first token it measured. Every HTTP call kvtool makes goes through
these, which share a context per thread (made on first use, verification as httpx's default), so a call costs
its connection and request only (about 1 ms). Each call still opens its own connection: a health check
made from inside a network namespace (``tests/netns.py``) never reuses one made outside it.
"""

from __future__ import annotations

import ssl
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import httpx


_contexts = threading.local()


def tls_context() -> ssl.SSLContext:
    """This thread's SSL context (httpx's default verification), made on its first call. One per
    thread, not one per process: an https connection sets options on the context it is made from,
    which two threads must not do to one context at once (the supervisor's thread and a bench's)."""
    context = getattr(_contexts, "context", None)
    if context is None:
        context = _contexts.context = httpx.create_ssl_context()
    return context


def get(url: str, **kwargs: Any) -> httpx.Response:
    return httpx.get(url, verify=tls_context(), **kwargs)


def post(url: str, **kwargs: Any) -> httpx.Response:
    return httpx.post(url, verify=tls_context(), **kwargs)


@contextmanager
def stream(method: str, url: str, **kwargs: Any) -> Iterator[httpx.Response]:
    with httpx.stream(method, url, verify=tls_context(), **kwargs) as response:
        yield response
