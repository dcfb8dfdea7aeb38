"""A Redis Cluster as the Redis backend's server (``OPTIONS["CLUSTER"]``): its seed nodes, redis-py's cluster clients.

The backend's scripts go through redis-py's ``RedisCluster`` (and, on an
event loop, ``redis.asyncio.cluster.RedisCluster``), which routes each by its
keys to the primary of their slot, follows ``MOVED`` and ``ASK`` and learns the
new map of slots after a failover. Every key of a lock shares one hash tag
(``keys.py``): each script runs in one slot. The waiters' hand-overs go on
sharded channels in the lock's slot (``shards.py``).
"""

from __future__ import annotations

import difflib
import inspect
from dataclasses import dataclass
from typing import Any

from django.core import checks
from django.core.exceptions import ImproperlyConfigured

from distlocks.backends.redis.perprocess import PerProcess
from distlocks.backends.redis.server import without_password

#: Passed to redis-py unless ``CLUSTER_OPTIONS`` says otherwise: a node that does not answer raises in bounded time.
DEFAULT_OPTIONS = {"socket_connect_timeout": 2, "socket_timeout": 5}

Seeds = tuple[tuple[str, int], ...]


@dataclass(frozen=True)
class Cluster:
    """A backend's Redis Cluster: its seed nodes and redis-py's options (``configured``'s), and what it is asked."""

    alias: str
    seeds: Seeds
    options: dict[str, Any]

    @property
    def address(self) -> str:
        return address(self.seeds)

    def client(self) -> Any:
        return client(self.alias, self.seeds, self.options)

    def check(self) -> list[checks.CheckMessage]:
        """Nothing to say: its options were checked when it was made (E002), and its timeouts have defaults."""
        return []

    def releases(self, client: Any) -> Any:
        """The process's hand-overs from the cluster, on its sync ``client`` (``shards``)."""
        from distlocks.backends.redis.shards import ShardReleases

        return ShardReleases(client)

    def loop_releases(self, client: Any) -> Any:
        """The running event loop's client of the cluster and hand-overs (``aioshards``), beside the sync ``client``."""
        from distlocks.backends.redis.aioshards import LoopShardReleases

        return LoopShardReleases(async_client(self.alias, self.seeds, self.options), client)


def configured(alias: str, options: dict[str, Any]) -> Cluster | None:
    """The Redis Cluster of a backend's ``options`` (None: it names a cache or a Sentinel group).

    Raise ImproperlyConfigured, naming the option, if they are not what they must be.
    """
    if "CLUSTER" not in options:
        if "CLUSTER_OPTIONS" in options:
            raise ImproperlyConfigured(
                f"DISTLOCKS[{alias!r}]['OPTIONS'] sets CLUSTER_OPTIONS without CLUSTER: they are the options of "
                "redis-py's RedisCluster, for the seed nodes listed in CLUSTER"
            )
        return None
    if "CACHE" in options:
        raise ImproperlyConfigured(
            f"DISTLOCKS[{alias!r}]['OPTIONS'] sets both CACHE and CLUSTER: set CLUSTER alone for a Redis "
            "Cluster, CACHE alone for the Redis of a cache"
        )
    return Cluster(alias, seeds_of(alias, options["CLUSTER"]), options_of(alias, options.get("CLUSTER_OPTIONS")))


def seeds_of(alias: str, value: Any, option: str = "CLUSTER", what: str = "seed nodes", port: int = 7000) -> Seeds:
    """The servers of ``OPTIONS[option]``, a list of "host:port"; ImproperlyConfigured naming the option if not.

    A value shown in the message has its password masked (a URL given by mistake).
    """
    where = f"DISTLOCKS[{alias!r}]['OPTIONS'][{option!r}]"
    if not isinstance(value, list | tuple) or not value:
        shown = without_password(value) if isinstance(value, str) else value
        raise ImproperlyConfigured(f'{where} must be a list of {what}, "host:port" each; it is {shown!r}')
    seeds = []
    for node in value:
        host, colon, number = node.rpartition(":") if isinstance(node, str) else ("", "", "")
        host = host.removeprefix("[").removesuffix("]")  # an IPv6 address: [::1]:7000
        well_formed = host and not any(c in host for c in "/@ ")  # not a URL
        if not (colon and well_formed and number.isdigit() and 0 < int(number) < 65536):
            shown = without_password(node) if isinstance(node, str) else node
            raise ImproperlyConfigured(f'{where} has {shown!r}, which is not "host:port" (e.g. "10.0.0.1:{port}")')
        seeds.append((host, int(number)))
    return tuple(seeds)


