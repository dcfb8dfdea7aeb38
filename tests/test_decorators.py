"""The distributed_lock view decorator."""

from __future__ import annotations

import threading

import pytest
from django.db import connection, transaction
from django.http import HttpResponse
from django.test import RequestFactory

import distlocks
from demo_shop.shop.models import Stock
from distlocks.decorators import distributed_lock

from .conftest import DB

pytestmark = DB


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
