"""The distributed_lock view decorator."""

from __future__ import annotations

import asyncio
import threading

import pytest
from django.core.exceptions import ImproperlyConfigured
from django.db import connection, transaction
from django.http import HttpResponse
from django.test import RequestFactory
from django.utils.decorators import method_decorator
from django.views import View

import distlocks
from demo_shop.shop.models import Stock
from distlocks.decorators import distributed_lock
from distlocks.signals import lock_released

from .conftest import DB

pytestmark = [DB, pytest.mark.servers("redis")]


def other_thread_acquires(name):
    result = []
    thread = threading.Thread(target=lambda: result.append(distlocks.lock(name).acquire(wait=0)))
    thread.start()
    thread.join()
    return result[0]


def test_runs_the_view_under_the_lock(name):
    seen = []

    @distributed_lock(name + ":{item}")
    def view(request, item):
        seen.append(other_thread_acquires(f"{name}:{item}"))
        return HttpResponse("ok")

    response = view(RequestFactory().get("/"), item="7")
    assert response.status_code == 200
    assert seen == [False]
    assert other_thread_acquires(f"{name}:7")


def test_answers_423_when_taken(name):
    ran = []

    @distributed_lock(lambda request, item: f"{name}:{item}", wait=0.1)
    def view(request, item):
        ran.append(item)
        return HttpResponse("ok")

    with distlocks.lock(f"{name}:7"):
        result = []
        thread = threading.Thread(target=lambda: result.append(view(RequestFactory().get("/"), item="7")))
        thread.start()
        thread.join()
        response = result[0]
    assert response.status_code == 423
    assert response["Retry-After"] == "1"
    assert name not in response.content.decode()
    assert ran == []


def test_commits_before_releasing_under_atomic_requests(name, settings):
    connection.settings_dict["ATOMIC_REQUESTS"] = True
    try:
        observed = []

        @distributed_lock(name)
        def view(request):
            assert connection.in_atomic_block
            Stock.objects.create(product_id="X", count=1)
            transaction.on_commit(lambda: observed.append(distlocks.lock(name).hold_count))
            return HttpResponse("ok")

        assert view._non_atomic_requests >= {"default"}
        view(RequestFactory().get("/"))
        # The transaction committed while the lock was still held.
        assert observed == [1]
    finally:
        connection.settings_dict["ATOMIC_REQUESTS"] = False


def test_bad_arguments_fail_at_decoration():
    with pytest.raises(ValueError, match="ttl must be"):
        distributed_lock("x", ttl=0)
    with pytest.raises(ValueError, match="wait must be"):
        distributed_lock("x", wait=-1)


def test_a_placeholder_that_is_no_argument_of_the_view_fails_at_decoration():
    with pytest.raises(
        ImproperlyConfigured,
        match=r"distributed_lock\('stock:\{prodcut_id\}'\): the lock name 'stock:\{prodcut_id\}' refers to "
        r"\{prodcut_id\}, which is not an argument of the view .*buy \(arguments: product_id\)",
    ):

        @distributed_lock("stock:{prodcut_id}")
        def buy(request, product_id):
            return HttpResponse("ok")

    with pytest.raises(
        ImproperlyConfigured, match=r"\{request\}, which is not an argument of the view .*\(arguments: none\)"
    ):
        distributed_lock("x:{request}")(lambda request: HttpResponse("ok"))
    with pytest.raises(ImproperlyConfigured, match="must name arguments"):
        distributed_lock("x:{0}")(lambda request, item: HttpResponse("ok"))
    with pytest.raises(ImproperlyConfigured, match="not a valid format string"):
        distributed_lock("x:{item")(lambda request, item: HttpResponse("ok"))

    async def async_buy(request, product_id):
        return HttpResponse("ok")

    with pytest.raises(ImproperlyConfigured, match=r"refers to \{prodcut_id\}"):
        distributed_lock("stock:{prodcut_id}")(async_buy)


