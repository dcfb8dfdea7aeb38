"""Stock and orders of the demo shop (the ``mall_stock`` table of jdxhb's CSDN article on distributed locks)."""

from __future__ import annotations

from django.db import models

from distlocks.fencing import FencedModel


class Stock(FencedModel):  # fenced: the fenced:<alias> strategy writes with save(fence=held)
    product_id = models.CharField(max_length=20)
    warehouse = models.PositiveIntegerField(default=1)
    count = models.IntegerField(default=0)
    version = models.PositiveIntegerField(default=0)  # for the optimistic strategy

    class Meta:
        constraints = [models.UniqueConstraint(fields=["product_id", "warehouse"], name="unique_stock_per_warehouse")]

    def __str__(self) -> str:
        return f"{self.product_id}@{self.warehouse}: {self.count}"


class Order(models.Model):
    product_id = models.CharField(max_length=20, db_index=True)
    strategy = models.CharField(max_length=100)
    created_at = models.DateTimeField(auto_now_add=True)

    def __str__(self) -> str:
        return f"order {self.pk} of {self.product_id}"
