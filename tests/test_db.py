"""What is particular to the database backend: transactions."""

from __future__ import annotations

import pytest
from django.core.exceptions import ImproperlyConfigured
from django.db import transaction

import distlocks
from distlocks.handler import locks
from distlocks.models import Lock

from .conftest import DB
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
