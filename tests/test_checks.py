"""System checks for DISTLOCKS and ImproperlyConfigured errors."""

from __future__ import annotations

import socket
import sys
import time

import pytest
from django.core.exceptions import ImproperlyConfigured

import distlocks
from distlocks.checks import check_distlocks, unanswered
from distlocks.handler import locks

from .conftest import DB as DB_MARK

pytestmark = [DB_MARK, pytest.mark.servers("redis", "zookeeper")]

DB = "distlocks.backends.db.DatabaseBackend"
REDIS = "distlocks.backends.redis.RedisBackend"
ZK = "distlocks.backends.zookeeper.ZooKeeperBackend"


def ids(settings_value, settings):
    settings.DISTLOCKS = settings_value
    return [(message.id, message.msg) for message in check_distlocks()]


def test_the_test_settings_are_fine():
    assert check_distlocks() == []


def test_no_setting_means_the_database_on_default(settings):
    del settings.DISTLOCKS
    assert check_distlocks() == []
    assert distlocks.lock("x").alias == "default"


@pytest.mark.parametrize(
    ("value", "check_id", "text"),
    [
        ([], "distlocks.E001", "DISTLOCKS must be a dict"),
        ({"default": "db"}, "distlocks.E002", "DISTLOCKS['default'] must be a dict"),
        ({"default": {}}, "distlocks.E002", "DISTLOCKS['default'] has no 'BACKEND'"),
        ({"default": {"BACKEND": "distlocks.backends.nope.Backend"}}, "distlocks.E002", "cannot import BACKEND"),
        ({"default": {"BACKEND": DB, "TTL": 0}}, "distlocks.E002", "DISTLOCKS['default']: TTL must be"),
        ({"default": {"BACKEND": DB, "OPTIONS": []}}, "distlocks.E002", "['OPTIONS'] must be a dict"),
        ({"default": {"BACKEND": DB, "OPTIONS": {"DATABASE": "nope"}}}, "distlocks.E003", "uses database 'nope'"),
    ],
)
def test_bad_settings_are_reported(settings, value, check_id, text):
    messages = ids(value, settings)
    assert len(messages) == 1
    assert messages[0][0] == check_id
    assert text in messages[0][1]


@pytest.mark.parametrize(
    "value",
    [
        {"default": {"BACKEND": "distlocks.backends.nope.Backend"}},
        {"default": {"BACKEND": DB, "TTL": -1}},
    ],
)
def test_bad_settings_raise_improperly_configured_on_use(settings, value):
    settings.DISTLOCKS = value
    with pytest.raises(ImproperlyConfigured, match="DISTLOCKS\\['default'\\]"):
        distlocks.lock("x")


def test_unknown_database_raises_on_use(settings):
    settings.DISTLOCKS = {"default": {"BACKEND": DB, "OPTIONS": {"DATABASE": "nope"}}}
    with pytest.raises(ImproperlyConfigured, match="names 'nope', which is not in DATABASES"):
        distlocks.lock("x").acquire()


def test_servers_that_do_not_answer_are_warned_about_with_their_address(settings):
    settings.DISTLOCKS = {
        "mariadb": {"BACKEND": DB, "OPTIONS": {"DATABASE": "mariadb_down", "CONNECT_TIMEOUT": 1}},
        "postgresql": {"BACKEND": DB, "OPTIONS": {"DATABASE": "postgresql_down", "CONNECT_TIMEOUT": 1}},
        "redis": {"BACKEND": REDIS, "OPTIONS": {"CACHE": "redis_down"}},
        "zookeeper": {"BACKEND": ZK, "LOCATION": "127.0.0.1:1", "OPTIONS": {"CONNECT_TIMEOUT": 1}},
        "redlock": {
            "BACKEND": "distlocks.backends.redlock.RedlockBackend",
            "OPTIONS": {"CACHES": ["r1", "r2", "redis_down"]},
        },
        "fine": {"BACKEND": REDIS, "OPTIONS": {"CACHE": "redis"}},
    }
    started = time.monotonic()
    messages = {message.msg.split(":")[0]: message for message in check_distlocks()}
    assert time.monotonic() - started < 10
    assert set(messages) == {
        f"DISTLOCKS[{alias!r}]" for alias in ("mariadb", "postgresql", "redis", "zookeeper", "redlock")
    }
    assert all(message.id == "distlocks.W004" for message in messages.values())
    assert "127.0.0.1:1 nowhere" in messages["DISTLOCKS['mariadb']"].hint
    assert "redis://127.0.0.1:1/0" in messages["DISTLOCKS['redis']"].hint
    assert "is unavailable" in messages["DISTLOCKS['redis']"].msg
    assert "Is it running at 127.0.0.1:1?" in messages["DISTLOCKS['zookeeper']"].hint
    assert (
        "1 of 3 Redis nodes do not answer (redis://127.0.0.1:1/0); 2 are needed" in messages["DISTLOCKS['redlock']"].msg
    )


def test_a_server_that_accepts_but_never_answers_is_warned_about_in_bounded_time(settings):
    silent = socket.create_server(("127.0.0.1", 0))  # listens, never answers
    port = silent.getsockname()[1]
    settings.CACHES = {
        **settings.CACHES,
        "silent": {"BACKEND": "django_redis.cache.RedisCache", "LOCATION": f"redis://127.0.0.1:{port}/0"},
    }
    settings.DISTLOCKS = {"silent": {"BACKEND": REDIS, "OPTIONS": {"CACHE": "silent"}}}
    started = time.monotonic()
    try:
        [message] = unanswered([locks["silent"]], seconds=0.5)
    finally:
        silent.close()
    assert time.monotonic() - started < 2
    assert message.id == "distlocks.W004"
    assert "no answer within 0.5 s" in message.msg


@pytest.mark.parametrize(
    ("module", "value", "check_id", "hint"),
    [
        (
            "django_redis",
            {"default": {"BACKEND": REDIS, "OPTIONS": {"CACHE": "redis"}}},
            "distlocks.E005",
            "distlocks[redis]",
        ),
        ("kazoo", {"default": {"BACKEND": ZK, "LOCATION": "127.0.0.1:1"}}, "distlocks.E006", "distlocks[zookeeper]"),
    ],
)
def test_a_missing_package_is_an_error_with_the_pip_command(settings, monkeypatch, module, value, check_id, hint):
    monkeypatch.setitem(sys.modules, module, None)  # what an interpreter without the package does on import
    settings.DISTLOCKS = value
    [message] = check_distlocks()
    assert message.id == check_id
    assert f"pip install '{hint}'" == message.hint
