"""A Redis Sentinel group as the Redis backend's server (``OPTIONS["SENTINELS"]`` and ``["SERVICE"]``): redis-py's
Sentinel clients.

The backend's scripts go to the master that the sentinels name now, through
redis-py's ``Sentinel(...).master_for(SERVICE)`` (``redis.asyncio.sentinel``
on an event loop): a connection asks the sentinels for the master when it
connects, and one that finds its server demoted (``READONLY``) or gone
reconnects to the new master (a call that meets the demoted master again
waits out the failover: ``failover``). The hand-overs' pub/sub connection does the
same, and resubscribes there (``SentinelReleases``); while waiters wait, a
silent channel also checks, before each ping, that its server is still the
master the sentinels name. A waiter renews a hand-over before it counts
(``RedisBackend._handed_over``): a demoted master that kept a channel gets
the new master's messages by replication, which its releases did not count.

Guarantees: Sentinel's failover is asynchronous. A hold that the promoted
replica had not received is lost with the old master: its holder is told at
its next renewal (``lock_lost``, ``LockLost``), and another process may take
the lock before. ``WAIT_REPLICAS`` makes that less likely, not impossible.
"""

from __future__ import annotations

import contextlib
import difflib
import inspect
import logging
from dataclasses import dataclass, field
from typing import Any

from django.core import checks
from django.core.exceptions import ImproperlyConfigured

from distlocks.backends.redis.cluster import Seeds, seeds_of
from distlocks.backends.redis.handover import Releases, about_to_ping, connected_to
from distlocks.backends.redis.perprocess import PerProcess
from distlocks.backends.redis.server import driver_errors

logger = logging.getLogger(__name__)

#: Passed to redis-py unless ``SENTINEL_OPTIONS`` says otherwise, for the master's connections: a server that does not
#: answer raises in bounded time. And one retry (``RETRIES``) on a new connection, not redis-py's ten with backoff.
DEFAULT_OPTIONS = {"socket_connect_timeout": 2, "socket_timeout": 5}
#: The same for the sentinels' connections (unless its ``sentinel_kwargs`` say otherwise), and no retry: a sentinel
#: answers from memory, and one that does not is passed over for the next.
SENTINEL_DEFAULTS = {"socket_connect_timeout": 1, "socket_timeout": 1}
#: A call that finds its connection broken (a master demoted or gone) tries once more, without waiting, on a new one
#: to the master the sentinels name then; one that meets a demoted master again waits out the failover (``failover``).
RETRIES = 1
#: The arguments of redis-py's ``Sentinel`` itself, besides the connections' (``SENTINEL_OPTIONS`` takes them too).
SENTINEL_ARGUMENTS = ("sentinel_kwargs", "min_other_sentinels", "force_master_ip")
#: The options of the backend that configure it.
NAMES = ("SENTINELS", "SERVICE", "SENTINEL_OPTIONS")


@dataclass(frozen=True)
class Group:
    """A backend's Sentinel group: its sentinels, the name of the master they watch, and redis-py's arguments."""

    alias: str
    sentinels: Seeds
    service: str
    options: tuple[tuple[str, Any], ...] = field(repr=False)  # redis-py Sentinel's arguments, by name: a password too

    @property
    def address(self) -> str:
        """The sentinels and the service, as messages and logs show them (no password: it is in the options)."""
        return f"Sentinel {', '.join(f'{host}:{port}' for host, port in self.sentinels)} (service {self.service!r})"

    def check(self) -> list[checks.CheckMessage]:
        """W015 if one sentinel is listed: while it is down, no new connection finds the master (no I/O)."""
        if len(self.sentinels) > 1:
            return []
        return [
            checks.Warning(
                f"DISTLOCKS[{self.alias!r}]['OPTIONS']['SENTINELS'] lists one sentinel: while it is down or "
                "unreachable, no new connection finds the master, and locks raise BackendUnavailable.",
                hint="List every sentinel of the group (at least three, as Redis advises): redis-py asks the next "
                "when one does not answer.",
                id="distlocks.W015",
            )
        ]

    def client(self) -> Any:
        """This process's client of the master (thread-safe: shared by its threads); no I/O until its first call."""
        return _clients.get((self.alias, self.sentinels, self.service, repr(self.options)), lambda: self._make(False))

    def releases(self, client: Any) -> SentinelReleases:
        """The process's hand-overs from the master, on the sync ``client`` of it."""
        return SentinelReleases(self.service, client)

    def loop_releases(self, client: Any) -> Any:
        """The running event loop's client of the master and hand-overs (``aiosentinel``); ``client`` is unused."""
        from distlocks.backends.redis.aiosentinel import LoopSentinelReleases

        return LoopSentinelReleases(self.service, self._make(asyncio=True))

    def _make(self, asyncio: bool) -> Any:
        try:
            from distlocks.backends.redis.failover import AsyncFailoverRetry, FailoverRetry, connection_class

            if asyncio:
                from redis.asyncio.sentinel import Sentinel
            else:
                from redis.sentinel import Sentinel  # type: ignore[assignment]
        except ImportError as exc:
            raise ImproperlyConfigured(
                f"DISTLOCKS[{self.alias!r}] needs redis-py: pip install 'distlocks[redis]'"
            ) from exc
        retry = AsyncFailoverRetry if asyncio else FailoverRetry
        options = {"retry": retry(RETRIES), **dict(self.options)}
        options.setdefault("connection_class", connection_class(asyncio, bool(options.pop("ssl", False))))
        options["sentinel_kwargs"] = {"retry": retry(0), **options["sentinel_kwargs"]}
        return Sentinel([*self.sentinels], **options).master_for(self.service)