def options_of(alias: str, value: Any) -> dict[str, Any]:
    """``OPTIONS["CLUSTER_OPTIONS"]``: keyword arguments of redis-py's RedisCluster, over ``DEFAULT_OPTIONS``.

    redis-py drops the names it does not know without a word: here they are
    an error, as is ``decode_responses`` (the backend reads bytes).
    """
    where = f"DISTLOCKS[{alias!r}]['OPTIONS']['CLUSTER_OPTIONS']"
    if value is None:
        value = {}
    if not isinstance(value, dict) or not all(isinstance(name, str) for name in value):
        raise ImproperlyConfigured(
            f"{where} must be a dict of redis-py's RedisCluster keyword arguments (password, ssl, "
            f"socket_timeout...); it is {value!r}"
        )
    accepted = _accepted()
    for name in value:
        if name == "decode_responses" or (accepted and name not in accepted):
            close = difflib.get_close_matches(name, accepted, n=1)
            guess = f" Did you mean {close[0]!r}?" if close and name != "decode_responses" else ""
            raise ImproperlyConfigured(f"{where} has {name!r}, which the backend cannot pass to RedisCluster.{guess}")
    return {**DEFAULT_OPTIONS, **value}


def _accepted() -> list[str]:
    """The keyword arguments redis-py's RedisCluster passes on (none known: no redis-py, or one that does not say)."""
    try:
        from redis.cluster import REDIS_ALLOWED_KEYS, RedisCluster
    except ImportError:  # the first use says that redis-py is missing
        return []
    own = set(inspect.signature(RedisCluster.__init__).parameters) - {"self", "startup_nodes", "kwargs"}
    return sorted((own | set(REDIS_ALLOWED_KEYS)) - {"host", "port", "decode_responses", "connection_pool"})


def address(seeds: Seeds) -> str:
    """The seed nodes as messages and logs show them."""
    return "cluster " + ", ".join(f"{host}:{port}" for host, port in seeds)


_clients = PerProcess()


def client(alias: str, seeds: Seeds, options: dict[str, Any]) -> Any:
    """This process's ``redis.cluster.RedisCluster`` for ``alias`` (thread-safe: shared by its threads)."""
    key = (alias, seeds, repr(sorted(options.items())))
    return _clients.get(key, lambda: _make(alias, seeds, options, asyncio=False))


def async_client(alias: str, seeds: Seeds, options: dict[str, Any]) -> Any:
    """A new ``redis.asyncio.cluster.RedisCluster`` for ``alias`` (one per event loop: see ``aiowait``)."""
    return _make(alias, seeds, options, asyncio=True)


def _make(alias: str, seeds: Seeds, options: dict[str, Any], asyncio: bool) -> Any:
    try:
        if asyncio:
            from redis.asyncio.cluster import ClusterNode, RedisCluster
        else:
            from redis.cluster import ClusterNode, RedisCluster  # type: ignore[assignment]
    except ImportError as exc:
        raise ImproperlyConfigured(f"DISTLOCKS[{alias!r}] needs redis-py: pip install 'distlocks[redis]'") from exc
    return RedisCluster(startup_nodes=[ClusterNode(host, port) for host, port in seeds], **options)


def is_cluster(client: Any) -> bool:
    """Whether ``client`` is redis-py's (sync) cluster client."""
    from redis.cluster import RedisCluster

    return isinstance(client, RedisCluster)
