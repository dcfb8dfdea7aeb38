"""Fencing at the resource (distlocks.fencing), on SQLite, MariaDB and PostgreSQL, with tokens from every backend."""

from __future__ import annotations

import signal
import threading
import uuid

import pytest
from django.db import connections, transaction
from django.db.models import F

import distlocks
from demo_shop.shop.models import Order, Stock
from distlocks.fencing import fenced_update

from .conftest import ALIASES, DB, DB_ALIASES

pytestmark = [DB, pytest.mark.servers("redis", "zookeeper")]


@pytest.fixture(params=DB_ALIASES)
def database(request, transactional_db):
    """The database the fenced rows live in."""
    return request.param


def new_stock(database, count=10, fence_token=0):
    stock = Stock.objects.using(database).create(product_id=uuid.uuid4().hex[:16], count=count)
    if fence_token:
        Stock.objects.using(database).filter(pk=stock.pk).update(fence_token=fence_token)
        stock.refresh_from_db()
    return stock


def row(stock):
    """(count, fence_token) of the row as the database has it."""
    return tuple(Stock.objects.using(stock._state.db).filter(pk=stock.pk).values_list("count", "fence_token").get())


def test_a_fenced_save_stores_its_token_and_refuses_an_older_one(database):
    stock = new_stock(database)
    stock.count = 9
    stock.save(fence=5)
    assert row(stock) == (9, 5)
    stock.count = 8
    stock.save(fence=5)  # the same holder writes again
    assert row(stock) == (8, 5)
    stale = Stock.objects.using(database).get(pk=stock.pk)
    stock.count = 7
    stock.save(fence=7)
    stale.count = 100
    with pytest.raises(distlocks.StaleToken) as caught:
        stale.save(fence=6)
    assert row(stock) == (7, 7)
    assert stale.fence_token == 5  # the instance is as it was
    error = caught.value
    assert isinstance(error, distlocks.LockLost)
    assert (error.model, error.pk, error.token, error.current) == ("shop.Stock", stock.pk, 6, 7)
    message = str(error)
    assert "shop.Stock" in message
    assert f"pk={stock.pk}" in message
    assert "token 6" in message
    assert "token 7" in message


def test_a_new_row_saved_with_a_fence_stores_its_token(database):
    stock = Stock(product_id=uuid.uuid4().hex[:16], count=3)
    stock.save(fence=12, using=database)
    assert row(stock) == (3, 12)
    # A pk given by hand for a row that is not there yet: inserted, not refused.
    again = Stock(pk=stock.pk + 1000, product_id=uuid.uuid4().hex[:16], count=4)
    again.save(fence=2, using=database)
    assert row(again) == (4, 2)


def test_update_fields_write_the_token_too(database):
    stock = new_stock(database, count=10, fence_token=3)
    stock.count = 9
    stock.version = 99
    stock.save(fence=4, update_fields=["count"])
    assert row(stock) == (9, 4)
    assert Stock.objects.using(database).get(pk=stock.pk).version == 0
    stock.count = 1
    with pytest.raises(distlocks.StaleToken):
        stock.save(fence=3, update_fields=["count"])
    assert row(stock) == (9, 4)


def test_a_plain_save_never_lowers_the_fence(database):
    stock = new_stock(database, fence_token=3)
    Stock.objects.using(database).filter(pk=stock.pk).update(fence_token=9)  # a newer holder wrote
    stock.count = 5
    stock.save()  # Django's save: no check, and the fence stays where it is
    assert row(stock) == (5, 9)
    with pytest.raises(distlocks.StaleToken):
        stock.save(fence=8)
    stock.fence_token = 0
    stock.save(update_fields=["fence_token"])  # named: written (a reset, say)
    assert row(stock) == (5, 0)


def test_fenced_update_writes_every_row_or_none(database):
    fresh = new_stock(database, count=10, fence_token=3)
    newer = new_stock(database, count=10, fence_token=9)
    both = Stock.objects.using(database).filter(pk__in=[fresh.pk, newer.pk])
    with pytest.raises(distlocks.StaleToken) as caught:
        fenced_update(both, 5, count=F("count") - 1)
    assert (caught.value.pk, caught.value.token, caught.value.current) == (newer.pk, 5, 9)
    assert row(fresh) == (10, 3)  # rolled back with the stale row
    assert row(newer) == (10, 9)
    assert fenced_update(both, 9, count=F("count") - 1) == 2
    assert row(fresh) == (9, 9)
    assert row(newer) == (9, 9)
    assert fenced_update(both.filter(count__lt=0), 10, count=0) == 0


