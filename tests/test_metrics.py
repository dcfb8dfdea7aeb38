"""The Prometheus metrics of distlocks.metrics, read from prometheus-client's registry after real locking."""

from __future__ import annotations

import threading
import time

import pytest
from django.conf import settings as django_settings
from django.test import override_settings
from prometheus_client import REGISTRY, generate_latest
from prometheus_client.parser import text_string_to_metric_families

import distlocks
from distlocks.signals import lock_acquire_failed, lock_acquired, lock_lost, lock_released
from localservers import REDIS_PORT, RedisServer
from tests.conftest import DB, Holder, Worker
from tests.faults.conftest import frozen
from tests.test_lock import in_thread

pytestmark = [DB, pytest.mark.servers("redis")]

RECEIVERS = {
    lock_acquired: "distlocks.metrics.acquired",
    lock_acquire_failed: "distlocks.metrics.acquire_failed",
    lock_released: "distlocks.metrics.released",
    lock_lost: "distlocks.metrics.lost",
}


@pytest.fixture(autouse=True)
def metrics_app():
    """distlocks.metrics installed, as a project would: its ready() connects the receivers."""
    with override_settings(INSTALLED_APPS=[*django_settings.INSTALLED_APPS, "distlocks.metrics"]):
        yield
    for signal, uid in RECEIVERS.items():
        signal.disconnect(dispatch_uid=uid)


def sample(name, **labels):
    return REGISTRY.get_sample_value(name, labels) or 0.0


class Counts:
    """The metrics of one alias now; ``delta()`` gives what changed since."""

    NAMES = [
        ("distlocks_acquire_total", {"result": "acquired"}),
        ("distlocks_acquire_total", {"result": "timeout"}),
        ("distlocks_acquire_total", {"result": "error"}),
        ("distlocks_lost_total", {}),
        ("distlocks_acquire_seconds_count", {}),
        ("distlocks_acquire_seconds_sum", {}),
        ("distlocks_hold_seconds_count", {}),
        ("distlocks_hold_seconds_sum", {}),
    ]

    def __init__(self, alias):
        self.alias = alias
        self.before = self._read()

    def _read(self):
        read = {}
        for name, labels in self.NAMES:
            key = labels.get("result", name.removeprefix("distlocks_"))
            read[key] = sample(name, alias=self.alias, **labels)
        return read

    def delta(self):
        now = self._read()
        return {key: now[key] - self.before[key] for key in now}


def lost_told(counts):
    """Wait until ``lock_lost`` has been counted: the watchdog's notifier thread sends it, a moment later."""
    deadline = time.monotonic() + 10
    while counts.delta()["lost_total"] < 1:
        assert time.monotonic() < deadline, "lock_lost was not counted within 10 s"
        time.sleep(0.01)


@pytest.mark.parametrize("alias", ["default", "redis"], indirect=True)
def test_contended_waits_and_holds_are_measured(alias, name):
    counts = Counts(alias)
    holder = distlocks.lock(name, using=alias)
    waiters = [distlocks.lock(name, using=alias, wait=30) for _ in range(3)]
    waiting, times, errors = threading.Barrier(len(waiters) + 1), {}, []

    def wait_then_hold(index, lk):
        try:
            waiting.wait(10)
            called = time.monotonic()
            assert lk.acquire()
            got = time.monotonic()
            lk.release()
            times[index] = (called, got, time.monotonic())  # release() follows acquire() at once
        except Exception as exc:  # reported by the main thread
            errors.append(exc)

    called = time.monotonic()
    holder.acquire()
    got = time.monotonic()
    threads = [threading.Thread(target=wait_then_hold, args=item) for item in enumerate(waiters)]
    for thread in threads:
        thread.start()
    waiting.wait(10)
    time.sleep(0.3)  # the hold being measured
    releasing = time.monotonic()
    holder.release()
    released = time.monotonic()
    for thread in threads:
        thread.join(30)
    assert not errors
    assert len(times) == len(waiters)

    delta = counts.delta()
    assert delta["acquired"] == delta["acquire_seconds_count"] == delta["hold_seconds_count"] == 4
    assert delta["timeout"] == delta["error"] == delta["lost_total"] == 0
    # Each wait lies within its acquire() call. A waiter could not get the lock before the holder let it go,
    # so it waited about from calling acquire() to then: at least half of that, as a thread may wait
    # for the GIL a while between noting the time and entering acquire() (15 ms of 900 under load).
    most_waited = got - called + sum(g - c for c, g, _ in times.values())
    kept_waiting = sum(releasing - c for c, _, _ in times.values())
    assert kept_waiting / 2 <= delta["acquire_seconds_sum"] <= most_waited
    # Each hold lies within its acquire() and release() calls, and lasts at least from its acquire()
    # returning to its release() being called (the waiters release at once: at least 0).
    least_held = releasing - got
    most_held = released - called + sum(r - c for c, _, r in times.values())
    assert least_held <= delta["hold_seconds_sum"] <= most_held


