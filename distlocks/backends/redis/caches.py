"""The caches whose Redis the backend locks in: django-redis's, or Django's own ``RedisCache``; their client and check.

django-redis gives its client (``get_redis_connection``). Django's own
``django.core.cache.backends.redis.RedisCache`` (Django 4.0+) gives one through
its cache client, ``cache._cache.get_client(None, write=True)``: the client
Django itself writes with, on the cache's connection pool to the first server
of LOCATION (Django writes there and reads from the others, its replicas).
Locks read there too: a replica may lag. A cache client that picks its server
otherwise (by key: sharding) leaves it unclear where the locks are, and is
refused by the check (E012).
"""

from __future__ import annotations

import re
from typing import Any

from django.core import checks
from django.core.exceptions import ImproperlyConfigured

from distlocks.backends.redis.perprocess import PerProcess

DJANGO_REDIS = "django_redis.cache.RedisCache"
DJANGO = "django.core.cache.backends.redis.RedisCache"
BOTH = f"{DJANGO_REDIS} (django-redis) or {DJANGO} (Django's own)"

# The clients Django's RedisCaches write with, by alias and CACHES entry: one per process, not one per thread
# as Django makes its cache objects, so that a thread that ends (a check's ping) leaves no open sockets behind.
_django_clients = PerProcess()


class Refused(Exception):
    """Why a CACHES entry cannot hold locks: the check's message (after "cache 'x' "), hint and id."""

    def __init__(self, why: str, hint: str, check_id: str = "distlocks.E012") -> None:
        super().__init__(why)
        self.why = why
        self.hint = hint
        self.check_id = check_id


_USE_ONE = f"Set OPTIONS['CACHE'] to an alias of CACHES whose BACKEND is {BOTH}."


def kind(entry: Any) -> str:
    """Which Redis cache the CACHES ``entry`` is: ``DJANGO_REDIS`` or ``DJANGO``; raise Refused if neither (no I/O)."""
    from django.core.cache.backends.redis import RedisCache
    from django.utils.module_loading import import_string

    path = str(entry.get("BACKEND") if isinstance(entry, dict) else None)
    if path.partition(".")[0] == "django_redis":
        try:
            import django_redis  # noqa: F401
        except ImportError as exc:
            raise Refused("needs django-redis", "pip install 'distlocks[redis]'", "distlocks.E005") from exc
    try:
        backend_class = import_string(path)
    except ImportError as exc:
        raise Refused(f"is not a Redis cache: its BACKEND {path!r} cannot be imported ({exc})", _USE_ONE) from exc
    if isinstance(backend_class, type) and issubclass(backend_class, RedisCache):
        try:
            import redis  # noqa: F401
        except ImportError as exc:
            raise Refused("needs redis-py", "pip install 'distlocks[redis]'", "distlocks.E005") from exc
        _django_servers(entry)
        return DJANGO
    try:
        from django_redis.cache import RedisCache as DjangoRedisCache
    except ImportError:  # then no cache is django-redis's
        pass
    else:
        if isinstance(backend_class, type) and issubclass(backend_class, DjangoRedisCache):
            return DJANGO_REDIS
    raise Refused(f"is not a Redis cache (neither django-redis's nor Django's own): its BACKEND is {path!r}", _USE_ONE)


def _django_servers(entry: dict[str, Any]) -> list[str]:
    """The servers of Django's RedisCache ``entry``, as Django splits them; Refused if it names none."""
    location = entry.get("LOCATION") or ""
    servers = re.split("[;,]", location) if isinstance(location, str) else list(location)
    if not servers or not all(isinstance(server, str) and server.strip() for server in servers):
        raise Refused(
            "names no Redis server: its LOCATION is empty or has an empty entry",
            "Set its LOCATION to the Redis URL (redis://host:6379/0); with several, the first is the one written to.",
        )
    return servers


def check_django_client(cache: Any) -> None:
    """Refuse Django's RedisCache object ``cache`` if its client may pick a server other than the first (no I/O)."""
    from django.core.cache.backends.redis import RedisCacheClient

    client_class = getattr(cache, "_class", None)
    picks = ("get_client", "_get_connection_pool_index")
    if not (
        isinstance(client_class, type)
        and issubclass(client_class, RedisCacheClient)
        and all(getattr(client_class, name) is getattr(RedisCacheClient, name) for name in picks)
    ):
        name = getattr(client_class, "__qualname__", repr(client_class))
        raise Refused(
            f"is ambiguous: its cache client {name} chooses the server itself (it may shard by key), "
            "so which server holds a lock is unclear",
            "Use django.core.cache.backends.redis.RedisCache with its own client: locks go to the first "
            "server of LOCATION (the one Django writes to).",
        )


