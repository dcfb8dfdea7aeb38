"""OpenTelemetry spans of distlocks.tracing, recorded by the SDK's in-memory exporter after real locking."""

from __future__ import annotations

import threading
import time

import pytest
from django.conf import settings as django_settings
from django.test import override_settings
from opentelemetry import trace
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

import distlocks
from distlocks.signals import lock_acquire_failed, lock_acquired, lock_lost, lock_released
from tests.conftest import DB, Holder

pytestmark = [DB, pytest.mark.servers("redis")]

EXPORTER = InMemorySpanExporter()


@pytest.fixture(scope="module", autouse=True)
def tracer_provider():
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(EXPORTER))
    trace.set_tracer_provider(provider)  # once per process: only this module sets it


@pytest.fixture(autouse=True)
def tracing_app():
    with override_settings(INSTALLED_APPS=[*django_settings.INSTALLED_APPS, "distlocks.tracing"]):
        yield
    for signal in (lock_acquired, lock_acquire_failed, lock_released, lock_lost):
        signal.disconnect(dispatch_uid=f"distlocks.tracing.{signal_name(signal)}")
    EXPORTER.clear()


def signal_name(signal):
    return {
        lock_acquired: "acquired",
        lock_acquire_failed: "acquire_failed",
        lock_released: "released",
        lock_lost: "lost",
    }[signal]


def spans(name):
    return [span for span in EXPORTER.get_finished_spans() if span.attributes.get("distlocks.name") == name]


@pytest.mark.parametrize("alias", ["default", "redis"], indirect=True)
def test_acquire_and_hold_spans_lie_within_the_calls(alias, name):
    holder = Holder(name, alias)
    lk = distlocks.lock(name, using=alias, wait=30)
    with trace.get_tracer("test").start_as_current_span("request") as request:
        let_go = []
        thread = threading.Timer(0.2, lambda: let_go.append(time.time_ns()) or holder.release())
        thread.start()
        called = time.time_ns()
        lk.acquire()
        got = time.time_ns()
        time.sleep(0.05)
        releasing = time.time_ns()
        lk.release()
        released = time.time_ns()
    thread.join()
    acquires = [span for span in spans(name) if span.name == "distlocks.acquire"]
    holds = [span for span in spans(name) if span.name == "distlocks.hold"]
    mine = [span for span in acquires if span.parent and span.parent.span_id == request.get_span_context().span_id]
    assert len(mine) == 1
    assert len(acquires) == 2  # the holder's has no parent
    acquire = mine[0]
    assert acquire.attributes["distlocks.result"] == "acquired"
    assert acquire.attributes["distlocks.alias"] == alias
    assert isinstance(acquire.attributes["distlocks.token"], int)
    assert called <= acquire.start_time <= acquire.end_time <= got
    assert acquire.end_time >= let_go[0]  # it waited for the holder's release
    (hold,) = [span for span in holds if span.parent and span.parent.span_id == request.get_span_context().span_id]
    # Set back by ``held`` (float seconds, a microsecond of rounding) from when the receiver read the clock,
    # which is later than the hold's end by at most the release call's own time.
    assert called - 1e3 <= hold.start_time <= got + (released - releasing) + 1e3
    assert releasing <= hold.end_time <= released
    assert len(holds) == 2


@pytest.mark.parametrize("alias", ["default"], indirect=True)
def test_a_timeout_and_an_unreachable_server_are_spans_with_their_result(alias, name, settings):
    holder = Holder(name, alias)
    assert distlocks.lock(name, using=alias).acquire(wait=0.1) is False
    assert holder.release() is None
    settings.DISTLOCKS = {
        **settings.DISTLOCKS,
        "redis_down": {"BACKEND": "distlocks.backends.redis.RedisBackend", "OPTIONS": {"CACHE": "redis_down"}},
    }
    with pytest.raises(distlocks.BackendUnavailable):
        distlocks.lock(name, using="redis_down").acquire(wait=1)
    failed = {span.attributes["distlocks.result"]: span for span in spans(name) if span.name == "distlocks.acquire"}
    assert failed["timeout"].end_time - failed["timeout"].start_time >= 0.1e9
    assert failed["timeout"].status.is_ok
    error = failed["error"]
    assert error.status.status_code == trace.StatusCode.ERROR
    assert error.events[0].name == "exception"
    assert "BackendUnavailable" in error.events[0].attributes["exception.type"]


@pytest.mark.parametrize("alias", ["default"], indirect=True)
def test_a_lost_lock_is_a_span(alias, name):
    lk = distlocks.lock(name, using=alias, ttl=0.3, renew=False)
    lk.acquire()
    taker = distlocks.lock(name, using=alias)
    took = []
    thread = threading.Thread(target=lambda: took.append(taker.acquire(wait=10)) or taker.release())
    thread.start()
    thread.join(15)
    assert took == [True]
    with pytest.raises(distlocks.LockLost):
        lk.release()
    deadline = time.monotonic() + 5  # lock_lost is sent by the watchdog's notifier thread
    while not [span for span in spans(name) if span.name == "distlocks.lost"] and time.monotonic() < deadline:
        time.sleep(0.02)
    (lost,) = [span for span in spans(name) if span.name == "distlocks.lost"]
    assert lost.attributes["distlocks.token"] < max(
        span.attributes["distlocks.token"] for span in spans(name) if span.name == "distlocks.hold"
    )