@pytest.mark.parametrize("alias", ["default", "redis"], indirect=True)
def test_a_timeout_across_processes_is_counted_as_timeout(alias, name, workers):
    holder = workers("hold", alias, name, 30)
    assert holder.line()[0] == "acquired"
    counts = Counts(alias)
    lk = distlocks.lock(name, using=alias)
    assert lk.acquire(wait=0) is False
    with pytest.raises(distlocks.LockNotAcquired), distlocks.lock(name, using=alias, wait=0.2):
        pass
    holder.kill()
    delta = counts.delta()
    assert delta["timeout"] == 2
    assert delta["acquired"] == delta["error"] == delta["acquire_seconds_count"] == 0


def test_an_unreachable_server_is_counted_as_error(settings, name):
    settings.DISTLOCKS = {
        **settings.DISTLOCKS,
        "redis_down": {"BACKEND": "distlocks.backends.redis.RedisBackend", "OPTIONS": {"CACHE": "redis_down"}},
    }
    counts = Counts("redis_down")
    with pytest.raises(distlocks.BackendUnavailable):
        distlocks.lock(name, using="redis_down").acquire(wait=1)
    delta = counts.delta()
    assert delta["error"] == 1
    assert delta["acquired"] == delta["timeout"] == 0


@pytest.mark.parametrize("alias", ["default", "redis"], indirect=True)
def test_a_lease_run_out_is_counted_as_lost(alias, name):
    counts = Counts(alias)
    lk = distlocks.lock(name, using=alias, ttl=0.3, renew=False)
    lk.acquire()
    taker = distlocks.lock(name, using=alias)
    taken = []

    def take_over():
        taken.append(taker.acquire(wait=10))  # once the lease has run out
        taker.release()

    thread = threading.Thread(target=take_over)
    thread.start()
    thread.join(15)
    assert taken == [True]
    with pytest.raises(distlocks.LockLost):
        lk.release()
    lost_told(counts)
    delta = counts.delta()
    assert delta["lost_total"] == 1
    assert delta["acquired"] == 2
    assert delta["hold_seconds_count"] == 1  # the lost hold is not a hold that ended


def test_a_frozen_redis_loses_the_lock_and_the_loss_is_counted(settings, name):
    server = RedisServer(REDIS_PORT + 95).start()
    try:
        settings.CACHES = {
            **settings.CACHES,
            "frozen": {
                "BACKEND": "django_redis.cache.RedisCache",
                "LOCATION": f"redis://127.0.0.1:{server.port}/0",
                "OPTIONS": {"SOCKET_CONNECT_TIMEOUT": 1, "SOCKET_TIMEOUT": 2},
            },
        }
        settings.DISTLOCKS = {
            **settings.DISTLOCKS,
            "frozen": {"BACKEND": "distlocks.backends.redis.RedisBackend", "OPTIONS": {"CACHE": "frozen"}},
        }
        counts = Counts("frozen")
        lk = distlocks.lock(name, using="frozen", ttl=0.6)
        lk.acquire()
        with frozen(server):
            deadline = time.monotonic() + 10
            while counts.delta()["lost_total"] < 1 and time.monotonic() < deadline:
                time.sleep(0.02)
            assert lk.lost
        with pytest.raises(distlocks.LockLost):
            lk.release()
        assert counts.delta()["lost_total"] == 1
    finally:
        server.stop()


