"""Buy one unit of stock over HTTP, with the strategy named in the URL."""

from __future__ import annotations

from collections.abc import Callable

from django.conf import settings
from django.http import Http404, HttpRequest, HttpResponse, JsonResponse
from django.views.decorators.csrf import csrf_exempt
from django.views.decorators.http import require_POST

from demo_shop.shop import strategies
from distlocks.decorators import distributed_lock
from distlocks.exceptions import LockLost
from distlocks.handler import locks


def _answer(sold: bool) -> JsonResponse:
    return JsonResponse({"sold": sold}, status=200 if sold else 409)


def _pauses(request: HttpRequest) -> bool:
    """True if this buyer is to pause between its read and its write (``oversell --pause-every``).

    Only where the command that continues paused workers set ``DEMO_PAUSE_DIR``.
    """
    return request.headers.get("X-Demo-Pause") == "1" and bool(settings.DEMO_PAUSE_DIR)


def locked_buy_view(alias: str) -> Callable[..., HttpResponse]:
    """The ``lock:<alias>`` view: URLs resolve straight to it, so that Django sees
    the decorator's ``_non_atomic_requests`` and opens no transaction around the lock."""

    @csrf_exempt
    @require_POST
    @distributed_lock("stock:{product_id}", using=alias, wait=60)
    def buy_locked(request: HttpRequest, product_id: str) -> HttpResponse:
        with strategies.pausing(_pauses(request)):
            return _answer(strategies.locked(product_id, alias))

    return buy_locked


@csrf_exempt
@require_POST
def buy(request: HttpRequest, strategy: str, product_id: str) -> HttpResponse:
    """Sell one unit: 200 if sold, 409 if out of stock, 423 if the lock was busy."""
    if strategy in strategies.PLAIN:
        return _answer(strategies.PLAIN[strategy](product_id))
    kind, _, alias = strategy.partition(":")
    if alias not in locks:
        raise Http404(f"unknown strategy {strategy!r}")
    if kind == "pitfall":
        return _answer(strategies.pitfall(product_id, alias))
    if kind == "fenced":
        try:
            with strategies.pausing(_pauses(request)):
                return _answer(strategies.fenced(product_id, alias))
        except LockLost:  # it paused past its lease: the fence refused its write (StaleToken)
            return JsonResponse({"sold": False, "lost": True}, status=409)
    raise Http404(f"unknown strategy {strategy!r}")


def health(request: HttpRequest) -> HttpResponse:
    return HttpResponse("ok\n", content_type="text/plain")