def client_of(alias: str, cache_alias: str) -> Any:
    """The redis-py client of the cache ``cache_alias`` for the locks of ``alias``; ImproperlyConfigured if none."""
    from django.conf import settings

    entry = settings.CACHES.get(cache_alias)
    if entry is None:
        raise ImproperlyConfigured(f"DISTLOCKS[{alias!r}]: cache {cache_alias!r} is not in CACHES")
    try:
        cache_kind = kind(entry)
    except Refused as refused:
        if refused.check_id == "distlocks.E005":
            raise ImproperlyConfigured(f"DISTLOCKS[{alias!r}] {refused.why}: {refused.hint}") from refused
        raise ImproperlyConfigured(f"DISTLOCKS[{alias!r}]: cache {cache_alias!r} {refused.why}") from refused
    try:
        if cache_kind == DJANGO:
            return _django_client(cache_alias)
        from django_redis import get_redis_connection

        return get_redis_connection(cache_alias)
    except Refused as refused:
        raise ImproperlyConfigured(f"DISTLOCKS[{alias!r}]: cache {cache_alias!r} {refused.why}") from refused
    except ImportError as exc:  # Django's RedisCache without redis-py
        raise ImproperlyConfigured(f"DISTLOCKS[{alias!r}] needs redis-py: pip install 'distlocks[redis]'") from exc
    except Exception as exc:  # InvalidCacheBackendError and friends
        raise ImproperlyConfigured(f"DISTLOCKS[{alias!r}]: cache {cache_alias!r}: {exc}") from exc


def _django_client(cache_alias: str) -> Any:
    """The client Django's RedisCache ``cache_alias`` writes with (its first server), shared by this process."""
    from django.conf import settings

    def make() -> Any:
        cache = _cache(cache_alias, fresh=True)
        check_django_client(cache)
        return cache._cache.get_client(None, write=True)

    return _django_clients.get((cache_alias, repr(settings.CACHES[cache_alias])), make)


def addresses(entry: dict[str, Any] | None, cache_alias: str) -> list[str]:
    """The server URLs of a cache's LOCATION, split as both caches split a string of several (``,`` or ``;``)."""
    location = (entry or {}).get("LOCATION", cache_alias)
    return [str(url) for url in location] if isinstance(location, list | tuple) else re.split("[;,]", str(location))


def sets_timeout(entry: dict[str, Any], name: str) -> bool:
    """Whether a cache's settings set the timeout ``name`` (``SOCKET_TIMEOUT``...).

    django-redis reads it from OPTIONS, or its pool's kwargs in lower case;
    Django's RedisCache passes OPTIONS to redis-py, in lower case.
    """
    options = entry.get("OPTIONS") or {}
    pool = options.get("CONNECTION_POOL_KWARGS") or {}
    return bool(options.get(name) or options.get(name.lower()) or pool.get(name.lower()))


def check(alias: str, cache_alias: str, timeouts: tuple[str, ...]) -> list[checks.CheckMessage]:
    """What ``manage.py check`` says of the cache ``cache_alias`` of the locks ``alias`` (no I/O)."""
    from django.conf import settings

    if cache_alias not in settings.CACHES:
        return [
            checks.Error(
                f"DISTLOCKS[{alias!r}] uses cache {cache_alias!r}, which is not in CACHES.",
                hint=f"Set OPTIONS['CACHE'] to a Redis cache alias: its BACKEND {BOTH}.",
                id="distlocks.E004",
            )
        ]
    entry = settings.CACHES[cache_alias]
    try:
        cache_kind = kind(entry)
        if cache_kind == DJANGO:
            check_django_client(_cache(cache_alias))
    except Refused as refused:
        if refused.check_id == "distlocks.E005":
            return [checks.Error(f"DISTLOCKS[{alias!r}] {refused.why}.", hint=refused.hint, id=refused.check_id)]
        return [
            checks.Error(
                f"DISTLOCKS[{alias!r}]: cache {cache_alias!r} {refused.why}.", hint=refused.hint, id=refused.check_id
            )
        ]
    missing = [name for name in timeouts if not sets_timeout(entry, name)]
    if not missing:
        return []
    if cache_kind == DJANGO:  # it passes its OPTIONS to redis-py, whose names are in lower case
        missing = [name.lower() for name in missing]
    names = [f"OPTIONS[{name!r}]" for name in (timeouts if cache_kind == DJANGO_REDIS else map(str.lower, timeouts))]
    return [
        checks.Warning(
            f"DISTLOCKS[{alias!r}] uses cache {cache_alias!r}, whose OPTIONS set no "
            f"{' and no '.join(missing)}: a Redis that hangs stalls lock calls and lease renewals "
            "for redis-py's default (forever before redis-py 8).",
            hint=f"Set {' and '.join(names)} (seconds, e.g. 2 and 5): they bound how long a Redis that does "
            "not answer makes a lock call wait.",
            id="distlocks.W010",
        )
    ]


def _cache(cache_alias: str, fresh: bool = False) -> Any:
    """The cache object of ``cache_alias`` (this thread's, or a ``fresh`` one); Refused if it cannot be made."""
    from django.core.cache import caches

    try:
        return caches.create_connection(cache_alias) if fresh else caches[cache_alias]
    except Exception as exc:
        raise Refused(f"cannot be made: {exc}", _USE_ONE) from exc
