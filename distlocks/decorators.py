"""The ``distributed_lock`` view decorator."""

from __future__ import annotations

import functools
import inspect
import logging
import math
from collections.abc import Awaitable, Callable
from contextlib import ExitStack
from inspect import Parameter
from typing import Any

from asgiref.sync import iscoroutinefunction
from django.core.exceptions import ImproperlyConfigured
from django.db import connections, transaction
from django.http import HttpRequest, HttpResponse

from distlocks.aio import AsyncDistributedLock
from distlocks.backends.arguments import check_positive_number, check_wait
from distlocks.exceptions import BackendUnavailable
from distlocks.handler import DEFAULT_ALIAS
from distlocks.lock import DistributedLock
from distlocks.names import check_name_fields

logger = logging.getLogger(__name__)

View = Callable[..., Any]  # a view: sync, or async returning an awaitable
LockedHandler = Callable[[HttpRequest, DistributedLock], HttpResponse]
UnavailableHandler = Callable[[HttpRequest, BackendUnavailable], HttpResponse]

#: The ``Retry-After`` of the 503 answer, in seconds: a server that is down is
#: seldom back within a second, and each retry ties a worker up for as long as
#: connecting takes to fail (``CONNECT_TIMEOUT``, 5 s by default).
UNAVAILABLE_RETRY_AFTER = 5


def locked_response(request: HttpRequest, lock: DistributedLock) -> HttpResponse:
    """Answer ``423 Locked`` with a ``Retry-After`` header (the default ``on_locked``).

    The body does not name the lock: a name such as ``cart:{user_id}`` may
    carry what the client must not see.
    """
    response = HttpResponse("Locked\n", status=423, content_type="text/plain")
    response["Retry-After"] = str(max(1, math.ceil(lock.wait or 1)))
    return response


def unavailable_response(request: HttpRequest, exc: BackendUnavailable) -> HttpResponse:
    """Answer ``503 Service Unavailable`` with ``Retry-After: 5`` (the default ``on_unavailable``).

    The body names neither the lock nor the server: ``exc`` says both, and
    is logged (logger ``distlocks.decorators``, WARNING) instead.
    """
    response = HttpResponse("Service Unavailable\n", status=503, content_type="text/plain")
    response["Retry-After"] = str(UNAVAILABLE_RETRY_AFTER)
    return response


def _unavailable(
    request: HttpRequest, lock: DistributedLock, exc: BackendUnavailable, on_unavailable: UnavailableHandler | None
) -> HttpResponse:
    """Log ``exc`` with the lock's name (the backends' errors name the server only) and answer."""
    if exc.name is None:
        exc.name = lock.name
    logger.warning("Lock %r on %r unavailable, the view was not run: %s", lock.name, lock.alias, exc)
    return (on_unavailable or unavailable_response)(request, exc)


