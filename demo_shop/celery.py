"""The demo's Celery app: ``celery -A demo_shop.celery worker`` (broker from CELERY_BROKER_URL)."""

from __future__ import annotations

import os

from celery import Celery

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "demo_shop.settings")

app = Celery("demo_shop")
app.config_from_object("django.conf:settings", namespace="CELERY")
app.autodiscover_tasks()
