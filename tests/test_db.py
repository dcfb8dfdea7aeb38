"""What is particular to the database backend: transactions, the waiters' queue, its own connections."""

from __future__ import annotations

import contextlib
import re
import threading
import time
from datetime import timedelta

import pytest
from django.core.exceptions import ImproperlyConfigured
from django.db import OperationalError, connections, transaction
from django.utils import timezone

import distlocks
from distlocks.backends.db import close_connections
from distlocks.checks import check_distlocks, unanswered
from distlocks.handler import locks
from distlocks.inspection import held_locks
from distlocks.models import Lock

from .conftest import DB, DB_ALIASES, queue_waiters, wait_until
from .test_lock import in_thread

pytestmark = DB


@pytest.mark.parametrize("alias", ["mariadb", "postgresql"], indirect=True)
def test_lock_outside_callers_transaction(alias, lock_factory):
    lk = lock_factory()
    database = locks[alias].database

    def lock_then_roll_back():
        with transaction.atomic(using=database):
            lk.acquire()
            # Visible to other connections at once, before any commit...
            assert in_thread(lambda: lock_factory().acquire(wait=0)) is False
            raise ZeroDivisionError

    with pytest.raises(ZeroDivisionError):
        lock_then_roll_back()
    # ...and still held after the rollback.
    assert in_thread(lambda: lock_factory().acquire(wait=0)) is False
    assert Lock.objects.using(database).filter(lock_name=lk.key).exists()
    lk.release()


@pytest.mark.parametrize("alias", ["default"], indirect=True)
def test_on_sqlite_a_lock_inside_a_transaction_joins_it(alias, lock_factory):
    # SQLite has one writer: the transaction's own write lock would block a
    # second connection, so the lock joins the transaction and its rollback.
    lk = lock_factory(lock_name="sqlite-joins")
    assert lk.alias == "default"

    def lock_then_roll_back():
        with transaction.atomic():
            assert lk.acquire(wait=0)
            assert Lock.objects.filter(lock_name=lk.key).exists()
            raise ZeroDivisionError

    with pytest.raises(ZeroDivisionError):
        lock_then_roll_back()
    assert not Lock.objects.filter(lock_name=lk.key).exists()
    with pytest.raises(distlocks.LockLost):
        lk.release()


@pytest.mark.parametrize("timeout", [0, -1, "5", float("inf")])
def test_bad_timeout_option_is_improperly_configured(settings, timeout):
    settings.DISTLOCKS = {"db": {"BACKEND": "distlocks.backends.db.DatabaseBackend", "OPTIONS": {"TIMEOUT": timeout}}}
    with pytest.raises(ImproperlyConfigured, match=r"DISTLOCKS\['db'\]: OPTIONS\['TIMEOUT'\] must be"):
        distlocks.lock("x", using="db")


@pytest.mark.parametrize(
    "backend",
    [
        "distlocks.backends.db.DatabaseBackend",
        "distlocks.backends.mysql.MySQLLockBackend",
        "distlocks.backends.postgresql.AdvisoryLockBackend",
    ],
)
@pytest.mark.parametrize("connect_timeout", [0, -1, "5", float("nan"), True])
def test_bad_connect_timeout_option_is_improperly_configured(settings, backend, connect_timeout):
    # 0 or less would leave libpq and mysqlclient waiting for a silent server without end.
    database = "postgresql" if "postgresql" in backend else "mariadb"
    options = {"DATABASE": database, "CONNECT_TIMEOUT": connect_timeout}
    settings.DISTLOCKS = {"db": {"BACKEND": backend, "OPTIONS": options}}
    with pytest.raises(ImproperlyConfigured, match=r"DISTLOCKS\['db'\]: OPTIONS\['CONNECT_TIMEOUT'\] must be"):
        distlocks.lock("x", using="db")


@pytest.mark.parametrize(
    "backend", ["distlocks.backends.db.DatabaseBackend", "distlocks.backends.mysql.MySQLLockBackend"]
)
def test_a_fractional_connect_timeout_works_on_mariadb(settings, backend, name):
    # mysqlclient takes whole seconds only: 1.5 used to raise TypeError from the driver.
    settings.DISTLOCKS = {"db": {"BACKEND": backend, "OPTIONS": {"DATABASE": "mariadb", "CONNECT_TIMEOUT": 1.5}}}
    with distlocks.lock(name, using="db", wait=0) as held:
        assert held.token


