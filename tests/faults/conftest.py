from __future__ import annotations

import contextlib
import os
import signal

import pytest

from tests.servers import RedisServer, answers


@pytest.fixture
def own_redis(settings):
    """Return ``start(port, **options)``: a Redis of the test's own as lock alias "own".

    ``options`` are the django-redis cache's OPTIONS. The server may be frozen
    (``frozen(server)``), restarted or killed without disturbing other tests.
    """
    servers = []

    def start(port, **options):
        assert not answers(port), f"port {port} is taken"
        servers.append(RedisServer(port).start())
        settings.CACHES = {
            **settings.CACHES,
            "own": {
                "BACKEND": "django_redis.cache.RedisCache",
                "LOCATION": f"redis://127.0.0.1:{port}/0",
                "OPTIONS": options,
            },
        }
        settings.DISTLOCKS = {
            **settings.DISTLOCKS,
            "own": {"BACKEND": "distlocks.backends.redis.RedisBackend", "OPTIONS": {"CACHE": "own"}},
        }
        return servers[-1]

    yield start
    for server in servers:
        with contextlib.suppress(ProcessLookupError):
            os.kill(server.process.pid, signal.SIGCONT)
        server.stop()


@contextlib.contextmanager
def frozen(server):
    """SIGSTOP ``server`` while the block runs: it accepts connections (the kernel does) but answers nothing."""
    os.kill(server.process.pid, signal.SIGSTOP)
    try:
        yield
    finally:
        os.kill(server.process.pid, signal.SIGCONT)
