"""Redlock's rounds, and each node's backlog of calls, put to it in order by a thread of its own.

Backlog policy (a node that does not answer, under steady lock traffic,
must cost neither unbounded memory nor, once it answers again, a long replay
of calls that no longer matter, which would keep it out of fresh rounds):

- A call whose round's deadline has passed is dropped unless it is ``always``
  (a release): the asker went on without it, and it was never put to the
  node, so there is nothing to undo. A round that the answers settled before
  its deadline (a majority took the lock) does not drop the calls still
  queued: a take that lands late holds the lock on one more node, so that a
  node of the majority that restarts empty does not free it.
- A release is kept after its round, since it must reach a node still busy
  with a late take of the lock (else that node holds it for nobody), but only
  until the leases that the calls on the same lock queued before it asked for
  have run out, counted from when they were queued: a hold it could end has
  then ended on the node by itself. A node that thaws within the lease gets
  the release (the backlog drains in moments); one that stays away longer
  gets none, and a take it buffered holds the lock there, on a minority, for
  at most one lease after the thaw.
- Past ``MAX_BACKLOG`` calls, a quarter of them go, those that would be
  dropped soonest anyway (a bounded queue, like ``redis/strays.py``'s): a
  release kept for a long lease outlives the short leases' releases.

Drops are counted per reason (``backlog(cache)``), and the first drop for
lack of room while the node is away is logged as a warning.
"""

from __future__ import annotations

import collections
import logging
import os
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from distlocks.backends.redis import RedisBackend

logger = logging.getLogger(__name__)

#: At most this many calls wait per node and process; past it, the quarter due to be dropped soonest goes.
MAX_BACKLOG = 1000
#: The backlog is swept for calls to drop once as many calls were added since the last sweep as it
#: kept, and at least this many: a sweep's pass is paid for by the calls added since the last.
SWEEP_FROM = 32


class Failed:
    """A node's answer that is none: an error, or nothing within the deadline. False, like a refusal."""

    def __init__(self, error: Exception | None = None) -> None:
        self.error = error

    def __bool__(self) -> bool:
        return False


PENDING = object()
LATE = Failed()  # no answer within the deadline (or never asked: dropped from a full backlog)


class Round:
    """One question put to several nodes at once: the answers that came in time."""

    def __init__(self, size: int, settled: Callable[[list[Any]], bool] | None, deadline: float) -> None:
        self.answers: list[Any] = [PENDING] * size
        self.settled = settled
        self.deadline = deadline
        self.closed = False
        self.changed = threading.Condition(threading.Lock())

    def answer(self, index: int, answer: Any) -> bool:
        """Record a node's answer; False if it came too late: the asker went on without it."""
        with self.changed:
            if self.closed:
                return False
            self.answers[index] = answer
            if self._over():  # wake the asker only when it can go on: each wake-up costs a thread switch
                self.changed.notify()
            return True

    def _over(self) -> bool:
        return PENDING not in self.answers or (self.settled is not None and self.settled(self.answers))

    def wait(self) -> list[Any]:
        """Wait until every node answered, the answers settle the question, or the deadline; close the round."""
        with self.changed:
            try:
                while not self._over():
                    left = self.deadline - time.monotonic()
                    if left <= 0:
                        break
                    self.changed.wait(left)
            finally:  # interrupted too: an answer that comes now is late, for ``late`` to undo
                self.closed = True
            return [LATE if answer is PENDING else answer for answer in self.answers]


@dataclass(eq=False, slots=True)
class Call:
    """One node's part of a round: ``call(node)``, its answer to ``round_.answer(index)``, a late one to ``late``.

    ``key``: the lock it is about, if any; ``always``: put to the node after
    the round too (see the module's policy), until ``until``, when the leases
    of the calls on ``key`` queued before it have run out (set on queuing);
    ``lease``: the lease the call sets on the node, if it sets one.
    """

    round_: Round
    index: int
    node: RedisBackend
    call: Callable[[RedisBackend], Any]
    late: Callable[[RedisBackend, Any], Any] | None = None
    key: str = ""
    always: bool = False
    lease: float = 0.0
    queued: float = field(default_factory=time.monotonic)
    until: float = 0.0

    def dropped_at(self) -> float:
        """When the backlog drops this call if it has not been put to the node by then."""
        return max(self.round_.deadline, self.until) if self.always else self.round_.deadline

    def put(self) -> None:
        try:
            answer = self.call(self.node)
        except Exception as exc:  # any error (READONLY, OOM, MISCONF, a timeout) is that node failing
            answer = Failed(exc)
        if not self.round_.answer(self.index, answer) and self.late is not None:
            self.late(self.node, answer)