_clients = PerProcess()


def configured(alias: str, options: dict[str, Any]) -> Group | None:
    """The Sentinel group of a backend's ``options`` (None: it names a cache or a cluster).

    Raise ImproperlyConfigured, naming the option, if they are not what they must be.
    """
    where = f"DISTLOCKS[{alias!r}]['OPTIONS']"
    if "SENTINELS" not in options:
        if given := [name for name in NAMES[1:] if name in options]:
            raise ImproperlyConfigured(
                f"{where} sets {' and '.join(given)} without SENTINELS: they name the master that the sentinels "
                'listed in SENTINELS ("host:port" each) watch, and how to reach them'
            )
        return None
    for other in ("CACHE", "CLUSTER", "CLUSTER_OPTIONS"):
        if other in options:
            raise ImproperlyConfigured(
                f"{where} sets both {other} and SENTINELS: set SENTINELS (with SERVICE) alone for a Redis watched "
                "by Sentinel, CLUSTER alone for a Redis Cluster, CACHE alone for the Redis of a cache"
            )
    service = options.get("SERVICE")
    if not isinstance(service, str) or not service:
        raise ImproperlyConfigured(
            f"{where}['SERVICE'] must be the name of the master that the sentinels watch (as in their "
            f"'sentinel monitor <name> ...' line), a non-empty str; it is {service!r}"
        )
    sentinels = seeds_of(alias, options["SENTINELS"], "SENTINELS", "sentinels", 26379)
    return Group(alias, sentinels, service, tuple(sorted(options_of(alias, options.get("SENTINEL_OPTIONS")).items())))


def options_of(alias: str, value: Any) -> dict[str, Any]:
    """``OPTIONS["SENTINEL_OPTIONS"]``: keyword arguments of redis-py's Sentinel, over ``DEFAULT_OPTIONS``.

    Its connection arguments (``password``, ``ssl``...) are the master's and
    replicas'; the sentinels' own are its ``sentinel_kwargs`` (their password,
    if they have one), whose timeouts default to ``DEFAULT_OPTIONS`` too.
    Names redis-py does not take are an error (it would drop some without a
    word), as is ``decode_responses`` (the backend reads bytes).
    """
    where = f"DISTLOCKS[{alias!r}]['OPTIONS']['SENTINEL_OPTIONS']"
    connection = _accepted()
    value = _kwargs(where, {} if value is None else value, [*SENTINEL_ARGUMENTS, *connection] if connection else [])
    given = value.get("sentinel_kwargs")
    sentinel_kwargs = _kwargs(f"{where}['sentinel_kwargs']", {} if given is None else given, connection)
    return {**DEFAULT_OPTIONS, **value, "sentinel_kwargs": {**SENTINEL_DEFAULTS, **sentinel_kwargs}}


def _kwargs(where: str, value: Any, accepted: list[str]) -> dict[str, Any]:
    """``value`` if it is a dict of names in ``accepted`` (any name: none known); ImproperlyConfigured if not.

    A value that is no such dict is named by its type: it may hold a password.
    """
    if not isinstance(value, dict) or not all(isinstance(name, str) for name in value):
        raise ImproperlyConfigured(
            f"{where} must be a dict of redis-py's keyword arguments (password, ssl, socket_timeout...); "
            f"it is a {type(value).__name__}"
        )
    for name in value:
        if name == "decode_responses" or (accepted and name not in accepted):
            close = difflib.get_close_matches(name, accepted, n=1)
            guess = f" Did you mean {close[0]!r}?" if close and name != "decode_responses" else ""
            raise ImproperlyConfigured(f"{where} has {name!r}, which the backend cannot pass to redis-py.{guess}")
    return value


def _accepted() -> list[str]:
    """The connection arguments redis-py's Redis takes (none known: no redis-py)."""
    try:
        from redis import Redis
    except ImportError:  # the first use says that redis-py is missing
        return []
    own = set(inspect.signature(Redis.__init__).parameters) - {"self", "kwargs"}
    return sorted(own - {"host", "port", "decode_responses", "connection_pool", "unix_socket_path", "from_url"})


class SentinelReleases(Releases):
    """The process's hand-overs from the master (see ``Releases``), read on a pub/sub connection there.

    redis-py reconnects a broken pub/sub connection to the master the
    sentinels name then, and resubscribes; every waiter tries again. Before
    a silent channel is pinged, one sentinel is asked whether its server is
    still the master, and it moves there if not: a master demoted without
    dropping its subscribers would no longer see the releases.
    """

    def __init__(self, service: str, client: Any) -> None:
        super().__init__(client)
        self.service = service  # the master's name, as the sentinels know it

    def _read(self, timeout: float) -> None:
        if self.waiters and about_to_ping(self.silence) and (server := connected_to(self.pubsub)):
            try:
                master = self.listener.connection_pool.sentinel_manager.discover_master(self.service)
            except driver_errors():  # the ping below says what is wrong
                master = server
            if (str(master[0]), int(master[1])) != server:
                logger.warning("Redis release channel on %s:%s, no longer the master: moving", *server)
                self.reconnect()
        super()._read(timeout)

    def reconnect(self) -> None:
        """Drop the channel's connection and connect to the master of now, which subscribes again.

        redis-py would reconnect a dropped connection at its next command to
        the address it had; its ``connect()`` asks the sentinels.
        """
        connection = self.pubsub.connection
        connection.disconnect()
        with contextlib.suppress(*driver_errors()):  # the read that follows says what is wrong
            connection.connect()
