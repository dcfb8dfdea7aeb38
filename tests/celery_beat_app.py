"""The Celery app of tests/test_beat.py: ``celery -A tests.celery_beat_app beat`` and ``worker``, on RabbitMQ.

Its one entry sends ``tick`` every second; the worker writes each run's due
time, the term that sent it and the time it ran to ``DISTLOCKS_TEST_BEAT_LOG``.
Each test has a queue of its own (``DISTLOCKS_TEST_BEAT_QUEUE``).
"""

from __future__ import annotations

import os
import time

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "tests.settings")

import django  # noqa: E402

django.setup()

from celery import Celery, Task  # noqa: E402

from distlocks.celery.leader import DUE_HEADER, TERM_HEADER  # noqa: E402

BROKER = "amqp://guest:guest@127.0.0.1:5672//"

app = Celery("beat-tests", broker=BROKER)
app.conf.update(
    task_default_queue=os.environ.get("DISTLOCKS_TEST_BEAT_QUEUE", "distlocks-beat-tests"),
    beat_schedule={"tick": {"task": "tests.celery_beat_app.tick", "schedule": 1.0}},
    beat_max_loop_interval=1,
    broker_connection_retry_on_startup=True,
    worker_hijack_root_logger=False,
    timezone="UTC",
)


@app.task(bind=True)
def tick(self: Task) -> None:
    due = getattr(self.request, DUE_HEADER, None)
    term = getattr(self.request, TERM_HEADER, None)
    with open(os.environ["DISTLOCKS_TEST_BEAT_LOG"], "a") as log:
        log.write(f"{due} {term} {time.time():.3f}\n")
