"""Holding a lock until the transaction commits: ``lock(..., until="commit")`` and the view decorator."""

from __future__ import annotations

import logging
import uuid

import pytest
from django.db import transaction
from django.http import HttpResponse
from django.test import RequestFactory

import distlocks
from demo_shop.shop.models import Stock
from distlocks.decorators import distributed_lock
from distlocks.inspection import force_release

from .conftest import DB

pytestmark = [DB, pytest.mark.servers("redis", "zookeeper")]

# (lock alias, database of the transaction). Not the database backend on SQLite
# inside an SQLite transaction: there the lock joins the transaction (see the README).
PAIRS = [
    ("redis", "default"),
    ("mariadb", "mariadb"),
    ("postgresql", "postgresql"),
    ("mariadb_native", "postgresql"),
    ("postgresql_native", "mariadb"),
    ("redlock", "mariadb"),
    ("zookeeper", "postgresql"),
]


class Boom(Exception):
    pass


def taken_elsewhere(workers, lock_alias, name):
    """Whether another process finds the lock taken (it tries once)."""
    words = workers("take", lock_alias, name, 0).finish()
    assert words[0] in ("busy", "acquired")
    return words[0] == "busy"


def rolled_back(database, body):
    """Run ``body()`` in a transaction (or savepoint) on ``database`` that then rolls back."""
    with pytest.raises(Boom), transaction.atomic(using=database):
        raise Boom(body())


def sell(database):
    Stock.objects.using(database).create(product_id=uuid.uuid4().hex[:16], count=1)


@pytest.mark.parametrize(("lock_alias", "database"), PAIRS)
def test_the_lock_is_held_until_the_transaction_commits(workers, name, lock_alias, database):
    lk = distlocks.lock(name, using=lock_alias, wait=10, until="commit")
    with transaction.atomic(using=database):
        with lk:
            sell(database)
        assert lk.hold_count == 1
        assert taken_elsewhere(workers, lock_alias, name)
    assert lk.hold_count == 0
    assert not taken_elsewhere(workers, lock_alias, name)


@pytest.mark.parametrize(("lock_alias", "database"), PAIRS)
def test_the_lock_is_freed_when_the_transaction_rolls_back(workers, name, lock_alias, database):
    lk = distlocks.lock(name, using=lock_alias, wait=10, until="commit")

    def body():
        with lk:
            sell(database)
        assert taken_elsewhere(workers, lock_alias, name)

    rolled_back(database, body)
    assert lk.hold_count == 0
    assert not taken_elsewhere(workers, lock_alias, name)


def test_sqlite_commit_and_rollback_free_the_database_lock_on_sqlite(name):
    """The database backend on SQLite, inside an SQLite transaction: the lock joins it, and is freed either way."""
    lk = distlocks.lock(name, until="commit")
    with transaction.atomic():
        with lk:
            sell("default")
        assert lk.hold_count == 1
    assert lk.hold_count == 0

    def body():
        with lk:
            sell("default")

    rolled_back("default", body)
    assert lk.hold_count == 0
    assert lk.acquire(wait=0)
    lk.release()


def test_a_rolled_back_savepoint_frees_a_lock_taken_inside_it(name):
    lk = distlocks.lock(name, using="redis", until="commit")

    def body():
        with lk:
            sell("postgresql")
        assert lk.hold_count == 1

    with transaction.atomic(using="postgresql"):
        rolled_back("postgresql", body)
        assert lk.hold_count == 0  # its writes are gone with the savepoint
        with lk:
            sell("postgresql")
        assert lk.hold_count == 1
    assert lk.hold_count == 0


def test_without_a_transaction_the_lock_is_released_at_once(name):
    lk = distlocks.lock(name, using="redis", until="commit")
    with lk:
        pass
    assert lk.hold_count == 0


def test_reentered_holds_are_all_released_at_the_commit(workers, name):
    lk = distlocks.lock(name, using="redis", until="commit")
    with transaction.atomic(using="postgresql"):
        for _ in range(3):
            with lk:
                sell("postgresql")
        assert lk.hold_count == 3  # each release waits for the commit
        assert taken_elsewhere(workers, "redis", name)
    assert lk.hold_count == 0
    assert not taken_elsewhere(workers, "redis", name)


def test_the_lock_waits_for_every_open_transaction(name):
    lk = distlocks.lock(name, using="redis", until="commit")
    with transaction.atomic(using="mariadb"):
        with transaction.atomic(using="postgresql"), lk:
            sell("mariadb")
            sell("postgresql")
        assert lk.hold_count == 1  # mariadb's transaction is still open
    assert lk.hold_count == 0


def test_a_lock_lost_before_the_commit_is_logged_after_it(name, caplog):
    lk = distlocks.lock(name, using="redis", until="commit")
    with caplog.at_level(logging.WARNING, logger="distlocks.lock"), transaction.atomic(using="postgresql"):
        with lk:
            sell("postgresql")
        assert force_release("redis", lk.key)
    assert lk.hold_count == 0
    assert any("released after its transaction committed" in record.getMessage() for record in caplog.records)


def test_until_must_be_none_or_commit(name):
    for bad in ["rollback", "", True, 1]:
        with pytest.raises(ValueError, match="until must be None"):
            distlocks.lock(name, until=bad)


def test_a_locked_view_called_inside_another_transaction_keeps_its_lock_until_it_commits(workers, name):
    """A view called from another view's ATOMIC_REQUESTS transaction: the lock outlives the inner view."""

    @distributed_lock(name, using="redis")
    def view(request):
        sell("default")
        return HttpResponse("ok")

    with transaction.atomic():
        assert view(RequestFactory().post("/")).status_code == 200
        assert taken_elsewhere(workers, "redis", name)
    assert not taken_elsewhere(workers, "redis", name)
