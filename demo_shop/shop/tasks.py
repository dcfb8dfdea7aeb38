"""The demo shop's Celery task: ``celery -A demo_shop.celery worker`` runs it."""

from __future__ import annotations

from django.db.models import F

from demo_shop.celery import app
from demo_shop.shop.models import Stock
from distlocks.celery import LockedTask


@app.task(base=LockedTask, lock_name="stock:{product_id}", lock_busy="retry", lock_retry_countdown=1, max_retries=60)
def restock(product_id: str, units: int) -> int:
    """Add ``units`` to a product's stock, under the lock the ``lock:default`` buy view takes.

    A buy and a restock of one product never interleave; while a buy holds the
    lock, the restock retries a second later instead of blocking a worker.
    """
    stock, _ = Stock.objects.get_or_create(product_id=product_id, warehouse=1)
    Stock.objects.filter(pk=stock.pk).update(count=F("count") + units)
    stock.refresh_from_db()
    return stock.count