def test_a_stale_fenced_update_leaves_the_callers_transaction_usable(database):
    stock = new_stock(database, fence_token=9)
    with transaction.atomic(using=database):
        Order.objects.using(database).create(product_id=stock.product_id, strategy="test")
        with pytest.raises(distlocks.StaleToken):
            fenced_update(Stock.objects.using(database).filter(pk=stock.pk), 2, count=0)
        fenced_update(Stock.objects.using(database).filter(pk=stock.pk), 9, count=1)
    assert row(stock) == (1, 9)
    assert Order.objects.using(database).filter(product_id=stock.product_id).count() == 1


def test_a_stale_save_under_repeatable_read_reports_the_newest_token():
    """An older snapshot would show the old token (and the save would try again forever): the lookup reads the current row."""
    stock = new_stock("mariadb", fence_token=3)
    with transaction.atomic(using="mariadb"):
        connections["mariadb"].cursor().execute("SET TRANSACTION ISOLATION LEVEL REPEATABLE READ")
        assert row(stock) == (10, 3)  # the snapshot is taken here
        newer = threading.Thread(
            target=lambda: Stock.objects.using("mariadb").filter(pk=stock.pk).update(fence_token=9)
        )
        newer.start()
        newer.join(30)
        assert row(stock) == (10, 3)  # still the snapshot
        stock.count = 1
        # As with any error in save(), the transaction must roll back: to go on, wrap the save.
        with pytest.raises(distlocks.StaleToken) as caught, transaction.atomic(using="mariadb"):
            stock.save(fence=4)
        assert caught.value.current == 9
        with pytest.raises(distlocks.StaleToken) as caught:
            fenced_update(Stock.objects.using("mariadb").filter(pk=stock.pk), 4, count=1)
        assert caught.value.current == 9
    assert row(stock) == (10, 9)


def test_bad_fences_and_querysets_fail_naming_the_argument(database, name):
    stock = new_stock(database)
    for bad in ["7", True, 1.5, -1, 2**63, object(), distlocks.lock(name)]:
        expected = distlocks.LockNotOwned if isinstance(bad, distlocks.DistributedLock) else ValueError
        with pytest.raises(expected) as caught:
            stock.save(fence=bad)
        if expected is ValueError:
            assert "fence" in str(caught.value)
        with pytest.raises(expected):
            fenced_update(Stock.objects.using(database).filter(pk=stock.pk), bad, count=0)
    with pytest.raises(ValueError, match="queryset must be of a FencedModel"):
        fenced_update(Order.objects.using(database).all(), 1, strategy="x")
    with pytest.raises(ValueError, match="queryset must be a QuerySet"):
        fenced_update([stock], 1, count=0)
    with pytest.raises(ValueError, match="changes must not set fence_token"):
        fenced_update(Stock.objects.using(database).filter(pk=stock.pk), 1, fence_token=5)
    assert row(stock) == (10, 0)


@pytest.mark.parametrize("lock_alias", ALIASES)
def test_tokens_of_every_backend_fence_a_row(database, lock_alias, name):
    stock = new_stock(database)
    with distlocks.lock(name, using=lock_alias, wait=10) as held:
        first = held.token
        stock.count = 9
        stock.save(fence=held)
    assert row(stock) == (9, first)
    with distlocks.lock(name, using=lock_alias, wait=10) as held:
        assert fenced_update(Stock.objects.using(database).filter(pk=stock.pk), held, count=8) == 1
        second = held.token
    assert second > first
    assert row(stock) == (8, second)
    stock.count = 100
    with pytest.raises(distlocks.StaleToken) as caught:
        stock.save(fence=first)
    assert (caught.value.token, caught.value.current) == (first, second)
    assert row(stock) == (8, second)


