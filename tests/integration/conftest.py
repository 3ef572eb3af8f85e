"""A real mooncake_master on loopback, one per test module, and store clients against it."""

from __future__ import annotations

import os

import pytest

from tests.master import LOOPBACK, Master


@pytest.fixture(scope="module")
def master(tmp_path_factory):
    os.environ.setdefault("MC_TCP_BIND_ADDRESS", LOOPBACK)
    instance = Master(tmp_path_factory.mktemp("master") / "master.log")
    instance.start()
    yield instance
    instance.stop()


@pytest.fixture
def store_config(master):
    from connector.config import load_config

    return load_config(
        {
            "master_server_address": master.address,
            "global_segment_size": 64 << 20,
            "local_buffer_size": 32 << 20,
        }
    )


@pytest.fixture
def store(store_config):
    from connector.store.store import open_store

    client = open_store(store_config)
    yield client
    client.close()
