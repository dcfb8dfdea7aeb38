"""URLs of the metrics tests: distlocks' own /metrics view."""

from __future__ import annotations

from django.urls import path

from distlocks.metrics.views import metrics

urlpatterns = [path("metrics", metrics)]
