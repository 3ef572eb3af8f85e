"""kvtool's HTTP calls share a TLS context (one a thread): a call costs its request, not a CA bundle load.

``httpx.get`` builds a client, and with it an SSL context loaded with the CA bundle, on every call (about
25 ms of CPU here), even for ``http://``. The serve-pair supervisor's health checks (twice a second) and
every measured bench request paid it. Counted here by the bundle loads themselves, never by time.
"""

from __future__ import annotations

import ssl

import httpx
import pytest

from kvtool import web
from kvtool.procs import ReadinessCheck
from kvtool.store.admin import open_admin

from .fake_admin import fake_admin


@pytest.fixture
def bundle_loads(monkeypatch) -> list[int]:
    """Counts every CA bundle loaded into an SSL context from now on."""
    loads: list[int] = []
    load = ssl.SSLContext.load_verify_locations

    def counted(self, *args, **kwargs):
        loads.append(1)
        return load(self, *args, **kwargs)

    monkeypatch.setattr(ssl.SSLContext, "load_verify_locations", counted)
    return loads


def test_plain_httpx_loads_the_bundle_on_every_call(bundle_loads):
    """Why kvtool does not call httpx.get directly (and that the counter sees the loads)."""
    with fake_admin() as admin:
        for _ in range(2):
            assert httpx.get(admin.url + "/metrics", timeout=5.0).status_code == 200
    assert len(bundle_loads) >= 2


def test_health_checks_and_admin_calls_load_no_bundle_after_the_first(bundle_loads):
    web.tls_context()  # made once for the process (the first call anywhere pays it)
    bundle_loads.clear()
    with fake_admin() as admin:
        check = ReadinessCheck(http_url=admin.url + "/metrics")
        assert all(check.passes() for _ in range(5))
        assert open_admin(admin.url).key_count() == 3
        assert web.post(admin.url + "/metrics", timeout=5.0).status_code in (404, 405, 501)
        with web.stream("GET", admin.url + "/metrics", timeout=5.0) as response:
            assert response.status_code == 200
    assert bundle_loads == []


def test_one_context_serves_every_call_of_a_thread_and_each_thread_has_its_own():
    import threading

    assert web.tls_context() is web.tls_context()
    assert isinstance(web.tls_context(), ssl.SSLContext)
    other: list[ssl.SSLContext] = []
    thread = threading.Thread(target=lambda: other.extend([web.tls_context(), web.tls_context()]))
    thread.start()
    thread.join()
    assert other[0] is other[1] and other[0] is not web.tls_context()
