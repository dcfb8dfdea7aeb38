"""Servers that answer with an error, or speak another protocol: BackendUnavailable naming what they said.

Each misconfiguration is real (a wrong password, a DB index out of range, an
HTTP server where Redis should be); the driver's error is chained, and no
password is shown.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import threading
from io import StringIO

import pytest
import redis
from django.core.management import call_command

import distlocks
from distlocks.checks import check_distlocks
from localservers import REDIS_PORT
from tests.conftest import DB

pytestmark = [DB, pytest.mark.servers("redis")]

REDIS = "distlocks.backends.redis.RedisBackend"
PASSWORD = "hunter2-s3cret"
WRONG_PASSWORD = "not-hunter2-either"


@pytest.fixture
def http_port():
    """A loopback port that answers every request with an HTTP 400, as a web server would."""
    listener = socket.create_server(("127.0.0.1", 0))

    def serve(client):
        with contextlib.suppress(OSError), client:
            while client.recv(4096):
                client.sendall(b"HTTP/1.1 400 Bad Request\r\nContent-Length: 0\r\n\r\n")

    def accept():
        with contextlib.suppress(OSError):
            while True:
                threading.Thread(target=serve, args=(listener.accept()[0],), daemon=True).start()

    threading.Thread(target=accept, daemon=True).start()
    yield listener.getsockname()[1]
    listener.close()


def redis_at(settings, location):
    """Make "bad" a Redis lock alias on a cache at ``location`` (alone: the checks ping it only)."""
    settings.CACHES = {
        **settings.CACHES,
        "bad": {
            "BACKEND": "django_redis.cache.RedisCache",
            "LOCATION": location,
            "OPTIONS": {"SOCKET_CONNECT_TIMEOUT": 1, "SOCKET_TIMEOUT": 2},
        },
    }
    settings.DISTLOCKS = {"bad": {"BACKEND": REDIS, "OPTIONS": {"CACHE": "bad"}}}


@pytest.fixture(params=["db_index", "wrong_password", "no_password", "http"])
def misconfigured_redis(request, settings, own_redis):
    """A Redis lock alias "bad" that cannot be used; returns what its errors must say."""
    if request.param == "db_index":
        redis_at(settings, f"redis://127.0.0.1:{REDIS_PORT}/99")
        return "DB index is out of range"
    if request.param == "http":
        port = request.getfixturevalue("http_port")
        redis_at(settings, f"redis://:{PASSWORD}@127.0.0.1:{port}/0")
        return "Protocol Error: b'HTTP/1.1 400 Bad Request'"
    own_redis(REDIS_PORT + 96, "--requirepass", PASSWORD)
    if request.param == "wrong_password":
        redis_at(settings, f"redis://:{WRONG_PASSWORD}@127.0.0.1:{REDIS_PORT + 96}/0")
        return "invalid username-password pair"
    redis_at(settings, f"redis://127.0.0.1:{REDIS_PORT + 96}/0")
    return "authenticated"


def assert_names_the_cause(error, said):
    assert isinstance(error, distlocks.BackendUnavailable)
    assert error.alias == "bad"
    assert isinstance(error.__cause__, redis.RedisError)
    assert said in str(error)
    assert "Redis of cache 'bad' (redis://" in str(error)
    assert PASSWORD not in str(error)
    assert WRONG_PASSWORD not in str(error)


def test_a_redis_that_refuses_or_speaks_another_protocol_raises_backend_unavailable(misconfigured_redis):
    lk = distlocks.lock("x", using="bad")
    with pytest.raises(distlocks.LockError) as info:
        lk.acquire(wait=0)
    assert_names_the_cause(info.value, misconfigured_redis)
    assert lk.hold_count == 0


def test_an_async_lock_on_it_raises_backend_unavailable(misconfigured_redis):
    async def acquire():
        await distlocks.alock("x", using="bad").acquire(wait=0)

    with pytest.raises(distlocks.LockError) as info:
        asyncio.run(acquire())
    assert_names_the_cause(info.value, misconfigured_redis)


def test_distlocks_list_names_the_cause(misconfigured_redis):
    err = StringIO()
    with pytest.raises(Exception, match="could not list the locks of: bad"):
        call_command("distlocks_list", stdout=StringIO(), stderr=err)
    assert misconfigured_redis in err.getvalue()
    assert PASSWORD not in err.getvalue()


def test_check_names_what_the_server_said_without_a_thread_traceback(misconfigured_redis, capfd):
    out, err = StringIO(), StringIO()
    call_command("check", tags=["distlocks"], stdout=out, stderr=err)
    printed = out.getvalue() + err.getvalue()
    assert "distlocks.W004" in printed
    assert misconfigured_redis in printed
    assert "no answer within" not in printed
    assert PASSWORD not in printed
    assert WRONG_PASSWORD not in printed
    captured = capfd.readouterr()
    assert "Exception in thread" not in captured.err
    assert "Traceback" not in captured.err


def test_redlock_names_what_each_node_said_and_chains_it(settings):
    settings.CACHES = {
        **settings.CACHES,
        **{
            f"{cache}_db99": {**settings.CACHES[cache], "LOCATION": settings.CACHES[cache]["LOCATION"][:-1] + "99"}
            for cache in ("r2", "r3")
        },
    }
    settings.DISTLOCKS = {
        "bad": {
            "BACKEND": "distlocks.backends.redlock.RedlockBackend",
            "OPTIONS": {"CACHES": ["r1", "r2_db99", "r3_db99"]},
        }
    }
    with pytest.raises(distlocks.BackendUnavailable) as info:
        distlocks.lock("x", using="bad").acquire(wait=0)
    assert "only 1 of 3 Redis nodes answer, 2 are needed" in str(info.value)
    assert str(info.value).count("/99: DB index is out of range") == 2
    assert isinstance(info.value.__cause__.__cause__, redis.ResponseError)
    [warning] = check_distlocks()
    assert warning.id == "distlocks.W004"
    assert "2 of 3 Redis nodes do not answer" in warning.msg
    assert "DB index is out of range" in warning.msg