@pytest.mark.parametrize("alias", ["default"], indirect=True)
def test_a_receiver_that_raises_does_not_break_the_lock(alias, name):
    def broken(**kwargs):
        raise RuntimeError("a broken metrics receiver")

    for signal in RECEIVERS:
        signal.connect(broken)
    try:
        counts = Counts(alias)
        lk = distlocks.lock(name, using=alias)
        with lk:
            assert lk.hold_count == 1
        assert lk.acquire(wait=0)
        other = []
        thread = threading.Thread(target=lambda: other.append(distlocks.lock(name, using=alias).acquire(wait=0)))
        thread.start()
        thread.join(10)
        assert other == [False]
        lk.release()
        assert counts.delta()["acquired"] == 2
        assert counts.delta()["timeout"] == 1
    finally:
        for signal in RECEIVERS:
            signal.disconnect(broken)


def scrape_default_registry(client):
    """What django-prometheus's /metrics serves without multiprocess mode: prometheus-client's default registry.

    (django-prometheus itself is not installed: its release requires Django < 6.1.)
    """
    return generate_latest(REGISTRY).decode()


def scrape_distlocks_view(client):
    return client.get("/metrics").content.decode()


@pytest.mark.urls("tests.metrics_urls")
@pytest.mark.parametrize("scrape", [scrape_distlocks_view, scrape_default_registry])
@pytest.mark.parametrize("alias", ["default"], indirect=True)
def test_scraped_names_and_labels(client, alias, name, scrape):
    with distlocks.lock(name, using=alias):
        pass
    response = client.get("/metrics")
    assert response.status_code == 200
    assert response["Content-Type"].startswith("text/plain")
    families = {family.name: family for family in text_string_to_metric_families(scrape(client))}
    assert families["distlocks_acquire_seconds"].type == "histogram"
    assert families["distlocks_hold_seconds"].type == "histogram"
    assert families["distlocks_acquire"].type == "counter"
    assert families["distlocks_lost"].type == "counter"
    labels = {
        (sample.name, tuple(sorted(sample.labels.items()))) for family in families.values() for sample in family.samples
    }
    assert ("distlocks_acquire_total", (("alias", "default"), ("result", "acquired"))) in labels
    assert ("distlocks_acquire_seconds_count", (("alias", "default"),)) in labels
    assert ("distlocks_hold_seconds_count", (("alias", "default"),)) in labels


def test_without_prometheus_client_the_app_says_what_to_install(monkeypatch):
    import sys

    from django.core.exceptions import ImproperlyConfigured

    from distlocks.metrics.apps import MetricsConfig

    monkeypatch.setitem(sys.modules, "prometheus_client", None)  # as if not installed
    config = MetricsConfig("distlocks.metrics", sys.modules["distlocks.metrics"])
    with pytest.raises(ImproperlyConfigured, match=r"pip install 'distlocks\[prometheus\]'"):
        config.ready()