def test_placeholders_of_kwargs_and_defaults(name):
    @distributed_lock(name + ":{anything}")
    def takes_any(request, **kwargs):
        return HttpResponse(kwargs["anything"])

    assert takes_any(RequestFactory().get("/"), anything="a").content == b"a"
    with pytest.raises(
        ImproperlyConfigured, match=rf"distributed_lock\('{name}:\{{anything\}}'\): cannot form .*\(other\)"
    ):
        takes_any(RequestFactory().get("/"), other="b")

    seen = []

    @distributed_lock(name + ":{item}:{page}")
    def with_default(request, item, page=1):
        seen.append(other_thread_acquires(f"{name}:{item}:1"))
        return HttpResponse("ok")

    assert with_default(RequestFactory().get("/"), item="7").status_code == 200
    assert seen == [False]  # formed with the default, as LockedTask's names are


def test_a_class_based_views_placeholders_are_checked_too(name):
    class Report(View):
        @method_decorator(distributed_lock(name + ":{yaer}"))
        def get(self, request, year):
            return HttpResponse(year)

    with pytest.raises(
        ImproperlyConfigured, match=r"refers to \{yaer\}, which is not an argument .*\(arguments: year\)"
    ):
        Report.as_view()(RequestFactory().get("/"), year="2026")


def test_an_unknown_alias_names_the_decorator_at_the_first_request():
    @distributed_lock("stock:{product_id}", using="nope")
    def buy(request, product_id):
        return HttpResponse("ok")

    with pytest.raises(
        ImproperlyConfigured, match=r"distributed_lock\('stock:\{product_id\}'\): DISTLOCKS has no alias 'nope'"
    ):
        buy(RequestFactory().get("/"), product_id="7")


VIEWS = ["sync", "async", "class"]


@pytest.fixture
def views_urls(settings):
    settings.ROOT_URLCONF = "tests.views"


def ran(item):
    return Stock.objects.filter(product_id=item).count()


@pytest.mark.parametrize("kind", VIEWS)
def test_views_through_the_test_client(views_urls, client, name, kind):
    response = client.post(f"/{kind}/{name}/")
    assert (response.status_code, response.content.decode()) == (200, kind)
    assert ran(name) == 1
    assert other_thread_acquires_on("redis", f"view:{name}")  # released after the response


@pytest.mark.parametrize("kind", VIEWS)
def test_a_lock_held_by_another_process_gives_423_and_the_view_does_not_run(views_urls, client, name, kind, workers):
    holder = workers("hold", "redis", f"view:{name}", 30)
    assert holder.line()[0] == "acquired"
    response = client.post(f"/{kind}/{name}/")
    assert response.status_code == 423
    assert response["Retry-After"] == "1"
    assert response.content == b"Locked\n"  # not the lock's name, which may carry a user's id
    assert ran(name) == 0
    holder.kill()


def test_on_locked_answers_differently(views_urls, client, name):
    with distlocks.lock(f"view:{name}", using="redis"):
        response = other_thread(lambda: client.post(f"/custom/{name}/"))
    assert (response.status_code, response.content) == (503, b"come back later")
    assert ran(name) == 0


def test_async_requests_in_one_event_loop_exclude_each_other(views_urls, async_client, name):
    async def later():
        await asyncio.sleep(0.2)  # once the first holds the lock
        return await async_client.post(f"/async/{name}/")

    async def both():
        # Both run in this one thread and event loop: still one at a time.
        return await asyncio.gather(async_client.post(f"/async/{name}/?sleep=1"), later())

    first, second = asyncio.run(both())
    assert [first.status_code, second.status_code] == [200, 423]
    assert ran(name) == 1


def test_an_async_request_waits_without_blocking_the_event_loop(views_urls, async_client, name):
    with distlocks.lock(f"view:{name}", using="redis"):
        ticks, response = asyncio.run(request_while_ticking(async_client, f"/async/{name}/"))
    assert response.status_code == 423  # after waiting its 0.2 s...
    assert ticks >= 5  # ...during which the event loop went on


async def request_while_ticking(async_client, url):
    ticks = 0

    async def tick():
        nonlocal ticks
        while True:
            await asyncio.sleep(0.01)
            ticks += 1

    ticker = asyncio.ensure_future(tick())
    response = await async_client.post(url)
    ticker.cancel()
    return ticks, response


def other_thread(call):
    result = []
    thread = threading.Thread(target=lambda: result.append(call()))
    thread.start()
    thread.join()
    return result[0]


