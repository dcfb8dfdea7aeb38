"""The testing kit for users: override_distlocks, expire_lock and the pytest plugin, used as a user would."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest
from django.core.signals import setting_changed
from django.test import SimpleTestCase, override_settings

import distlocks
from distlocks.apps import _reset_locks
from distlocks.backends.locmem import LocMemBackend
from distlocks.backends.redis import RedisBackend
from distlocks.handler import locks
from distlocks.signals import lock_lost
from distlocks.testing import expire_lock, override_distlocks
from tests.conftest import Holder

pytestmark = pytest.mark.servers("redis", "zookeeper")

pytest_plugins = ["pytester"]

LOCMEM = "distlocks.backends.locmem.LocMemBackend"


@pytest.fixture
def told(name):
    """The lock_lost signals received for this test's lock, as (name, alias, token).

    Locks that earlier tests left held on the same aliases are renewed on the
    in-memory backend during an override, and lost: they are not this test's.
    """
    received = []

    def on_lost(sender, alias, token, **kwargs):
        if kwargs["name"] == name:
            received.append((kwargs["name"], alias, token))

    lock_lost.connect(on_lost)
    yield received
    lock_lost.disconnect(on_lost)


# -- override_distlocks ----------------------------------------------------------


def test_with_no_argument_every_alias_is_in_memory_and_keeps_its_ttl_and_prefix(settings):
    settings.DISTLOCKS = {
        "redis": {"BACKEND": "distlocks.backends.redis.RedisBackend", "OPTIONS": {"CACHE": "redis_down"}},
        "zookeeper": {"BACKEND": "distlocks.backends.zookeeper.ZooKeeperBackend", "LOCATION": "127.0.0.1:1"},
        "short": {"BACKEND": "distlocks.backends.db.DatabaseBackend", "TTL": 3, "KEY_PREFIX": "shop"},
    }
    assert isinstance(locks["redis"], RedisBackend)
    with override_distlocks() as setting:
        assert set(setting) == {"default", "redis", "zookeeper", "short"}
        assert all(isinstance(locks[alias], LocMemBackend) for alias in setting)
        assert (locks["short"].default_ttl, locks["short"].key_prefix) == (3.0, "shop")
        # Nothing listens on redis_down or on port 1: the lock works without a server.
        with distlocks.lock("stock:1", using="redis", wait=0) as lk:
            assert lk.token == 1
        with distlocks.lock("stock:1", using="short") as lk:
            assert locks["short"].holder("shop:stock:1").token == lk.token
    assert isinstance(locks["redis"], RedisBackend)


def test_each_entry_starts_empty(name):
    with override_distlocks():
        lk = distlocks.lock(name, renew=False)
        lk.acquire()  # left held on purpose
        assert lk.token == 1
    with override_distlocks():
        assert Holder(name).release() is None  # another thread takes it at once


def test_a_lock_left_held_is_lost_on_exit_before_the_settings_come_back(settings, name, told):
    settings.DISTLOCKS = {"default": {"BACKEND": "distlocks.backends.db.DatabaseBackend", "KEY_PREFIX": "shop"}}
    with override_distlocks():
        lk = distlocks.lock(name, ttl=30)
        lk.acquire()
        token = lk.token
    assert told == [(name, "default", token)]  # told on exit, its renewals never reach the database
    assert lk.lost
    with pytest.raises(distlocks.LockLost):
        lk.release()


def test_a_lock_left_by_a_thread_that_ended_does_not_hold_up_the_exit(name):
    with override_distlocks():
        ended = threading.Thread(target=lambda: distlocks.lock(name).acquire())
        ended.start()
        ended.join()
        started = time.monotonic()
    assert time.monotonic() - started < 1


def test_a_lock_held_when_the_override_begins_is_renewed_in_memory_and_lost(name, told):
    lk = distlocks.lock(name, using="redis", ttl=0.6)  # on the tests' real Redis
    lk.acquire()
    with override_distlocks():
        deadline = time.monotonic() + 5
        while not lk.lost:  # its next renewal (a third of its ttl) asks the in-memory backend
            assert time.monotonic() < deadline
            time.sleep(0.02)
    with pytest.raises(distlocks.LockLost):
        lk.release()


def test_a_dict_becomes_the_setting_even_without_the_apps_receiver(name):
    # Projects that do not put distlocks in INSTALLED_APPS have no setting_changed receiver.
    setting_changed.disconnect(dispatch_uid="distlocks.reset_locks")
    try:
        assert not isinstance(locks["default"], LocMemBackend)
        with override_distlocks({"default": {"BACKEND": LOCMEM, "TTL": 7}}) as setting:
            assert setting == {"default": {"BACKEND": LOCMEM, "TTL": 7}}
            assert isinstance(locks["default"], LocMemBackend)
            assert locks["default"].default_ttl == 7
        assert not isinstance(locks["default"], LocMemBackend)
    finally:
        setting_changed.connect(_reset_locks, dispatch_uid="distlocks.reset_locks")


@override_distlocks()
def test_as_a_function_decorator():
    assert isinstance(locks["redis"], LocMemBackend)


def test_the_override_is_gone_after_a_decorated_function():
    assert isinstance(locks["redis"], RedisBackend)


@override_distlocks()
class OverriddenTestCase(SimpleTestCase):
    def test_as_a_class_decorator(self):
        assert isinstance(locks["redis"], LocMemBackend)
        with distlocks.lock("report", using="redis") as lk:
            assert lk.token == 1  # a fresh store for each test method


def test_bad_argument():
    with pytest.raises(ValueError, match="distlocks must be a DISTLOCKS dict of aliases or None, not list"):
        override_distlocks([])


# -- expire_lock -----------------------------------------------------------------


@override_distlocks()
def test_expire_lock_returns_once_the_holder_was_told(name, told):
    slow_receiver_done = []

    def slow_receiver(sender, **kwargs):
        time.sleep(0.3)
        slow_receiver_done.append(True)

    lock_lost.connect(slow_receiver)
    try:
        lk = distlocks.lock(name, ttl=30)
        lk.acquire()
        token = lk.token
        started = time.monotonic()
        expire_lock(lk)
        assert slow_receiver_done == [True]  # every receiver has run: no sleeping in the test
        assert told == [(name, "default", token)]
        assert lk.lost
        assert time.monotonic() - started < 5
    finally:
        lock_lost.disconnect(slow_receiver)
    # The lease is over: another thread takes the lock, with a larger token.
    other = Holder(name)
    assert other.token > token
    with pytest.raises(distlocks.LockLost):
        lk.release()
    assert told == [(name, "default", token)]  # told once
    assert other.release() is None


@override_distlocks()
def test_expire_lock_of_a_lock_held_by_another_thread_by_name(name, told):
    holder = Holder(name, "redis")
    expire_lock(name, using="redis")
    assert told == [(name, "redis", holder.token)]
    assert isinstance(holder.release(), distlocks.LockLost)


@override_distlocks()
def test_expire_lock_of_a_hold_that_is_not_renewed_is_found_at_release(name, told):
    lk = distlocks.lock(name, renew=False)
    lk.acquire()
    expire_lock(lk)  # nobody renews it: nobody to wait for
    assert told == []
    with pytest.raises(distlocks.LockLost):
        lk.release()
    deadline = time.monotonic() + 5
    while not told:  # sent by the watchdog's notifier thread
        assert time.monotonic() < deadline
        time.sleep(0.01)
    assert told == [(name, "default", 1)]


@override_distlocks()
def test_expire_lock_refuses_a_lock_that_is_not_held(name):
    with pytest.raises(ValueError, match=f"Lock '{name}' on 'default' is not held"):
        expire_lock(distlocks.lock(name))
    with pytest.raises(ValueError, match="lock must be a DistributedLock or a lock name"):
        expire_lock("")


def test_expire_lock_refuses_other_backends(name):
    redis_only = {"redis": {"BACKEND": "distlocks.backends.redis.RedisBackend"}}
    refused = "expire_lock works on LocMem aliases, and 'redis' is a RedisBackend"
    with override_settings(DISTLOCKS=redis_only), pytest.raises(ValueError, match=refused):
        expire_lock(name, using="redis")


# -- the pytest plugin, in a user's project ---------------------------------------

GUIDE = Path(__file__).resolve().parent.parent / "docs" / "guides" / "testing.md"


def guide_example(title):
    """The Python block of the testing guide that starts with the line ``# <title>``."""
    text = GUIDE.read_text()
    start = text.index(f"# {title}\n")
    return text[start : text.index("```", start)]