@pytest.mark.parametrize(
    ("backend", "vendor"),
    [
        ("distlocks.backends.mysql.MySQLLockBackend", "mysql"),
        ("distlocks.backends.postgresql.AdvisoryLockBackend", "postgresql"),
    ],
)
def test_a_misspelt_database_option_is_named_when_the_default_database_is_the_wrong_kind(settings, backend, vendor):
    # Used to be only "DISTLOCKS['n'] needs a mysql database; 'default' is sqlite": nothing about the typo.
    settings.DISTLOCKS = {"n": {"BACKEND": backend, "OPTIONS": {"DATABSE": "mariadb"}}}
    expected = (
        f"DISTLOCKS['n'] ({backend.rsplit('.', 1)[1]}) needs a {vendor} database; 'default' is sqlite "
        "(OPTIONS['DATABASE'] is not set; OPTIONS has 'DATABSE', which it does not read)"
    )
    # The typo is what the first use of the alias raises, as gunicorn runs no check...
    typo = "DISTLOCKS['n']['OPTIONS'] has an unknown key 'DATABSE'. Did you mean 'DATABASE'?"
    with pytest.raises(ImproperlyConfigured, match=re.escape(typo)):
        distlocks.lock("x", using="n").acquire(wait=0)
    # ...and check names it with what it left: the default database, of the wrong kind.
    assert [(message.id, message.msg) for message in check_distlocks()] == [
        ("distlocks.E010", typo),
        ("distlocks.E007", expected + "."),
    ]


@contextlib.contextmanager
def renamed(database, table):
    """``table`` is missing from ``database`` meanwhile, as before ``migrate --database``."""
    with connections[database].cursor() as cursor:
        cursor.execute(f"ALTER TABLE {table} RENAME TO {table}_away")
    try:
        yield
    finally:
        with connections[database].cursor() as cursor:
            cursor.execute(f"ALTER TABLE {table}_away RENAME TO {table}")


@pytest.mark.parametrize(
    ("backend", "database", "table"),
    [
        ("distlocks.backends.db.DatabaseBackend", "default", "distlocks_lock"),
        ("distlocks.backends.db.DatabaseBackend", "mariadb", "distlocks_lock"),
        ("distlocks.backends.db.DatabaseBackend", "postgresql", "distlocks_lock"),
        ("distlocks.backends.mysql.MySQLLockBackend", "mariadb", "distlocks_native_lease"),
        ("distlocks.backends.postgresql.AdvisoryLockBackend", "postgresql", "distlocks_native_lease"),
    ],
)
def test_a_database_without_the_migrations_says_to_migrate_it(settings, backend, database, table, name):
    # It used to be BackendUnavailable "... is unavailable: relation ... does not exist" (native), the
    # driver's ProgrammingError (table backend), a traceback from distlocks_list, and no word from check.
    settings.DISTLOCKS = {"unmigrated": {"BACKEND": backend, "OPTIONS": {"DATABASE": database}}}
    advice = f"database '{database}' has no distlocks tables: run `python manage.py migrate --database {database}`"
    with renamed(database, table):
        warnings = unanswered([locks["unmigrated"]])
        if database == "default":  # a plain migrate migrates it: a new project checked before it gets no warning
            assert warnings == []
        else:
            [warning] = warnings
            assert warning.id == "distlocks.W014"
            assert advice in warning.msg
        with pytest.raises(ImproperlyConfigured, match=re.escape(advice)):
            distlocks.lock(name, using="unmigrated", wait=0).acquire()
        assert advice in held_locks(["unmigrated"]).errors["unmigrated"]
    assert unanswered([locks["unmigrated"]]) == []
    with distlocks.lock(name, using="unmigrated", wait=0):
        pass


def places_queued(alias, name):
    """How many places the queue of ``name`` on ``alias`` has, live or not."""
    from distlocks.models import LockWaiter

    return LockWaiter.objects.using(locks[alias].database).filter(lock_name=locks[alias].make_key(name)).count()


@pytest.mark.parametrize("alias", DB_ALIASES, indirect=True)
def test_waiters_get_the_lock_first_come_first_served(alias, name):
    holder = distlocks.lock(name, using=alias)
    holder.acquire()
    threads, order = queue_waiters(
        name, alias, "ABCD", gap=0, hold=0.01, queued=lambda started: places_queued(alias, name) == started
    )
    holder.release()
    # The releaser asks again at once, but the waiters are ahead of it: it waits its turn.
    assert holder.acquire(wait=20)
    assert order == ["A", "B", "C", "D"]
    holder.release()
    for thread in threads:
        thread.join(10)
    assert places_queued(alias, name) == 0


@pytest.mark.parametrize("alias", DB_ALIASES, indirect=True)
def test_a_waiter_that_gives_up_leaves_the_queue(alias, name, lock_factory):
    lock_factory().acquire()
    assert in_thread(lambda: lock_factory().acquire(wait=0.3)) is False
    assert places_queued(alias, name) == 0


@pytest.mark.parametrize("alias", DB_ALIASES, indirect=True)
def test_cleanup_deletes_the_places_of_waiters_that_crashed(alias, name):
    from distlocks.models import LockWaiter

    database = locks[alias].database
    past = timezone.now() - timedelta(seconds=5)
    LockWaiter.objects.using(database).create(lock_name=locks[alias].make_key(name), expires_at=past)
    # An expired place holds up nobody, and the cleanup deletes it.
    assert in_thread(lambda: distlocks.lock(name, using=alias).acquire(wait=0)) is True
    locks[alias].clear_expired()
    assert places_queued(alias, name) == 0


