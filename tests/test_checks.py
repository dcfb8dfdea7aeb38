"""System checks for DISTLOCKS and ImproperlyConfigured errors."""

from __future__ import annotations

import gc
import os
import socket
import subprocess
import sys
import textwrap
import time
import warnings

import pytest
from django.core.cache.backends.redis import RedisCache, RedisCacheClient
from django.core.exceptions import ImproperlyConfigured
from django.utils.module_loading import import_string

import distlocks
from distlocks.checks import check_distlocks, unanswered, unknown_settings
from distlocks.handler import BUILTIN_BACKENDS, locks
from localservers import REDIS_PORT

from .conftest import DB as DB_MARK

pytestmark = [DB_MARK, pytest.mark.servers("redis", "zookeeper")]

DB = "distlocks.backends.db.DatabaseBackend"
REDIS = "distlocks.backends.redis.RedisBackend"
ZK = "distlocks.backends.zookeeper.ZooKeeperBackend"


def ids(settings_value, settings):
    settings.DISTLOCKS = settings_value
    return [(message.id, message.msg) for message in check_distlocks()]


def test_the_test_settings_are_fine():
    assert checked_leaving_no_socket_open() == []


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
        (
            {"default": {"BACKEND": DB, "OPTIONS": {"CONNECT_TIMEOUT": 0}}},
            "distlocks.E002",
            "DISTLOCKS['default']: OPTIONS['CONNECT_TIMEOUT'] must be",
        ),
        ({"default": {"BACKEND": DB, "OPTIONS": {"DATABASE": "nope"}}}, "distlocks.E003", "uses database 'nope'"),
        *[
            (
                {"default": {"BACKEND": REDIS, "OPTIONS": {"CACHE": "redis", option: value}}},
                "distlocks.E002",
                f"DISTLOCKS['default']: OPTIONS[{option!r}] must be {says}",
            )
            for option, value, says in [
                ("WAIT_REPLICAS", -1, "0 or more, not -1"),
                ("WAIT_REPLICAS", 1.0, "an int (0 or more), not float"),
                ("WAIT_REPLICAS", "1", "an int (0 or more), not str"),
                ("WAIT_REPLICAS", True, "an int (0 or more), not bool"),
                ("WAIT_TIMEOUT", 0, "a finite number of seconds greater than 0, not 0"),
                ("WAIT_TIMEOUT", -0.05, "a finite number of seconds greater than 0, not -0.05"),
                ("WAIT_TIMEOUT", float("inf"), "a finite number of seconds greater than 0, not inf"),
                ("WAIT_TIMEOUT", "0.05", "a number of seconds, not str"),
            ]
        ],
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