# (lock alias, database of the fenced row): every backend, every database.
PAUSED = [
    ("default", "default"),
    ("mariadb", "mariadb"),
    ("postgresql", "postgresql"),
    ("mariadb_native", "mariadb"),
    ("postgresql_native", "postgresql"),
    ("redis", "postgresql"),
    ("redlock", "mariadb"),
    ("zookeeper", "default"),
]


def pause_past_the_lease(workers, tmp_path, lock_alias, name, database, fenced):
    """A holder process reads the row and is SIGSTOPped; once its lease (ZooKeeper: its session) is gone
    this process takes the lock, sells 5 and writes fenced; then the holder resumes and writes its stale decrement.

    Return (the holder's lines after resuming, the holder's token, this process's token, the row).
    """
    stock = new_stock(database, count=10)
    go = tmp_path / "go"
    # The database backend on SQLite: a renewal stopped inside its write would lock the file for everyone.
    renew = "0" if lock_alias == "default" else "1"
    holder = workers("fenced_holder", lock_alias, name, database, stock.pk, 1, renew, "1" if fenced else "0", go)
    _, old_token, seen = holder.line()
    assert int(seen) == 10
    holder.process.send_signal(signal.SIGSTOP)
    try:
        with distlocks.lock(name, using=lock_alias, ttl=30, wait=60) as held:
            new_token = held.token
            mine = Stock.objects.using(database).get(pk=stock.pk)
            mine.count -= 5
            mine.save(fence=held)
    finally:
        holder.process.send_signal(signal.SIGCONT)
    go.touch()
    return holder.finish(), int(old_token), new_token, row(stock)


@pytest.mark.parametrize(("lock_alias", "database"), PAUSED)
def test_a_holder_paused_past_its_lease_cannot_write_when_it_wakes(workers, tmp_path, name, lock_alias, database):
    lines, old_token, new_token, after = pause_past_the_lease(workers, tmp_path, lock_alias, name, database, True)
    assert new_token > old_token
    stale = ["stale", str(old_token), str(new_token)]
    assert lines == [*stale, *stale, "lost"]
    assert after == (5, new_token)  # the stale decrement (10 - 1) went nowhere


def test_without_the_fence_the_paused_holder_overwrites_the_newer_write(workers, tmp_path, name):
    """The same pause without a fence: the lease alone lets the stale write through (a lost update)."""
    lines, _, new_token, after = pause_past_the_lease(workers, tmp_path, "redis", name, "postgresql", False)
    assert lines == ["written", "lost"]
    assert after == (9, new_token)  # 10 - 1 over the newer holder's 10 - 5


def test_racing_fenced_updates_write_all_rows_or_none(database, workers, tmp_path):
    """Four processes write interleaved tokens: two into rows A and B, two into A only.

    A pair write whose token is between A's and B's must leave B alone: every
    token a reader ever sees in a row, and the one each row ends with, is one
    whose write was reported done, never one refused as stale.
    """
    a, b = new_stock(database, count=0), new_stock(database, count=0)
    start = tmp_path / "start"
    pks = [f"{a.pk},{b.pk}", str(a.pk), f"{a.pk},{b.pk}", str(a.pk)]
    racers = [workers("fenced_race", database, pks[i], i + 1, 4, 40, start) for i in range(4)]
    seen = set()
    start.touch()
    while any(racer.process.poll() is None for racer in racers):
        seen.update(Stock.objects.using(database).filter(pk__in=[a.pk, b.pk]).values_list("pk", "count", "fence_token"))
    written, refused = {}, set()
    for pair, racer in zip([True, False, True, False], racers, strict=True):
        words = racer.finish()
        while words:
            if words[0] == "ok":
                written[int(words[1])] = pair
                words = words[2:]
                continue
            token, current = int(words[1]), int(words[2])
            assert words[0] == "stale"
            assert current > token  # refused only for a larger token already written
            refused.add(token)
            words = words[3:]
    assert refused, "no write was refused: the racers did not overlap"
    for pk, count, fence in seen | {(b.pk, *row(b)), (a.pk, *row(a))}:
        assert count == fence
        assert fence == 0 or fence in written, f"row {pk} got token {fence}, whose write was refused"
    assert row(a) == (160, 160)  # the largest token is never refused
    assert row(b)[1] == max((token for token, pair in written.items() if pair), default=0)
