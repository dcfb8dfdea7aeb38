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

from typing import Any, NamedTuple

#: The scripts of an attempt whose write is a hold, which ``WAIT`` must confirm: a lock's or a side's acquire,
#: and the renewal of a hold handed over (an attempt's other calls give back, which is not waited for).
CONFIRMED = frozenset({"acquire", "rw_acquire", "extend", "rw_renew"})
#: The default ``WAIT_TIMEOUT``, seconds: a replica on the same network acknowledges within a millisecond
#: or two; this leaves room for one briefly busy while bounding how long an acquire waits for one that is gone.
WAIT_TIMEOUT = 0.1


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
