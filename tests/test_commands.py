"""manage.py distlocks_cleanup and manage.py oversell."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time
from io import StringIO

import django
import pytest
from django.core.management import CommandError, call_command
from django.db import connections

import distlocks
from distlocks.models import Lock
from localservers import REDLOCK_PORTS, redis_url

from .conftest import DB, DB_ALIASES, ROOT, worker_env

pytestmark = [DB, pytest.mark.servers("redis", "zookeeper")]


def cleanup(*args):
    out = StringIO()
    call_command("distlocks_cleanup", *args, stdout=out)
    return out.getvalue()


@pytest.mark.parametrize("alias", DB_ALIASES, indirect=True)
def test_cleanup_deletes_only_expired_rows(alias, name):
    live = distlocks.lock(f"{name}-live", using=alias)
    expired = [distlocks.lock(f"{name}-{i}", using=alias, ttl=0.2, renew=False) for i in range(3)]
    with live:
        for lk in expired:
            lk.acquire()
        time.sleep(0.4)
        assert cleanup("--using", alias, "--dry-run") == f"{alias}: would delete 3 expired locks\n"
        assert Lock.objects.using(alias if alias != "default" else "default").count() == 4
        assert cleanup("--using", alias) == f"{alias}: deleted 3 expired locks\n"
        assert cleanup("--using", alias) == f"{alias}: deleted 0 expired locks\n"
        assert list(Lock.objects.using(alias).values_list("lock_name", flat=True)) == [live.key]
        for lk in expired:
            with pytest.raises(distlocks.LockLost):
                lk.release()


def test_cleanup_covers_every_alias_by_default():
    lines = cleanup().splitlines()
    assert lines[:5] == [
        "default: deleted 0 expired locks",
        "mariadb: deleted 0 expired locks",
        "postgresql: deleted 0 expired locks",
        "mariadb_native: deleted 0 expired locks",
        "postgresql_native: deleted 0 expired locks",
    ]
    assert re.fullmatch(r"redis: deleted \d+ unused fencing counters", lines[5])
    assert re.fullmatch(r"redis_django: deleted \d+ unused fencing counters", lines[6])  # Django's own cache
    assert re.fullmatch(r"redlock: deleted \d+ unused fencing counters", lines[7])
    assert re.fullmatch(r"zookeeper: deleted \d+ empty lock nodes", lines[8])
    assert re.fullmatch(r"locmem: deleted \d+ expired locks", lines[9])
    assert len(lines) == 10


def test_cleanup_of_redis_keeps_tokens_growing(name):
    lk = distlocks.lock(name, using="redis")
    with lk:
        first = lk.token
    assert "would delete" in cleanup("--using", "redis", "--dry-run")
    cleanup("--using", "redis")
    with lk:
        assert lk.token > first


def test_cleanup_unknown_alias():
    with pytest.raises(CommandError, match="DISTLOCKS has no alias 'nope'"):
        cleanup("--using", "nope")


def test_oversell_on_sqlite(tmp_path, settings):
    # A wider window between read and write than the suite's default, so that
    # the unsafe strategies race even when a loaded machine runs the buyers' threads slowly.
    settings.DEMO_WORK_SECONDS = 0.05
    out = StringIO()
    path = tmp_path / "out.json"
    strategies = (
        "none,local,atomic_sql,select_for_update,optimistic,lock:default,lock:redis,lock:redlock,lock:zookeeper,"
        "fenced:redis"
    )
    call_command(
        "oversell", "--strategies", strategies, "--stock", "20", "--buyers", "40", "--json", str(path), stdout=out
    )
    results = {row["strategy"]: row for row in json.loads(path.read_text())}
    assert list(results) == strategies.split(",")
    assert "Oversell race on SQLite" in out.getvalue()
    for unsafe in ("none", "local"):
        assert results[unsafe]["oversold"] > 0 or results[unsafe]["lost_updates"] > 0
    safe_ones = ["atomic_sql", "select_for_update", "optimistic", "lock:default", "lock:redis", "lock:redlock"]
    for safe in [*safe_ones, "lock:zookeeper", "fenced:redis"]:
        row = results[safe]
        assert (row["orders"], row["final_stock"], row["oversold"], row["lost_updates"]) == (20, 0, 0, 0), row
    for row in results.values():
        assert row["lost_updates"] == row["orders"] - (row["initial_stock"] - row["final_stock"])
        assert row["oversold"] == max(0, row["orders"] - row["initial_stock"])
        assert row["requests_per_second"] > 0


def oversell_on_mariadb(tmp_path, *arguments, database="mariadb", **env):
    """Run the demo's own settings on MariaDB (or ``database``) as a user would, ``manage.py oversell``; return its rows."""
    path = tmp_path / "out.json"
    env = {
        **worker_env(),
        "DJANGO_SETTINGS_MODULE": "demo_shop.settings",
        "DISTLOCKS_DB": database,
        "DISTLOCKS_DB_NAME": connections[database].settings_dict["NAME"],
        "DEMO_WORK_MS": "10",
        **env,
    }
    command = [sys.executable, "manage.py", "oversell", "--stock", "20", "--buyers", "40", "--json", str(path)]
    completed = subprocess.run([*command, *arguments], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert completed.returncode == 0, completed.stderr
    assert f"Oversell race on {connections[database].display_name}" in completed.stdout
    return {row["strategy"]: row for row in json.loads(path.read_text())}


def test_oversell_on_mariadb_from_the_shell(tmp_path):
    results = oversell_on_mariadb(tmp_path)
    assert list(results) == [
        "none",
        "local",
        "atomic_sql",
        "select_for_update",
        "optimistic",
        "lock:default",
        "lock:native",
        "fenced:default",
        "pitfall:default",
    ]
    for unsafe in ("none", "local", "pitfall:default"):
        assert results[unsafe]["oversold"] > 0 or results[unsafe]["lost_updates"] > 0, results[unsafe]
    for safe in ("atomic_sql", "select_for_update", "optimistic", "lock:default", "lock:native", "fenced:default"):
        row = results[safe]
        assert (row["orders"], row["final_stock"], row["oversold"], row["lost_updates"]) == (20, 0, 0, 0), row


def test_oversell_with_postgresql_advisory_locks(tmp_path):
    results = oversell_on_mariadb(tmp_path, "--strategies", "none,lock:native,pitfall:native", database="postgresql")
    for unsafe in ("none", "pitfall:native"):
        assert results[unsafe]["oversold"] > 0 or results[unsafe]["lost_updates"] > 0, results[unsafe]
    row = results["lock:native"]
    assert (row["orders"], row["final_stock"], row["oversold"], row["lost_updates"]) == (20, 0, 0, 0), row


def test_buyers_paused_past_their_lease_oversell_unless_the_row_is_fenced(tmp_path):
    # Every 5th buyer's gunicorn worker stops itself (SIGSTOP) between its read and
    # its write; the command continues it (SIGCONT) only once another buyer has
    # taken the expired lock and sold: its count is then stale, whatever the
    # timing. Only the fence refuses its write.
    strategies = "lock:default,lock:redis,fenced:default,fenced:redis"
    arguments = ["--strategies", strategies, "--pause-every", "5", "--lease", "0.5", "--workers", "3"]
    results = oversell_on_mariadb(tmp_path, *arguments, DISTLOCKS_REDIS_URL=redis_url())
    # Each run had buyers paused and continued only once another had sold.
    assert all(row["overtaken"] > 0 for row in results.values()), results
    for leased in ("lock:default", "lock:redis"):
        row = results[leased]
        assert row["oversold"] > 0 or row["lost_updates"] > 0, row
    for fenced in ("fenced:default", "fenced:redis"):
        row = results[fenced]
        assert (row["oversold"], row["lost_updates"], row["final_stock"]) == (0, 0, 0), row
        assert row["orders"] == 20, row


def test_locked_views_commit_before_releasing_under_atomic_requests(tmp_path):
    # Every view in a transaction: the decorator still releases only after the commit.
    results = oversell_on_mariadb(
        tmp_path,
        "--strategies",
        "none,lock:default,lock:redis",
        DEMO_ATOMIC_REQUESTS="1",
        DISTLOCKS_REDIS_URL=redis_url(),
    )
    assert results["none"]["oversold"] > 0 or results["none"]["lost_updates"] > 0, results["none"]
    for safe in ("lock:default", "lock:redis"):
        row = results[safe]
        assert (row["orders"], row["final_stock"], row["oversold"], row["lost_updates"]) == (20, 0, 0, 0), row


def test_oversell_with_redis_and_redlock(tmp_path):
    results = oversell_on_mariadb(
        tmp_path,
        "--strategies",
        "none,lock:redis,lock:redlock",
        DISTLOCKS_REDIS_URL=redis_url(),
        DISTLOCKS_REDLOCK_URLS=",".join(redis_url(port) for port in REDLOCK_PORTS),
    )
    assert results["none"]["oversold"] > 0 or results["none"]["lost_updates"] > 0, results["none"]
    for safe in ("lock:redis", "lock:redlock"):
        row = results[safe]
        assert (row["orders"], row["final_stock"], row["oversold"], row["lost_updates"]) == (20, 0, 0, 0), row


def test_oversell_rejects_an_unknown_strategy():
    with pytest.raises(CommandError, match="unknown strategy lock:nope; choose from: atomic_sql, fenced:default, "):
        call_command("oversell", "--strategies", "none,lock:nope")


@pytest.mark.parametrize(
    ("arguments", "error"),
    [
        (
            ["--pause-every", "5", "--lease", "2", "--pause", "2"],
            "--lease and --pause must be more than 0, --pause longer",
        ),
        (["--pause-every", "5"], "--pause-every needs MariaDB or PostgreSQL: on SQLite a paused buyer's"),
    ],
)
def test_oversell_rejects_pauses_it_cannot_show(arguments, error):
    with pytest.raises(CommandError, match=re.escape(error)):
        call_command("oversell", *arguments)


@pytest.mark.parametrize("command", ["distlocks_cleanup", "distlocks_list", "distlocks_release", "distlocks_verify"])
def test_version_is_distlocks_and_djangos(command, capsys):
    with pytest.raises(SystemExit) as info:
        call_command(command, "--version")
    assert info.value.code == 0
    assert capsys.readouterr().out == f"distlocks {distlocks.__version__} (Django {django.get_version()})\n"
    assert re.fullmatch(r"\d+\.\d+\.\d+", distlocks.__version__)
