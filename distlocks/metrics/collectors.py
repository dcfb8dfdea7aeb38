"""The Prometheus metrics, fed by the lock's signals.

They go to prometheus-client's default registry, which django-prometheus's
``/metrics`` and ``distlocks.metrics.views.metrics`` both export, and to
``recent``, the admin's chart of the last minutes. The receivers are sent with
``send_robust``: if one raises, the lock goes on unharmed.
"""

from __future__ import annotations

from typing import Any

from prometheus_client import Counter, Histogram

from distlocks.election import PREFIX as LEADER_PREFIX
from distlocks.metrics import recent
from distlocks.signals import lock_acquire_failed, lock_acquired, lock_lost, lock_released

#: Waits run from a free lock's round trip (under 1 ms) to minutes.
ACQUIRE_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 300)
#: Holds run from a short critical section to a long task.
HOLD_BUCKETS = (0.001, 0.005, 0.01, 0.05, 0.1, 0.5, 1, 5, 10, 30, 60, 300, 900, 3600)

acquire_seconds = Histogram(
    "distlocks_acquire_seconds",
    "Seconds spent in acquire() by acquisitions that got the lock.",
    ["alias"],
    buckets=ACQUIRE_BUCKETS,
)
hold_seconds = Histogram(
    "distlocks_hold_seconds",
    "Seconds a lock was held, from acquiring to its last release (lost holds are not counted).",
    ["alias"],
    buckets=HOLD_BUCKETS,
)
acquire_total = Counter(
    "distlocks_acquire",
    "Calls of acquire() that did not re-enter, by result: acquired, timeout (not within wait) or error (raised).",
    ["alias", "result"],
)
lost_total = Counter("distlocks_lost", "Holds whose lease was lost while held.", ["alias"])
elections_total = Counter("distlocks_elections", "Terms won in leader elections (distlocks.election).", ["alias"])
leadership_lost_total = Counter("distlocks_leadership_lost", "Terms of leader elections lost while leading.", ["alias"])


def _acquired(*, name: str, alias: str, waited: float, **kwargs: Any) -> None:
    if name.startswith(LEADER_PREFIX):
        elections_total.labels(alias).inc()
    acquire_seconds.labels(alias).observe(waited)
    acquire_total.labels(alias, "acquired").inc()
    recent.note_acquired(alias, waited)


def _acquire_failed(*, alias: str, error: Exception | None, **kwargs: Any) -> None:
    acquire_total.labels(alias, "timeout" if error is None else "error").inc()
    recent.note_failed(alias, error)


def _released(*, alias: str, held: float, **kwargs: Any) -> None:
    hold_seconds.labels(alias).observe(held)


def _lost(*, name: str, alias: str, **kwargs: Any) -> None:
    if name.startswith(LEADER_PREFIX):
        leadership_lost_total.labels(alias).inc()
    lost_total.labels(alias).inc()
    recent.note_lost(alias)


def connect() -> None:
    """Connect the receivers (once: each has a dispatch_uid)."""
    lock_acquired.connect(_acquired, dispatch_uid="distlocks.metrics.acquired")
    lock_acquire_failed.connect(_acquire_failed, dispatch_uid="distlocks.metrics.acquire_failed")
    lock_released.connect(_released, dispatch_uid="distlocks.metrics.released")
    lock_lost.connect(_lost, dispatch_uid="distlocks.metrics.lost")