@pytest.mark.parametrize(("option", "value"), [("WAIT_REPLICAS", -1), ("WAIT_REPLICAS", 0.5), ("WAIT_TIMEOUT", 0)])
def test_bad_replica_acknowledgement_options_raise_at_once_naming_the_option(settings, option, value):
    settings.DISTLOCKS = {"default": {"BACKEND": REDIS, "OPTIONS": {"CACHE": "redis", option: value}}}
    with pytest.raises(ImproperlyConfigured, match=f"^DISTLOCKS\\['default'\\]: OPTIONS\\[{option!r}\\] must be"):
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
    assert "1 of 3 Redis nodes do not answer, 2 are needed to lock (redis://127.0.0.1:1/0: " in (
        messages["DISTLOCKS['redlock']"].msg
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


REDLOCK = "distlocks.backends.redlock.RedlockBackend"
MYSQL = "distlocks.backends.mysql.MySQLLockBackend"
LOCMEM = "distlocks.backends.locmem.LocMemBackend"


@pytest.mark.parametrize(
    ("entry", "key", "guess"),
    [
        ({"BACKEND": DB, "TLL": 10}, "TLL", "TTL"),
        ({"BACKEND": DB, "KEY_PREFX": "shop"}, "KEY_PREFX", "KEY_PREFIX"),
        ({"BACKEND": DB, "ttl": 10}, "ttl", "TTL"),
        ({"BACKEND": LOCMEM, "OPTION": {}}, "OPTION", "OPTIONS"),
        ({"BACKEND": DB, "OPTIONS": {"DATABSE": "default"}}, "DATABSE", "DATABASE"),
        ({"BACKEND": MYSQL, "OPTIONS": {"DATABASE": "mariadb", "TIMEOT": 5}}, "TIMEOT", "TIMEOUT"),
        ({"BACKEND": REDIS, "OPTIONS": {"CACHE": "redis", "CAHCE": "redis"}}, "CAHCE", "CACHE"),
        ({"BACKEND": REDLOCK, "OPTIONS": {"CACHES": ["r1", "r2", "r3"], "QUORUM": 2}}, "QUORUM", None),
        (
            {"BACKEND": ZK, "LOCATION": "127.0.0.1:1", "OPTIONS": {"SESION_TIMEOUT": 4}},
            "SESION_TIMEOUT",
            "SESSION_TIMEOUT",
        ),
        ({"BACKEND": LOCMEM, "OPTIONS": {"STORE": "x"}}, "STORE", None),
    ],
)
def test_an_unknown_key_is_an_error_with_a_guess_and_no_ping(settings, entry, key, guess):
    settings.DISTLOCKS = {"shop": entry}
    [message] = check_distlocks()  # no W004: the ZooKeeper at 127.0.0.1:1 is not pinged
    where = "DISTLOCKS['shop']" + ("['OPTIONS']" if key in entry.get("OPTIONS", {}) else "")
    assert message.id == "distlocks.E010"
    assert message.msg.startswith(f"{where} has an unknown key {key!r}.")
    if guess:
        assert message.msg.endswith(f"Did you mean {guess!r}?")
    else:
        assert "Did you mean" not in message.msg
    if where.endswith("['OPTIONS']"):
        names = import_string(entry["BACKEND"]).option_names
        assert message.hint == f"The keys of {entry['BACKEND'].rsplit('.', 1)[1]}: {', '.join(names) or 'none'}" + (
            "." if names else " (it takes no OPTIONS)."
        )
    else:
        assert message.hint == "The keys: BACKEND, LOCATION, OPTIONS, TTL, KEY_PREFIX."


def test_a_misspelt_cache_leaves_redis_on_the_default_cache_which_is_reported_too(settings):
    settings.DISTLOCKS = {"shop": {"BACKEND": REDIS, "OPTIONS": {"CAHCE": "redis"}}}
    assert [message.id for message in check_distlocks()] == ["distlocks.E010", "distlocks.E012"]


@pytest.mark.parametrize(
    ("entry", "instead"),
    [
        (
            {"BACKEND": REDIS, "LOCATION": "redis://127.0.0.1:6379/0", "OPTIONS": {"CACHE": "redis"}},
            "OPTIONS['CACHE'] names the Redis cache",
        ),
        (
            {"BACKEND": REDLOCK, "LOCATION": "redis://h1/0", "OPTIONS": {"CACHES": ["r1", "r2", "r3"]}},
            "OPTIONS['CACHES'] lists the Redis caches",
        ),
        ({"BACKEND": DB, "LOCATION": "mariadb"}, "OPTIONS['DATABASE'] names the database"),
        (
            {"BACKEND": MYSQL, "LOCATION": "127.0.0.1", "OPTIONS": {"DATABASE": "mariadb"}},
            "OPTIONS['DATABASE'] names the database",
        ),
    ],
)
def test_location_on_a_backend_that_does_not_read_it_is_an_error_saying_what_to_use(settings, entry, instead):
    settings.DISTLOCKS = {"shop": entry}
    [message] = check_distlocks()
    assert message.id == "distlocks.E011"
    backend = entry["BACKEND"].rsplit(".", 1)[1]
    assert message.msg == f"DISTLOCKS['shop'] sets LOCATION, which {backend} does not read."
    assert message.hint.startswith(f"Remove it: {instead}")


def test_location_where_it_is_read_is_fine(settings):
    settings.DISTLOCKS = {"shop": {"BACKEND": LOCMEM, "LOCATION": "store"}}
    assert check_distlocks() == []
    assert unknown_settings("zk", {"BACKEND": ZK, "LOCATION": "127.0.0.1:1"}) == []


def test_every_built_in_backend_declares_its_options_and_is_named_when_a_backend_cannot_be_imported(settings):
    for path in BUILTIN_BACKENDS:
        assert import_string(path).option_names is not None, path
    assert LOCMEM in BUILTIN_BACKENDS
    [(check_id, text)] = ids({"default": {"BACKEND": "distlocks.backends.nope.Backend"}}, settings)
    assert check_id == "distlocks.E002"
    assert f"Built-in backends: {', '.join(BUILTIN_BACKENDS)}" in text


@pytest.mark.parametrize(
    ("cache", "backend"),
    [
        ({"BACKEND": "django.core.cache.backends.locmem.LocMemCache"}, REDIS),
        ({"BACKEND": "django.core.cache.backends.locmem.LocMemCache"}, REDLOCK),
    ],
)
def test_a_cache_that_is_not_a_redis_cache_is_an_error_naming_both_not_a_server_down(settings, cache, backend):
    settings.CACHES = {**settings.CACHES, "loc": cache}
    options = {"CACHE": "loc"} if backend == REDIS else {"CACHES": ["r1", "r2", "loc"]}
    settings.DISTLOCKS = {"shop": {"BACKEND": backend, "OPTIONS": options}}
    [message] = check_distlocks()  # no W004 "is it running at loc?", no W010 about socket timeouts
    alias = "shop" if backend == REDIS else "shop[loc]"
    assert message.id == "distlocks.E012"
    assert message.msg == (
        f"DISTLOCKS[{alias!r}]: cache 'loc' is not a Redis cache (neither django-redis's nor Django's own): "
        f"its BACKEND is {cache['BACKEND']!r}."
    )
    assert "django_redis.cache.RedisCache" in message.hint
    assert "django.core.cache.backends.redis.RedisCache" in message.hint
    with pytest.raises(ImproperlyConfigured, match="cache 'loc' is not a Redis cache"):
        distlocks.lock("x", using="shop").acquire(wait=0)


class ShardingClient(RedisCacheClient):
    """A cache client that picks a server by key: no one server holds the locks."""

    def get_client(self, key=None, *, write=False):
        return super().get_client(key, write=write)


class ShardedRedisCache(RedisCache):
    def __init__(self, server, params):
        super().__init__(server, params)
        self._class = ShardingClient


DJANGO_REDIS_CACHE = "django.core.cache.backends.redis.RedisCache"


def checked_leaving_no_socket_open():
    """``check_distlocks()``, asserting its pings left no socket open: each runs in a thread of its own, and
    Django makes a RedisCache, whose pool nothing closes, for each thread."""
    gc.collect()  # what earlier tests left
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", ResourceWarning)
        found = check_distlocks()
        gc.collect()
    assert [str(warning.message) for warning in caught if warning.category is ResourceWarning] == []
    return found


def test_djangos_own_redis_cache_is_accepted_by_redis_and_redlock(settings):
    location = f"redis://127.0.0.1:{REDIS_PORT}/0"
    timeouts = {"socket_connect_timeout": 1, "socket_timeout": 2}
    settings.CACHES = {
        **settings.CACHES,
        **{f"own{i}": {"BACKEND": DJANGO_REDIS_CACHE, "LOCATION": location, "OPTIONS": timeouts} for i in range(3)},
    }
    settings.DISTLOCKS = {
        "shop": {"BACKEND": REDIS, "OPTIONS": {"CACHE": "own0"}},
        "quorum": {"BACKEND": REDLOCK, "OPTIONS": {"CACHES": ["own0", "own1", "own2"]}},
    }
    assert checked_leaving_no_socket_open() == []
    with distlocks.lock("x", using="shop", wait=0) as lk:
        assert lk.token > 0


@pytest.mark.parametrize(
    ("cache", "says"),
    [
        (
            {"BACKEND": "tests.test_checks.ShardedRedisCache", "LOCATION": "redis://127.0.0.1:1/0"},
            "is ambiguous: its cache client ShardingClient chooses the server itself",
        ),
        ({"BACKEND": DJANGO_REDIS_CACHE, "LOCATION": ""}, "names no Redis server"),
        ({"BACKEND": DJANGO_REDIS_CACHE, "LOCATION": "redis://127.0.0.1:1/0;"}, "names no Redis server"),
    ],
)
def test_a_django_redis_cache_without_one_server_to_lock_on_is_an_error(settings, cache, says):
    settings.CACHES = {**settings.CACHES, "loc": cache}
    settings.DISTLOCKS = {"shop": {"BACKEND": REDIS, "OPTIONS": {"CACHE": "loc"}}}
    [message] = check_distlocks()  # no W004: not pinged
    assert message.id == "distlocks.E012"
    assert message.msg.startswith(f"DISTLOCKS['shop']: cache 'loc' {says}")
    with pytest.raises(ImproperlyConfigured, match=f"cache 'loc' {says}"):
        distlocks.lock("x", using="shop").acquire(wait=0)


def test_check_warns_when_a_django_redis_cache_has_no_socket_timeouts_naming_them_as_it_takes_them(settings):
    location = f"redis://127.0.0.1:{REDIS_PORT}/0"
    settings.CACHES = {
        **settings.CACHES,
        "untimed": {"BACKEND": DJANGO_REDIS_CACHE, "LOCATION": location},
        "timed": {"BACKEND": DJANGO_REDIS_CACHE, "LOCATION": location, "OPTIONS": {"socket_timeout": 5}},
    }
    settings.DISTLOCKS = {alias: {"BACKEND": REDIS, "OPTIONS": {"CACHE": alias}} for alias in ("untimed", "timed")}
    found = {message.msg.split(" ")[0]: message for message in checked_leaving_no_socket_open()}
    assert {alias: message.id for alias, message in found.items()} == {
        "DISTLOCKS['untimed']": "distlocks.W010",
        "DISTLOCKS['timed']": "distlocks.W010",
    }
    assert "set no socket_connect_timeout and no socket_timeout:" in found["DISTLOCKS['untimed']"].msg
    assert "set no socket_connect_timeout:" in found["DISTLOCKS['timed']"].msg
    assert found["DISTLOCKS['timed']"].hint.startswith(
        "Set OPTIONS['socket_connect_timeout'] and OPTIONS['socket_timeout'] (seconds"
    )


def test_djangos_redis_cache_without_redis_py_is_an_error_with_the_pip_command(settings, monkeypatch):
    monkeypatch.setitem(sys.modules, "redis", None)
    settings.DISTLOCKS = {"shop": {"BACKEND": REDIS, "OPTIONS": {"CACHE": "redis_django"}}}
    [message] = check_distlocks()
    assert (message.id, message.msg, message.hint) == (
        "distlocks.E005",
        "DISTLOCKS['shop'] needs redis-py.",
        "pip install 'distlocks[redis]'",
    )


def test_the_demo_and_bench_settings_use_only_known_keys():
    env = {
        **os.environ,
        "DISTLOCKS_REDIS_URL": "redis://127.0.0.1:1/0",
        "DISTLOCKS_REDLOCK_URLS": "redis://127.0.0.1:1/1,redis://127.0.0.1:1/2,redis://127.0.0.1:1/3",
        "DISTLOCKS_ZOOKEEPER": "127.0.0.1:1",
    }
    code = (
        "import django, sys; django.setup()\n"
        "from django.conf import settings; from distlocks.checks import unknown_settings\n"
        "for alias, entry in settings.DISTLOCKS.items():\n"
        "    print('checked', alias, file=sys.stderr)\n"
        "    for message in unknown_settings(alias, entry): print(message.msg)\n"
    )
    for settings_module, aliases in (
        ("demo_shop.settings", ["default", "redis", "redlock", "zookeeper"]),
        ("bench.settings", ["default", "mariadb", "postgresql", "mariadb_native", "postgresql_native"]),
    ):
        done = subprocess.run(
            [sys.executable, "-c", code],
            env={**env, "DJANGO_SETTINGS_MODULE": settings_module},
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        )
        assert (done.returncode, done.stdout) == (0, ""), done.stderr
        assert [line.split()[1] for line in done.stderr.splitlines() if line.startswith("checked ")] == aliases


@pytest.mark.parametrize(
    ("entry", "text"),
    [
        (
            {"BACKEND": LOCMEM, "TLL": 10},
            "DISTLOCKS['shop'] has an unknown key 'TLL'. Did you mean 'TTL'? The keys: BACKEND, LOCATION,",
        ),
        (
            {"BACKEND": DB, "OPTIONS": {"DATABSE": "mariadb"}},
            "DISTLOCKS['shop']['OPTIONS'] has an unknown key 'DATABSE'. Did you mean 'DATABASE'?",
        ),
        (
            {"BACKEND": REDIS, "LOCATION": "redis://127.0.0.1:6379/0", "OPTIONS": {"CACHE": "redis"}},
            "DISTLOCKS['shop'] sets LOCATION, which RedisBackend does not read. Remove it: OPTIONS['CACHE']",
        ),
    ],
)
def test_what_check_reports_as_an_unknown_key_raises_at_the_first_use_of_the_alias(settings, entry, text):
    # A server that gunicorn starts runs no check: it must not lock with the default ttl, database or cache.
    settings.DISTLOCKS = {**settings.DISTLOCKS, "shop": entry}
    with pytest.raises(ImproperlyConfigured) as info:
        distlocks.lock("x", using="shop")
    assert str(info.value).startswith(text)
    assert distlocks.lock("x", using="locmem").acquire(wait=0)  # the other aliases are fine
    distlocks.lock("x", using="locmem").release()


NO_APP_SETTINGS = """
    SECRET_KEY = "no-app"
    INSTALLED_APPS = ["django.contrib.contenttypes", "django.contrib.auth"]  # "distlocks" forgotten
    DATABASES = {"default": {"ENGINE": "django.db.backends.sqlite3", "NAME": ":memory:"}}
    ROOT_URLCONF = "no_app_urls"
    USE_TZ = True
    import os
    if os.environ.get("NO_APP_LOCMEM"):
        DISTLOCKS = {"default": {"BACKEND": "distlocks.backends.locmem.LocMemBackend"}}
"""
NO_APP_URLS = """
    from django.http import HttpResponse
    from django.urls import path

    from distlocks.decorators import distributed_lock


    @distributed_lock("stock:{item}")
    def buy(request, item):
        return HttpResponse("ok")


    urlpatterns = [path("buy/<item>/", buy)]
"""
# As a project does whose settings or Celery module import distlocks before the checks run.
IMPORTED_FIRST = """
import io
import distlocks, django
django.setup()
from django.core.management import call_command
check = lambda: call_command("check", stdout=io.StringIO(), stderr=io.StringIO())
for step in (check, lambda: distlocks.lock("x").acquire()):
    try:
        print("ok", step())
    except Exception as exc:
        print(type(exc).__name__, str(exc).replace("\\n", " "))
"""
FIX = 'add "distlocks" to INSTALLED_APPS'


def run_without_the_app(tmp_path, *args, **env):
    (tmp_path / "no_app_settings.py").write_text(textwrap.dedent(NO_APP_SETTINGS))
    (tmp_path / "no_app_urls.py").write_text(textwrap.dedent(NO_APP_URLS))
    return subprocess.run(
        [sys.executable, *args],
        env={
            **os.environ,
            **env,
            "DJANGO_SETTINGS_MODULE": "no_app_settings",
            "PYTHONPATH": os.pathsep.join([str(tmp_path), os.path.dirname(os.path.dirname(__file__))]),
        },
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


def test_check_fails_naming_the_fix_when_distlocks_is_not_installed(tmp_path):
    # The URLconf imports a view that takes a lock: the check of the URLs imports distlocks.
    done = run_without_the_app(tmp_path, "-m", "django", "check")
    assert done.returncode == 1
    last = done.stderr.strip().splitlines()[-1]
    assert last.startswith("django.core.exceptions.ImproperlyConfigured: Locks on 'default' (DatabaseBackend) are ")
    assert FIX in last
    assert "RuntimeError" not in done.stderr


def test_check_reports_and_the_first_lock_raises_when_distlocks_is_not_installed(tmp_path):
    done = run_without_the_app(tmp_path, "-c", IMPORTED_FIRST)
    assert done.returncode == 0, done.stderr
    check, first_lock = done.stdout.strip().split("\n", 1)
    assert check.startswith("SystemCheckError")
    assert "(distlocks.E013) Locks on 'default' (DatabaseBackend) are kept in the tables of the distlocks app" in check
    assert first_lock.startswith("ImproperlyConfigured Locks on 'default' (DatabaseBackend)")
    assert FIX in first_lock


def test_backends_without_tables_still_work_without_the_app(tmp_path):
    done = run_without_the_app(tmp_path, "-c", IMPORTED_FIRST, NO_APP_LOCMEM="1")
    assert (done.returncode, done.stdout.split()) == (0, ["ok", "None", "ok", "True"]), done.stderr
    assert run_without_the_app(tmp_path, "-m", "django", "check", NO_APP_LOCMEM="1").returncode == 0