@pytest.mark.parametrize("alias", DB_ALIASES, indirect=True)
def test_a_waiter_that_took_the_lock_leaves_no_place_when_its_lease_was_lost(alias, name):
    # On MariaDB a waiter that took the lock keeps its place until its release deletes both:
    # a release that finds the lock gone (forced, here) deletes the place all the same.
    import threading

    from distlocks.exceptions import LockLost

    holder = distlocks.lock(name, using=alias)
    holder.acquire()
    taken, answer = threading.Event(), []

    def wait_then_lose() -> None:
        waiter = distlocks.lock(name, using=alias, wait=20)
        assert waiter.acquire()
        taken.set()
        assert locks[alias].force_release(waiter.key)
        try:
            waiter.release()
        except LockLost as exc:
            answer.append(exc)

    thread = threading.Thread(target=wait_then_lose)
    thread.start()
    deadline = timezone.now() + timedelta(seconds=30)
    while places_queued(alias, name) != 1:
        assert timezone.now() < deadline, "the waiter did not queue"
        time.sleep(0.01)
    holder.release()
    assert taken.wait(20)
    thread.join(20)
    assert len(answer) == 1
    assert places_queued(alias, name) == 0


@pytest.mark.parametrize("alias", ["default"], indirect=True)
def test_on_sqlite_a_release_wakes_the_first_live_waiter_once_it_is_committed(alias, name):
    # Each waiter sleeps on a socket named after its place; a release wakes the first live one only.
    from django.db import connections

    from distlocks.backends.db.wake import alarm, database_id
    from distlocks.models import LockWaiter

    backend = locks[alias]
    queue = LockWaiter.objects.using(backend.database)
    database = database_id(connections[backend.database])
    assert database is not None
    plain, joined = distlocks.lock(name, using=alias), distlocks.lock(f"{name}-joined", using=alias)
    alarms = {}
    for lk in (plain, joined):
        assert lk.acquire(wait=0)  # before the places: an acquire is not queued, they would be ahead of it
        queue.create(lock_name=lk.key, expires_at=timezone.now() - timedelta(seconds=1))  # ran out: not the first
        for place in "12":
            row = queue.create(lock_name=lk.key, expires_at=timezone.now() + timedelta(seconds=60))
            alarms[lk.key, place] = alarm(database, lk.key, row.pk)
    assert None not in alarms.values()
    try:
        plain.release()
        # The datagram is sent before release() returns: no wait is needed to see that it came, or did not.
        assert alarms[plain.key, "1"].wait(10) is True
        assert alarms[plain.key, "2"].wait(0.001) is False
        with transaction.atomic(using=backend.database):  # the release joins the caller's transaction
            joined.release()
            assert alarms[joined.key, "1"].wait(0.001) is False  # the lock is free for others only at the commit
        assert alarms[joined.key, "1"].wait(10) is True
        assert alarms[joined.key, "2"].wait(0.001) is False
    finally:
        for sleeper in alarms.values():
            sleeper.close()
        queue.filter(lock_name__in=[plain.key, joined.key]).delete()


def mariadb_sessions(ids):
    """The sessions among ``ids`` that MariaDB still has, with what each runs."""
    with connections["mariadb"].cursor() as cursor:
        cursor.execute(f"SELECT ID, INFO FROM information_schema.PROCESSLIST WHERE ID IN ({', '.join(map(str, ids))})")
        return dict(cursor.fetchall())


def test_close_connections_closes_the_rest_when_one_refuses_to_close(name):
    # Three threads' lock connections; another thread is inside a statement on the
    # first, so mysqlclient refuses to close it ("already in use from another
    # thread", as when the watchdog closes it at that moment). The rest still close.
    opened = []
    done = threading.Event()

    def open_and_stay():
        with distlocks.lock(f"{name}-{len(opened)}", using="mariadb"):
            pass
        opened.append(connections["distlocks:mariadb"])
        done.wait(30)  # alive: a thread's connection is closed when the thread has ended

    threads = []
    for count in range(1, 4):  # one after the other: the busy one is the first that close_connections meets
        threads.append(threading.Thread(target=open_and_stay))
        threads[-1].start()
        wait_until(lambda count=count: len(opened) == count)
    busy, *rest = opened
    raw = busy.connection
    ids = [connection.connection.thread_id() for connection in opened]

    def sleep_on_the_first():
        with contextlib.suppress(OperationalError), busy.cursor() as cursor:
            cursor.execute("SELECT SLEEP(5)")  # until the KILL QUERY at the end

    statement = threading.Thread(target=sleep_on_the_first)
    statement.start()
    try:
        wait_until(lambda: mariadb_sessions(ids[:1]) == {ids[0]: "SELECT SLEEP(5)"})
        close_connections()
        assert mariadb_sessions(ids[:1]) == {ids[0]: "SELECT SLEEP(5)"}  # still inside it: the close was refused
        assert [connection.connection for connection in rest] == [None, None]
        wait_until(lambda: list(mariadb_sessions(ids)) == ids[:1])  # the others' sessions are over
    finally:
        with connections["mariadb"].cursor() as cursor:
            cursor.execute(f"KILL QUERY {ids[0]}")
        statement.join()
        raw.close()
        done.set()
        for thread in threads:
            thread.join()