USER_SETTINGS = """
SECRET_KEY = "not secret"
INSTALLED_APPS = ["django.contrib.contenttypes", "django.contrib.auth", "distlocks"]
DATABASES = {"default": {"ENGINE": "django.db.backends.sqlite3", "NAME": ":memory:"}}
USE_TZ = True
# A Redis that is not there: the tests must not need it.
CACHES = {"default": {"BACKEND": "django_redis.cache.RedisCache", "LOCATION": "redis://127.0.0.1:1/0"}}
DISTLOCKS = {
    "default": {"BACKEND": "distlocks.backends.db.DatabaseBackend"},
    "redis": {"BACKEND": "distlocks.backends.redis.RedisBackend", "OPTIONS": {"CACHE": "default"}},
}
"""


MORE_USER_TESTS = """

def test_the_lock_is_on_a_fresh_locmem_alias(distlocks_backend):
    from distlocks.backends.locmem import LocMemBackend
    from distlocks.handler import locks

    assert distlocks_backend == "default"
    assert isinstance(locks["redis"], LocMemBackend)
    assert list(locks["redis"].held()) == []
    with distlocks.lock("import", using="redis") as lk:
        assert lk.token == 1
"""


@pytest.fixture
def user_project(pytester, monkeypatch):
    """A small Django project whose tests use the plugin, installed through its entry point only."""
    monkeypatch.delenv("DJANGO_SETTINGS_MODULE", raising=False)
    pytester.makepyfile(usersettings=USER_SETTINGS)
    tests = pytester.mkpydir("shop") / "tests"
    tests.mkdir()
    (tests / "__init__.py").write_text("")
    (pytester.path / "shop" / "imports.py").write_text(guide_example("shop/imports.py"))
    (tests / "test_imports.py").write_text(guide_example("shop/tests/test_imports.py") + MORE_USER_TESTS)
    return pytester