@pytest.mark.urls("tests.metrics_urls")
@pytest.mark.parametrize("alias", ["redis"], indirect=True)
def test_the_view_adds_up_the_processes_in_multiprocess_mode(client, alias, name, tmp_path, monkeypatch):
    # Worker processes in prometheus-client's multiprocess mode, as under gunicorn.
    monkeypatch.setenv("PROMETHEUS_MULTIPROC_DIR", str(tmp_path))
    monkeypatch.setenv("DISTLOCKS_TEST_METRICS", "1")
    holder = Worker("hold", alias, name, 1)  # its lease runs out 1 s after it is killed
    try:
        assert holder.line()[0] == "acquired"
        assert Worker("take", alias, name, 0).finish() == ["busy"]
    finally:
        holder.kill()
    assert Worker("take", alias, name, 30).finish()[0] == "acquired"
    families = text_string_to_metric_families(client.get("/metrics").content.decode())
    samples = {
        (sample.name, sample.labels.get("result")): sample.value
        for family in families
        for sample in family.samples
        if sample.labels.get("alias") == alias
    }
    assert samples[("distlocks_acquire_total", "acquired")] == 2
    assert samples[("distlocks_acquire_total", "timeout")] == 1
    assert samples[("distlocks_acquire_seconds_count", None)] == 2
    assert samples[("distlocks_hold_seconds_count", None)] == 1  # the killed holder never released


@pytest.mark.parametrize("alias", ["redis"], indirect=True)
def test_a_locked_view_is_counted(client, settings, alias, name):
    settings.ROOT_URLCONF = "tests.views"  # @distributed_lock("view:{item}", using="redis", wait=0.2)
    counts = Counts(alias)
    holder = Holder(f"view:{name}", alias)  # in a thread of its own: the view's would re-enter
    assert client.get(f"/sync/{name}/").status_code == 423
    assert holder.release() is None
    assert client.get(f"/sync/{name}/").status_code == 200
    delta = counts.delta()
    assert delta["acquired"] == 2  # the holder, then the view
    assert delta["timeout"] == 1
    assert delta["hold_seconds_count"] == 2


def test_the_held_locks_page_charts_recent_waits_and_losses(admin_client, settings, name):
    settings.DISTLOCKS = {**settings.DISTLOCKS, "charted": {"BACKEND": "distlocks.backends.db.DatabaseBackend"}}
    counts = Counts("charted")
    holder = Holder(name, "charted")
    assert distlocks.lock(name, using="charted").acquire(wait=0.05) is False  # a timeout
    assert holder.release() is None
    short = distlocks.lock(name, using="charted", ttl=0.3, renew=False)
    short.acquire()
    taker = distlocks.lock(name, using="charted")
    waited = time.monotonic()
    assert in_thread(lambda: taker.acquire(wait=10) and taker.release() is None)  # once the lease ran out
    waited = time.monotonic() - waited
    with pytest.raises(distlocks.LockLost):
        short.release()
    lost_told(counts)

    page = admin_client.get("/admin/distlocks/lock/held/").content.decode()
    assert 'id="recent-locking"' in page
    row = page[page.index('<tr class="recent-charted">') :]
    row = row[: row.index("</tr>")]
    assert "<svg" in row
    assert 'class="wait"' in row
    assert 'class="lost"' in row  # the minute with the loss is marked
    assert "3 acquired" in row
    assert "1 timed out" in row
    assert "<strong>1 lost</strong>" in row
    longest = float(row.split("longest wait ")[-1].split(" s")[0])
    assert 0 < longest <= waited + 0.0005  # the page rounds to the millisecond
    assert (
        'class="recent-charted"' not in admin_client.get("/admin/distlocks/lock/held/?alias=default").content.decode()
    )


def test_elections_and_lost_terms_are_counted(name):
    from distlocks.testing import expire_lock

    def counts():
        return sample("distlocks_elections_total", alias="locmem"), sample(
            "distlocks_leadership_lost_total", alias="locmem"
        )

    before = counts()
    election = distlocks.election(name, using="locmem", ttl=5)
    with election.lead(wait=0):
        pass
    with pytest.raises(distlocks.LeadershipLost), election.lead(wait=0):
        expire_lock(f"leader:{name}", using="locmem")  # returns once lock_lost's receivers have run
    assert [after - earlier for after, earlier in zip(counts(), before, strict=True)] == [2, 1]