def distributed_lock(
    name: str | Callable[..., str],
    *,
    using: str = DEFAULT_ALIAS,
    ttl: float | None = None,
    wait: float | None = 0,
    renew: bool = True,
    on_locked: LockedHandler = locked_response,
    on_unavailable: UnavailableHandler | None = None,
) -> Callable[[View], View]:
    """Run the view only while holding the lock ``name``; answer 423 if it is taken, 503 if its server is down.

    ``name`` is a format string over the view's keyword arguments
    (``"stock:{product_id}"``) or a callable taking ``request, *args, **kwargs``.
    Works on sync and async views, and on class-based views through
    ``method_decorator``. ``on_locked(request, lock)`` answers when the lock is
    taken (default: ``locked_response``, 423 with ``Retry-After``), and
    ``on_unavailable(request, exc)`` when acquiring raises BackendUnavailable
    (default, ``None``: ``unavailable_response``, 503 with ``Retry-After``;
    ``exc.name`` and ``exc.alias`` are the lock's).
    Neither default answer names the lock or the server.
    The lock is taken before the view's transaction opens and released after it
    has committed or rolled back: with ``ATOMIC_REQUESTS = True`` this decorator
    opens those transactions itself, inside the lock, so another request can
    never read the data before this one's writes are committed (the pitfall of
    releasing a lock inside a transaction before it commits). A view called
    inside a transaction it does not own (from another view) keeps the lock
    until that transaction ends, as ``lock(..., until="commit")`` does.
    """
    if ttl is not None:
        check_positive_number(ttl, "ttl")
    check_wait(wait)
    where = f"distributed_lock({name!r})" if isinstance(name, str) else "distributed_lock"

    def decorator(view: View) -> View:
        defaults = _check_pattern(name, view, where) if isinstance(name, str) else {}

        def make_lock(request: HttpRequest, args: tuple[Any, ...], kwargs: dict[str, Any]) -> DistributedLock:
            if callable(name):
                lock_name = name(request, *args, **kwargs)
            else:
                try:
                    lock_name = name.format(**({**defaults, **kwargs} if defaults else kwargs))
                except (KeyError, IndexError, AttributeError) as exc:
                    given = ", ".join(kwargs) or "none"
                    raise ImproperlyConfigured(
                        f"{where}: cannot form the lock name from the view's keyword arguments ({given}): {exc!r}"
                    ) from exc
            # The alias is looked up here, at the first request, not at decoration: views are
            # often imported before DISTLOCKS is final (override_settings, settings loaded
            # late), and reading it at import would cache an alias list that may change.
            try:
                return DistributedLock(lock_name, using=using, ttl=ttl, wait=wait, renew=renew, until="commit")
            except ImproperlyConfigured as exc:
                raise ImproperlyConfigured(f"{where}: {exc}") from exc

        if iscoroutinefunction(view):
            return _async_wrapper(view, make_lock, on_locked, on_unavailable)
        own_non_atomic: set[str] = set(getattr(view, "_non_atomic_requests", set()))

        @functools.wraps(view)
        def wrapper(request: HttpRequest, *args: Any, **kwargs: Any) -> HttpResponse:
            lock = make_lock(request, args, kwargs)
            try:
                acquired = lock.acquire()
            except BackendUnavailable as exc:
                return _unavailable(request, lock, exc, on_unavailable)
            if not acquired:
                return on_locked(request, lock)
            try:
                with ExitStack() as atomics:
                    for db in connections.all():
                        if db.settings_dict["ATOMIC_REQUESTS"] and db.alias not in own_non_atomic:
                            atomics.enter_context(transaction.atomic(using=db.alias))
                    return view(request, *args, **kwargs)
            finally:
                lock.release()

        # Django must not open ATOMIC_REQUESTS transactions around the lock.
        wrapper._non_atomic_requests = set(connections)  # type: ignore[attr-defined]
        return wrapper

    return decorator


def _check_pattern(pattern: str, view: View, where: str) -> dict[str, Any]:
    """Raise ImproperlyConfigured unless each placeholder of ``pattern`` is a keyword argument of ``view``.

    Return the view's keyword arguments' defaults, which the name is formed with
    when the URL does not give them. The request (the first argument) and
    positional-only arguments are no placeholders: URL keyword arguments are
    what the name is formed from. A view taking ``**kwargs`` (``View.dispatch``,
    through ``method_decorator``) takes any.
    """
    try:
        # method_decorator passes a partial of the bound method, "wrapping" the unbound one (with self).
        follow = not isinstance(view, functools.partial)
        parameters = list(inspect.signature(view, follow_wrapped=follow).parameters.values())
    except (TypeError, ValueError):  # no signature to check against: checked at the call
        return {}
    if parameters and parameters[0].kind in (Parameter.POSITIONAL_ONLY, Parameter.POSITIONAL_OR_KEYWORD):
        parameters = parameters[1:]  # the request
    keywords = {p.name: p for p in parameters if p.kind not in (Parameter.POSITIONAL_ONLY, Parameter.VAR_POSITIONAL)}
    view_name = getattr(view, "__qualname__", None) or getattr(view, "__name__", None) or repr(view)
    try:
        check_name_fields(pattern, keywords, "the lock name", f"the view {view_name}")
    except ValueError as exc:
        raise ImproperlyConfigured(f"{where}: {exc}") from exc
    return {name: p.default for name, p in keywords.items() if p.default is not Parameter.empty}


def _async_wrapper(
    view: Callable[..., Awaitable[HttpResponse]],
    make_lock: Callable[[HttpRequest, tuple[Any, ...], dict[str, Any]], DistributedLock],
    on_locked: LockedHandler,
    on_unavailable: UnavailableHandler | None,
) -> View:
    """Hold the lock around an async view as ``alock`` does: owned by the request's task, waiting on the loop.

    Django refuses ``ATOMIC_REQUESTS`` for async views, so there is no
    transaction to order, and the lock is released at once.
    """

    @functools.wraps(view)
    async def wrapper(request: HttpRequest, *args: Any, **kwargs: Any) -> HttpResponse:
        lock = make_lock(request, args, kwargs)
        held = AsyncDistributedLock(lock.name, using=lock.alias, ttl=lock.ttl, wait=lock.wait, renew=lock.renew)
        try:
            acquired = await held.acquire()
        except BackendUnavailable as exc:
            return _unavailable(request, lock, exc, on_unavailable)
        if not acquired:
            return on_locked(request, lock)
        try:
            return await view(request, *args, **kwargs)
        finally:
            await held.release()

    return wrapper