def test_the_plugin_in_a_users_project(user_project):
    result = user_project.runpytest_subprocess("-p", "no:cacheprovider", "--ds=usersettings", "-v")
    result.assert_outcomes(passed=3)
    result.stdout.fnmatch_lines(["*test_a_lost_lock_stops_the_import PASSED*"])


def test_without_the_plugin_its_fixtures_are_missing(user_project):
    # The fixtures come from the entry point and from nothing else.
    result = user_project.runpytest_subprocess("-p", "no:cacheprovider", "-p", "no:distlocks", "--ds=usersettings")
    result.stdout.fnmatch_lines(["*fixture 'distlocks_backend' not found*"])
    assert result.ret != 0


def test_the_plugin_stays_out_of_a_project_without_django(pytester, monkeypatch):
    monkeypatch.delenv("DJANGO_SETTINGS_MODULE", raising=False)
    pytester.makepyfile(
        """
        def test_plain(request):
            from django.conf import settings

            assert request.config.pluginmanager.has_plugin("distlocks")
            assert not settings.configured
        """
    )
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider", "-p", "no:django")
    result.assert_outcomes(passed=1)


def test_threads_of_a_test_see_the_same_locmem_alias(distlocks_backend, name):
    # This project's own tests load the plugin too.
    holder = Holder(name, distlocks_backend)
    assert distlocks.lock(name, using=distlocks_backend).acquire(wait=0) is False
    assert holder.release() is None
