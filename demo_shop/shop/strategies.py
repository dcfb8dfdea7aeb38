"""The ways to sell one unit of stock, safe and unsafe.

After §2-3 of jdxhb's "分布式锁技术全景解析" (CSDN, 2025,
https://blog.csdn.net/jdxhb/article/details/146148374).

Each strategy returns True when it sold a unit and False when the stock ran out.
Between reading the stock and writing it back each one "works" for
``DEMO_WORK_SECONDS``, the window in which unsafe strategies race.
"""

from __future__ import annotations

import contextlib
import os
import signal
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

from django.conf import settings
from django.db import transaction
from django.db.models import F

import distlocks
from demo_shop.shop.models import Order, Stock

Strategy = Callable[[str], bool]

_local_lock = threading.Lock()
# Set by the view for a buyer that is to pause (``oversell --pause-every``).
_pause = threading.local()


@contextlib.contextmanager
def pausing(pause: bool) -> Iterator[None]:
    """Make this thread's next buy stop its whole process between its read and its write (``oversell --pause-every``)."""
    _pause.on = pause
    try:
        yield
    finally:
        _pause.on = False


def _work() -> None:
    time.sleep(settings.DEMO_WORK_SECONDS)
    if getattr(_pause, "on", False):
        _pause.on = False
        _stop_process()


def _stop_process() -> None:
    """SIGSTOP this process, as a GC pause or a VM migration would, until the oversell command sends SIGCONT.

    Every thread stops, the lock's watchdog too: nothing renews the lease. The
    command finds the process by the file named by its pid in ``DEMO_PAUSE_DIR``.
    """
    Path(settings.DEMO_PAUSE_DIR, str(os.getpid())).touch()
    os.kill(os.getpid(), signal.SIGSTOP)


def _read_check_write(product_id: str, strategy: str) -> bool:
    """Read the stock, check it, write it back: correct only when serialized."""
    stock = Stock.objects.get(product_id=product_id, warehouse=1)
    if stock.count < 1:
        return False
    _work()
    stock.count -= 1
    stock.save(update_fields=["count"])
    Order.objects.create(product_id=product_id, strategy=strategy)
    return True


def none(product_id: str) -> bool:
    """No lock at all."""
    return _read_check_write(product_id, "none")


def local(product_id: str) -> bool:
    """A threading.Lock: serializes the threads of one process, not the processes."""
    with _local_lock:
        return _read_check_write(product_id, "local")


def atomic_sql(product_id: str) -> bool:
    """One conditional UPDATE: the database checks and decrements at once."""
    with transaction.atomic():
        sold = Stock.objects.filter(product_id=product_id, warehouse=1, count__gte=1).update(count=F("count") - 1)
        if sold:
            _work()
            Order.objects.create(product_id=product_id, strategy="atomic_sql")
        return bool(sold)


def select_for_update(product_id: str) -> bool:
    """A row lock held until the transaction ends (on SQLite: BEGIN IMMEDIATE)."""
    with transaction.atomic():
        stock = Stock.objects.select_for_update().get(product_id=product_id, warehouse=1)
        if stock.count < 1:
            return False
        _work()
        stock.count -= 1
        stock.save(update_fields=["count"])
        Order.objects.create(product_id=product_id, strategy="select_for_update")
        return True


def optimistic(product_id: str) -> bool:
    """Compare-and-set on a version column; retry when another buyer got there first."""
    while True:
        stock = Stock.objects.get(product_id=product_id, warehouse=1)
        if stock.count < 1:
            return False
        _work()
        with transaction.atomic():
            updated = Stock.objects.filter(pk=stock.pk, version=stock.version).update(
                count=stock.count - 1, version=stock.version + 1
            )
            if updated:
                Order.objects.create(product_id=product_id, strategy="optimistic")
                return True


def pitfall(product_id: str, alias: str) -> bool:
    """A distributed lock taken inside the transaction: released before it commits.

    The lock guards the stock update, and the rest of the order (payment,
    e-mail...) runs after it in the same transaction. The next buyer gets the
    lock while this one's decrement is still uncommitted, reads the old count
    and overwrites it (the "事务" pitfall of that article, §2.3.2).
    """
    with transaction.atomic():
        with distlocks.lock(f"stock:{product_id}", using=alias, wait=60):
            stock = Stock.objects.get(product_id=product_id, warehouse=1)
            if stock.count < 1:
                return False
            stock.count -= 1
            stock.save(update_fields=["count"])
        _work()
        Order.objects.create(product_id=product_id, strategy=f"pitfall:{alias}")
        return True


def locked(product_id: str, alias: str) -> bool:
    """The body of the ``lock:<alias>`` view, which ``distributed_lock`` wraps."""
    with transaction.atomic():
        return _read_check_write(product_id, f"lock:{alias}")


def fenced(product_id: str, alias: str) -> bool:
    """The lock, and the row checks its token: a holder that paused past its lease
    cannot write when it wakes (it gets StaleToken), which no lease alone can promise."""
    with distlocks.lock(f"stock:{product_id}", using=alias, wait=60) as held, transaction.atomic():
        stock = Stock.objects.get(product_id=product_id, warehouse=1)
        if stock.count < 1:
            return False
        _work()
        stock.count -= 1
        stock.save(update_fields=["count"], fence=held)
        Order.objects.create(product_id=product_id, strategy=f"fenced:{alias}")
        return True


PLAIN: dict[str, Strategy] = {
    "none": none,
    "local": local,
    "atomic_sql": atomic_sql,
    "select_for_update": select_for_update,
    "optimistic": optimistic,
}
