"""``WAIT_REPLICAS``: an acquisition counts once that many replicas acknowledge it (Redis ``WAIT``), else is given back.

The acquiring script and ``WAIT numreplicas timeout`` go in one pipeline, so
on one connection and in one round trip: ``WAIT`` waits for the replicas to
acknowledge every write of its connection up to the script's (the server
counts per connection), and answers how many did within the timeout. A hold
taken with fewer is given back, by its token, and the acquire raises
``BackendUnavailable``. A hold handed over by another client's release is
written by that client's connection: its waiter renews it (a write of its own,
later in the replication stream) with ``WAIT`` before it counts.

What it does not promise (Redis's documentation of ``WAIT``): Redis stays
asynchronously replicated. An acknowledged write is in the replicas' memory,
not on their disks, and a failover may still promote a replica that did not
get it (one that was not among those that acknowledged, or lagged behind
them); nor does it roll back a write the replicas did not acknowledge.
"""

from __future__ import annotations

from collections.abc import Generator
from typing import TYPE_CHECKING, Any, NamedTuple

from django.core.exceptions import ImproperlyConfigured

from distlocks.backends.arguments import check_count, check_positive_number
from distlocks.backends.redis import strays
from distlocks.backends.redis.scripts import HoldCalls, ScriptCall
from distlocks.exceptions import BackendUnavailable

if TYPE_CHECKING:
    from distlocks.backends.redis.protocol import QueuingBackend

#: The scripts of an attempt whose write is a hold, which ``WAIT`` must confirm: a lock's or a side's acquire,
#: and the renewal of a hold handed over (an attempt's other calls give back, which is not waited for).
CONFIRMED = frozenset({"acquire", "rw_acquire", "extend", "rw_renew"})
#: The default ``WAIT_TIMEOUT``, seconds: a replica on the same network acknowledges within a millisecond
#: or two; this leaves room for one briefly busy while bounding how long an acquire waits for one that is gone.
WAIT_TIMEOUT = 0.1


def configured(alias: str, options: dict[str, Any], cluster: bool) -> tuple[int, float]:
    """``WAIT_REPLICAS`` and ``WAIT_TIMEOUT`` of a backend's ``options``; ImproperlyConfigured naming the option.

    Refused beside ``CLUSTER``: ``WAIT`` must run on the connection that ran
    the script, and redis-py's ``RedisCluster`` does not keep them on one (it
    sends ``WAIT`` to its default node, and a redirected command again, alone).
    """
    try:
        replicas = check_count(options.get("WAIT_REPLICAS", 0), "OPTIONS['WAIT_REPLICAS']")
        timeout = check_positive_number(options.get("WAIT_TIMEOUT", WAIT_TIMEOUT), "OPTIONS['WAIT_TIMEOUT']")
    except ValueError as exc:
        raise ImproperlyConfigured(f"DISTLOCKS[{alias!r}]: {exc}") from exc
    if replicas and cluster:
        raise ImproperlyConfigured(
            f"DISTLOCKS[{alias!r}]['OPTIONS'] sets both WAIT_REPLICAS and CLUSTER: WAIT must follow the acquiring "
            "script on its connection, which redis-py's RedisCluster does not do; WAIT_REPLICAS is for the Redis "
            "of a cache (CACHE)"
        )
    return replicas, timeout


class Acked(NamedTuple):
    """A script's answer, and how many replicas acknowledged its writes within the timeout (its ``WAIT``'s answer)."""

    value: Any
    replicas: int


def value_of(answer: Any) -> Any:
    """The script's answer in ``answer`` (an ``Acked``, or the answer itself when nothing was waited for)."""
    return answer.value if isinstance(answer, Acked) else answer


def timeout_ms(timeout: float) -> int:
    """``timeout`` seconds as ``WAIT`` takes it: whole milliseconds, at least one (0 would wait forever)."""
    return max(1, round(timeout * 1000))


def _pipeline(script: Any, keys: Any, args: list[Any], replicas: int, timeout: float) -> Any:
    pipe = script.registered_client.pipeline(transaction=False)
    pipe.evalsha(script.sha, len(keys), *keys, *args)
    pipe.execute_command("WAIT", replicas, timeout_ms(timeout))
    return pipe


def _answer(results: list[Any]) -> Acked:
    value, acked = results
    for result in (value, acked):
        if isinstance(result, Exception):  # the server's error (a failed script): the call raises it
            raise result
    return Acked(value, int(acked))


def call(script: Any, keys: Any, args: list[Any], replicas: int, timeout: float) -> Acked:
    """Run the registered ``script`` then ``WAIT`` on one connection (loading the script once on NOSCRIPT)."""
    from redis.exceptions import NoScriptError

    results = _pipeline(script, keys, args, replicas, timeout).execute(raise_on_error=False)
    if isinstance(results[0], NoScriptError):  # a SCRIPT FLUSH, a restart: as redis-py's Script does
        script.sha = script.registered_client.script_load(script.script)
        results = _pipeline(script, keys, args, replicas, timeout).execute(raise_on_error=False)
    return _answer(results)


async def acall(script: Any, keys: Any, args: list[Any], replicas: int, timeout: float) -> Acked:
    """``call`` on a ``redis.asyncio`` client's registered ``script``."""
    from redis.exceptions import NoScriptError

    results = await _pipeline(script, keys, args, replicas, timeout).execute(raise_on_error=False)
    if isinstance(results[0], NoScriptError):
        script.sha = await script.registered_client.script_load(script.script)
        results = await _pipeline(script, keys, args, replicas, timeout).execute(raise_on_error=False)
    return _answer(results)


def confirm(backend: QueuingBackend, answer: Any, calls: HoldCalls, token: int) -> Generator[ScriptCall, Any, None]:
    """Give back the hold ``token`` and raise BackendUnavailable if fewer replicas acknowledged it than asked.

    A give-back that raises is made again once the server answers (``strays``).
    """
    if not isinstance(answer, Acked) or answer.replicas >= backend.wait_replicas:
        return
    script, keys, args = calls.release
    try:
        yield script, keys, [*args, token]
    except BaseException as exc:
        forced = "rw_force_release" if script == "rw_release" else "force_release"
        strays.release_later(lambda: backend.client, keys, token, forced)
        if not isinstance(exc, BackendUnavailable):
            raise
    raise BackendUnavailable(
        f"{f'Redis of cache {backend.cache!r} ({backend.address})' if backend.cache else f'Redis {backend.address}'} "
        f"for locks on {backend.alias!r}: {answer.replicas} of "
        f"the {backend.wait_replicas} replicas asked for (WAIT_REPLICAS) acknowledged the acquisition of "
        f"{calls.key!r} within {backend.wait_timeout:g}s (WAIT_TIMEOUT): it was given back",
        alias=backend.alias,
    )
