"""Views of the decorator tests: each records that its body ran, in the Stock table."""

from __future__ import annotations

import asyncio

from asgiref.sync import sync_to_async
from django.http import HttpRequest, HttpResponse
from django.urls import path
from django.utils.decorators import method_decorator
from django.views import View

from demo_shop.shop.models import Stock
from distlocks.decorators import distributed_lock

LOCK = "view:{item}"


def _ran(item: str) -> None:
    Stock.objects.create(product_id=item, count=1)


@distributed_lock(LOCK, using="redis", wait=0.2)
def sync_view(request: HttpRequest, item: str) -> HttpResponse:
    _ran(item)
    return HttpResponse("sync")


@distributed_lock(LOCK, using="redis", wait=0.2)
async def async_view(request: HttpRequest, item: str) -> HttpResponse:
    await sync_to_async(_ran)(item)
    await asyncio.sleep(float(request.GET.get("sleep", 0)))
    return HttpResponse("async")


@method_decorator(distributed_lock(LOCK, using="redis", wait=0.2), name="dispatch")
class ClassView(View):
    def post(self, request: HttpRequest, item: str) -> HttpResponse:
        _ran(item)
        return HttpResponse("class")


def busy_answer(request: HttpRequest, lock: object) -> HttpResponse:
    return HttpResponse("come back later", status=503)


@distributed_lock(LOCK, using="redis", wait=0, on_locked=busy_answer)
def custom_view(request: HttpRequest, item: str) -> HttpResponse:
    _ran(item)
    return HttpResponse("custom")


# On the alias "down", which the tests of a server that is down set.
@distributed_lock(LOCK, using="down")
def down_view(request: HttpRequest, item: str) -> HttpResponse:
    _ran(item)
    return HttpResponse("down")


@distributed_lock(LOCK, using="down")
async def down_async_view(request: HttpRequest, item: str) -> HttpResponse:
    await sync_to_async(_ran)(item)
    return HttpResponse("down")


urlpatterns = [
    path("sync/<str:item>/", sync_view),
    path("async/<str:item>/", async_view),
    path("class/<str:item>/", ClassView.as_view()),
    path("custom/<str:item>/", custom_view),
    path("down/sync/<str:item>/", down_view),
    path("down/async/<str:item>/", down_async_view),
]
