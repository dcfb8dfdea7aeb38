"""manage.py distlocks_list and manage.py distlocks_release, against every backend."""

from __future__ import annotations

import json
import subprocess
import sys
from io import StringIO

import pytest
from django.core.management import CommandError, call_command
from django.test import override_settings

import distlocks
from distlocks.handler import locks

from .conftest import DB, PROCESS_ALIASES, ROOT, worker_env

pytestmark = [DB, pytest.mark.servers("redis", "zookeeper")]


def run(command, *args):
    out = StringIO()
    call_command(command, *args, stdout=out, stderr=StringIO())
    return out.getvalue()


def listed(alias):
    return {row["key"]: row for row in json.loads(run("distlocks_list", "--using", alias, "--json"))}


@pytest.mark.parametrize("alias", PROCESS_ALIASES, indirect=True)
def test_list_then_release_a_lock_held_by_another_process(alias, name, workers):
    holder = workers("hold", alias, name, 30)
    assert holder.line()[0] == "acquired"
    key = locks[alias].make_key(name)

    row = listed(alias)[key]
    assert row["alias"] == alias
    assert f":{holder.process.pid}:" in row["owner"]
    assert row["hold_count"] == 1
    assert row["token"] > 0
    if alias == "zookeeper":  # a session, not a lease
        assert row["lease_left"] is None
        assert row["waiters"] == 0
    else:
        assert 0 < row["lease_left"] <= 30
    assert key in run("distlocks_list", "--using", alias)

    assert run("distlocks_release", key, "--using", alias, "--yes") == f"{alias}: released {key!r}\n"
    assert key not in listed(alias)
    taker = workers("take", alias, name, 0)
    assert taker.finish()[:1] == ["acquired"]
    with pytest.raises(CommandError, match=f"{alias}: '{key}' is not held"):
        run("distlocks_release", key, "--using", alias, "--yes")


def test_list_table_when_nothing_is_held():
    assert run("distlocks_list", "--using", "postgresql") == "No locks are held.\n"


@pytest.mark.parametrize(
    ("cache", "reason"),
    [
        ("redis_down", "is unavailable"),
        # The test settings' "default" cache is a LocMemCache: no Redis to ask.
        ("default", "cache 'default' is not a Redis cache"),
    ],
)
def test_a_backend_that_is_down_is_reported_and_the_others_still_listed(name, settings, workers, cache, reason):
    holder = workers("hold", "redis", name, 30)
    holder.line()
    distlocks_setting = {
        **settings.DISTLOCKS,
        "down": {"BACKEND": "distlocks.backends.redis.RedisBackend", "OPTIONS": {"CACHE": cache}},
    }
    with override_settings(DISTLOCKS=distlocks_setting):
        out, err = StringIO(), StringIO()
        with pytest.raises(CommandError, match="could not list the locks of: down"):
            call_command("distlocks_list", "--using", "down", "--using", "redis", stdout=out, stderr=err)
    assert name in out.getvalue()
    assert err.getvalue().startswith("down: cannot list locks: ")
    assert reason in err.getvalue()


def test_unknown_alias():
    with pytest.raises(CommandError, match="DISTLOCKS has no alias 'nope'"):
        run("distlocks_list", "--using", "nope")
    with pytest.raises(CommandError, match="DISTLOCKS has no alias 'nope'"):
        run("distlocks_release", "x", "--using", "nope", "--yes")


@pytest.mark.parametrize(("answer", "released"), [("n\n", False), ("", False), ("y\n", True)])
def test_release_asks_first(answer, released, name, workers):
    holder = workers("hold", "redis", name, 30)
    holder.line()
    command = [sys.executable, "manage.py", "distlocks_release", name, "--using", "redis", "--skip-checks"]
    done = subprocess.run(command, cwd=ROOT, env=worker_env(), input=answer, capture_output=True, text=True, timeout=60)
    assert f"Force-release {name!r} on 'redis' (held by " in done.stdout
    assert "Its holder loses it. [y/N]" in done.stdout
    assert (name in listed("redis")) is not released
    assert done.returncode == (0 if released else 1), done.stderr
    if not released:
        assert "Not released." in done.stderr


@pytest.fixture
def shop_prefix(settings):
    """The redis and default aliases with KEY_PREFIX = "shop"."""
    settings.DISTLOCKS = {
        **settings.DISTLOCKS,
        "redis": {**settings.DISTLOCKS["redis"], "KEY_PREFIX": "shop"},
        "default": {**settings.DISTLOCKS["default"], "KEY_PREFIX": "shop"},
    }


@pytest.mark.parametrize("alias", ["redis", "default"])
def test_release_takes_the_bare_name_under_a_key_prefix(shop_prefix, alias, name):
    lk = distlocks.lock(name, using=alias, ttl=30)
    assert lk.acquire()
    assert lk.key == f"shop:{name}"
    assert run("distlocks_release", name, "--using", alias, "--yes") == f"{alias}: released 'shop:{name}'\n"
    with pytest.raises(distlocks.LockLost):
        lk.release()
    with pytest.raises(
        CommandError, match=rf"'{name}' is not held \(did you mean 'shop:{name}'\? '{alias}' has KEY_PREFIX 'shop'\)"
    ):
        run("distlocks_release", name, "--using", alias, "--yes")
    with pytest.raises(CommandError, match=rf"'shop:{name}' is not held$"):  # the full key: as before
        run("distlocks_release", f"shop:{name}", "--using", alias, "--yes")


def test_release_of_a_bare_name_asks_about_the_prefixed_key_and_keeps_the_token(shop_prefix, name, monkeypatch):
    lk = distlocks.lock(name, using="redis", ttl=30)
    assert lk.acquire()
    asked = []
    monkeypatch.setattr("builtins.input", lambda prompt: asked.append(prompt) or "n")
    with pytest.raises(CommandError, match="Not released."):
        run("distlocks_release", name, "--using", "redis")
    assert asked[0].startswith(f"Force-release 'shop:{name}' on 'redis' (held by ")
    assert f"token {lk.token})" in asked[0]
    assert f"shop:{name}" in listed("redis")  # not released
    with pytest.raises(CommandError, match=rf"'shop:{name}' is not held with token {lk.token + 1}"):
        run("distlocks_release", name, "--using", "redis", "--token", str(lk.token + 1), "--yes")
    assert run("distlocks_release", name, "--using", "redis", "--token", str(lk.token), "--yes").startswith(
        "redis: released 'shop:"
    )
    with pytest.raises(distlocks.LockLost):
        lk.release()