def other_thread_acquires_on(alias, lock_name):
    def take():
        lk = distlocks.lock(lock_name, using=alias)
        if not lk.acquire(wait=0):
            return False
        lk.release()
        return True

    return other_thread(take)


def test_the_demo_shops_locked_view_releases_after_the_commit_under_atomic_requests(client, name):
    # Through Django's whole request handling, on the demo's own URL: when the
    # lock is released, no transaction may be open any more.
    Stock.objects.create(product_id=name[:20], count=5)
    open_at_release = []

    def record(sender, **kwargs):
        open_at_release.append(connection.in_atomic_block)

    connection.settings_dict["ATOMIC_REQUESTS"] = True
    lock_released.connect(record)
    try:
        response = client.post(f"/buy/lock:default/{name[:20]}/")
    finally:
        lock_released.disconnect(record)
        connection.settings_dict["ATOMIC_REQUESTS"] = False
    assert response.status_code == 200
    assert open_at_release == [False]
    assert Stock.objects.get(product_id=name[:20]).count == 4


# Servers that are down: nothing listens on port 1 (tests/settings.py).
DOWN = {
    "redis": {"BACKEND": "distlocks.backends.redis.RedisBackend", "OPTIONS": {"CACHE": "redis_down"}},
    "mariadb": {
        "BACKEND": "distlocks.backends.db.DatabaseBackend",
        "OPTIONS": {"DATABASE": "mariadb_down", "CONNECT_TIMEOUT": 1},
    },
    "postgresql": {
        "BACKEND": "distlocks.backends.postgresql.AdvisoryLockBackend",
        "OPTIONS": {"DATABASE": "postgresql_down", "CONNECT_TIMEOUT": 1},
    },
    "zookeeper": {
        "BACKEND": "distlocks.backends.zookeeper.ZooKeeperBackend",
        "LOCATION": "127.0.0.1:1",
        "OPTIONS": {"CONNECT_TIMEOUT": 1},
    },
}


@pytest.fixture(params=sorted(DOWN))
def down(request, settings):
    settings.DISTLOCKS = {**settings.DISTLOCKS, "down": DOWN[request.param]}
    return request.param


def assert_tells_nothing(response, name):
    body = response.content.decode()
    assert name not in body
    assert "127.0.0.1" not in body
    assert "view:" not in body


@pytest.mark.parametrize("kind", ["sync", "async"])
def test_a_server_that_is_down_gives_503_with_retry_after_and_the_view_does_not_run(
    views_urls, client, async_client, name, down, kind, caplog
):
    if kind == "sync":
        response = client.post(f"/down/sync/{name}/")
    else:
        response = asyncio.run(async_client.post(f"/down/async/{name}/"))
    assert response.status_code == 503
    assert response["Retry-After"] == "5"
    assert_tells_nothing(response, name)
    assert ran(name) == 0
    # What the client is not told is logged.
    [record] = [r for r in caplog.records if r.name == "distlocks.decorators"]
    assert record.levelname == "WARNING"
    assert f"view:{name}" in record.getMessage()


@pytest.mark.parametrize("kind", ["sync", "async"])
def test_on_unavailable_answers_with_the_exception(name, kind, settings):
    settings.DISTLOCKS = {**settings.DISTLOCKS, "down": DOWN["redis"]}
    called = []

    def on_unavailable(request, exc):
        called.append((request, exc))
        return HttpResponse("later", status=502)

    def on_locked(request, lock):
        raise AssertionError("not locked: down")

    if kind == "sync":

        @distributed_lock(name + ":{item}", using="down", on_locked=on_locked, on_unavailable=on_unavailable)
        def view(request, item):
            raise AssertionError("the view ran")

        request = RequestFactory().get("/")
        response = view(request, item="7")
    else:

        @distributed_lock(name + ":{item}", using="down", on_locked=on_locked, on_unavailable=on_unavailable)
        async def view(request, item):
            raise AssertionError("the view ran")

        request = RequestFactory().get("/")
        response = asyncio.run(view(request, item="7"))
    assert (response.status_code, response.content) == (502, b"later")
    [(seen_request, exc)] = called
    assert seen_request is request
    assert isinstance(exc, distlocks.BackendUnavailable)
    assert (exc.name, exc.alias) == (f"{name}:7", "down")
    assert "redis://127.0.0.1:1/0" in str(exc)
