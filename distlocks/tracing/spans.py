"""OpenTelemetry spans made from the lock's signals, after the fact.

A signal carries how long the acquire or the hold lasted, so each span is made
when it ends, with its start set back by that much: nothing is kept open
between acquire and release. ``distlocks.acquire`` and ``distlocks.hold`` are
children of the span current in the thread that took or released the lock.
"""

from __future__ import annotations

import time
from typing import Any

from opentelemetry import trace

from distlocks.signals import lock_acquire_failed, lock_acquired, lock_lost, lock_released


def _span(
    what: str, name: str, alias: str, seconds: float, attrs: dict[str, Any], error: Exception | None = None
) -> None:
    end = time.time_ns()
    attributes = {"distlocks.name": name, "distlocks.alias": alias, **attrs}
    span = trace.get_tracer("distlocks").start_span(
        f"distlocks.{what}", start_time=end - int(seconds * 1e9), attributes=attributes
    )
    if error is not None:
        span.record_exception(error)
        span.set_status(trace.Status(trace.StatusCode.ERROR, str(error)))
    span.end(end_time=end)


def _acquired(*, name: str, alias: str, token: int, waited: float, **kwargs: Any) -> None:
    _span("acquire", name, alias, waited, {"distlocks.result": "acquired", "distlocks.token": token})


def _acquire_failed(*, name: str, alias: str, waited: float, error: Exception | None, **kwargs: Any) -> None:
    _span("acquire", name, alias, waited, {"distlocks.result": "timeout" if error is None else "error"}, error)


def _released(*, name: str, alias: str, token: int, held: float, **kwargs: Any) -> None:
    _span("hold", name, alias, held, {"distlocks.token": token})


def _lost(*, name: str, alias: str, token: int, **kwargs: Any) -> None:
    # Sent from the watchdog's thread: a span of its own, at the moment the loss was noticed.
    _span("lost", name, alias, 0, {"distlocks.token": token})


def connect() -> None:
    """Connect the receivers (once: each has a dispatch_uid)."""
    lock_acquired.connect(_acquired, dispatch_uid="distlocks.tracing.acquired")
    lock_acquire_failed.connect(_acquire_failed, dispatch_uid="distlocks.tracing.acquire_failed")
    lock_released.connect(_released, dispatch_uid="distlocks.tracing.released")
    lock_lost.connect(_lost, dispatch_uid="distlocks.tracing.lost")
