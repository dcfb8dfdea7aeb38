"""An ASGI app for the async view load test: ``uvicorn tests.asgi_shop:application``.

``/buy/<alias>/<product>/`` sells one item of a product under ``distributed_lock``
on ``alias`` (async view, read-then-write with a pause between); ``/threads/``
tells the most threads this process ran at once since it started (all, and
distlocks's own: Django runs each request's ORM calls in a thread of the
request's), and the most lock connections it had open to databases.
"""

from __future__ import annotations

import asyncio
import os
import threading
import time
from typing import Any

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "tests.settings")

import django  # noqa: E402

django.setup()

from django.conf import settings  # noqa: E402
from django.core.asgi import get_asgi_application  # noqa: E402
from django.http import HttpRequest, HttpResponse, JsonResponse  # noqa: E402
from django.urls import path  # noqa: E402
from django.views.decorators.csrf import csrf_exempt  # noqa: E402

import distlocks.backends.db.connections as lock_connections  # noqa: E402
from demo_shop.shop.models import Stock  # noqa: E402
from distlocks.decorators import distributed_lock  # noqa: E402

_most: dict[str, Any] = {"threads": 0, "lock_threads": 0, "connections": 0, "connection_threads": []}


def _sample() -> None:
    while True:
        running = threading.enumerate()
        _most["threads"] = max(_most["threads"], len(running))
        _most["lock_threads"] = max(_most["lock_threads"], sum(t.name.startswith("distlocks") for t in running))
        opened = list(lock_connections._opened.values())
        if len(opened) > _most["connections"]:  # the threads the connections serve, at the most
            _most["connections"], _most["connection_threads"] = len(opened), sorted(t.name for t in opened)
        time.sleep(0.002)


threading.Thread(target=_sample, name="sampler", daemon=True).start()


@csrf_exempt
async def buy(request: HttpRequest, alias: str, product: str) -> HttpResponse:
    @distributed_lock("stock:{product}", using=alias, wait=60)
    async def locked(request: HttpRequest, product: str) -> HttpResponse:
        stock = await Stock.objects.aget(product_id=product)
        if stock.count <= 0:
            return HttpResponse("sold out", status=409)
        await asyncio.sleep(0.005)  # the other requests run meanwhile: without the lock they would read the same count
        stock.count -= 1
        await stock.asave(update_fields=["count"])
        return HttpResponse("sold")

    return await locked(request, product=product)


async def threads(request: HttpRequest) -> JsonResponse:
    running = threading.enumerate()
    return JsonResponse(
        {**_most, "now": len(running), "lock_threads_now": sum(t.name.startswith("distlocks") for t in running)}
    )


urlpatterns = [path("buy/<str:alias>/<str:product>/", buy), path("threads/", threads)]
settings.ROOT_URLCONF = __name__
application = get_asgi_application()