class NodeBacklog:
    """One node's calls, put to it in the order they came by one daemon thread.

    One thread: a node then answers one owner's questions in the order they
    were asked, so that a release (or the undoing of a failed attempt) still
    on its way can never overtake, and delete, the same owner's next take of
    the lock there; and a node that hangs holds one thread, and delays no other node.
    """

    def __init__(self, cache: str) -> None:
        self.cache = cache
        self.calls: collections.deque[Call] = collections.deque()
        self.lock = threading.Lock()
        self.thread: threading.Thread | None = None
        self.idle = False  # the thread waits for a wake-up (a SimpleQueue: cheaper than a Condition)
        self.wake: queue.SimpleQueue[None] = queue.SimpleQueue()
        self.leases_end: dict[str, float] = {}  # per lock: when the leases asked for so far run out
        self.kept_leases = 0  # its length after the last sweep
        self.kept = 0  # the backlog's length after the last sweep
        self.added = 0  # calls queued since
        self.dropped: collections.Counter[str] = collections.Counter()
        self.overflowing = False

    def submit(self, call: Call) -> None:
        with self.lock:
            now = call.queued
            if call.always:
                call.until = self.leases_end.get(call.key, 0.0)
            if call.lease:
                self.leases_end[call.key] = max(self.leases_end.get(call.key, 0.0), now + call.lease)
                if len(self.leases_end) >= max(SWEEP_FROM, 2 * self.kept_leases):
                    self.leases_end = {key: end for key, end in self.leases_end.items() if end > now}
                    self.kept_leases = len(self.leases_end)
            self.added += 1
            if self.added >= max(SWEEP_FROM, self.kept):
                self._sweep(now)
            if len(self.calls) >= MAX_BACKLOG:
                self._make_room(now)
            self.calls.append(call)
            if self.thread is None:
                thread = threading.Thread(target=self._work, name="distlocks-redlock", daemon=True)
                thread.start()  # if it cannot start, the next call tries again
                self.thread = thread
            wake, self.idle = self.idle, False
        if wake:
            self.wake.put(None)

    def _drop_reason(self, call: Call, now: float) -> str | None:
        if not call.always:
            return "round over" if now >= call.round_.deadline else None
        over = call.round_.closed or now >= call.round_.deadline
        return "leases over" if over and now >= call.until else None

    def _sweep(self, now: float, also: frozenset[Call] = frozenset()) -> None:
        """Drop the calls the policy drops by ``now``, and ``also`` these (for lack of room)."""
        kept = collections.deque[Call]()
        for call in self.calls:
            reason = self._drop_reason(call, now)
            if reason is None and call in also:
                call.round_.answer(call.index, LATE)  # never asked: no answer to wait for
                reason = "no room"
            if reason is None:
                kept.append(call)
            else:
                self.dropped[reason] += 1
        self.calls = kept
        self.kept, self.added = len(kept), 0

    def _make_room(self, now: float) -> None:
        """Drop a quarter of the calls, those the policy would drop soonest (one sort per quarter's worth of calls)."""
        soonest = sorted(self.calls, key=Call.dropped_at)[: max(1, len(self.calls) // 4)]
        self._sweep(now, frozenset(soonest))
        if not self.overflowing:
            self.overflowing = True
            logger.warning(
                "Redlock node %s: more than %d calls wait for it (it does not answer): dropping those due soonest; "
                "a release dropped leaves a hold there to run out by itself",
                self.cache,
                MAX_BACKLOG,
            )

    def _next(self) -> Call:
        while True:
            with self.lock:
                while self.calls:
                    call = self.calls.popleft()
                    reason = self._drop_reason(call, time.monotonic())
                    if reason is None:
                        return call
                    self.dropped[reason] += 1
                self.overflowing = False  # caught up
                self.idle = True
            self.wake.get()

    def _work(self) -> None:
        while True:
            call = self._next()
            try:
                call.put()
            except Exception:  # a late answer's handler that failed: the node's next calls still go to it
                logger.exception("Redlock node %s: handling a late answer failed", self.cache)


# This process's backlogs, per cache alias: a forked child starts without its parent's threads.
_backlogs: dict[str, NodeBacklog] = {}
_backlogs_lock = threading.Lock()


#: The caches whose node this process has connected to (``RedlockBackend`` does, before its first round).
connected: set[str] = set()


def _forget_after_fork() -> None:
    global _backlogs_lock
    _backlogs_lock = threading.Lock()
    _backlogs.clear()
    connected.clear()  # the driver makes new connections in a child


os.register_at_fork(after_in_child=_forget_after_fork)


def submit(call: Call) -> None:
    """Queue ``call`` for its node."""
    backlog = _backlogs.get(call.node.cache)
    if backlog is None:
        with _backlogs_lock:
            backlog = _backlogs.setdefault(call.node.cache, NodeBacklog(call.node.cache))
    backlog.submit(call)


def backlog(cache: str) -> tuple[int, dict[str, int]]:
    """How many calls wait for the node of ``cache`` in this process, and how many were dropped, by reason."""
    found = _backlogs.get(cache)
    if found is None:
        return 0, {}
    with found.lock:
        return len(found.calls), dict(found.dropped)
