"""Redlock: one lock over N independent Redis servers (antirez's algorithm, https://redis.io/docs/latest/develop/clients/patterns/distributed-locks/).

Guarantees: a lock is held when the Redis backend's acquire script succeeded
on a majority of the nodes (``N // 2 + 1``) within the lease, less the time the
attempt took and a clock drift allowance (1 % of the lease + 2 ms); otherwise
whatever was taken is released on every node and the attempt failed. Renewal,
re-entry and release also need a majority. So the lock survives a minority of
nodes being down or restarted empty; with a majority down nothing can be
acquired: ``LockNotAcquired`` after ``wait``, or ``BackendUnavailable`` when not
even a majority of nodes answers.

Before its first timed round, an acquire connects this process to the nodes
(``_connect``: the driver's imports, TCP, its handshake), waiting at most
``CONNECT_SECONDS`` (or a round's deadline, if longer) and only until a
majority is connected; neither the rounds' deadline nor the lock's validity
counts that time. The nodes are asked at once, each by a daemon thread of its own per process,
and a call waits for a node at most a tenth of the lease
(``NODE_DEADLINE_SHARE``; ``node_deadline``), returning as soon as the answers settle it: a node
that hangs (a black hole: connections accepted, never answered) costs at most
that, never its socket timeout, and delays no other node. The calls waiting
for a node that hangs form a bounded backlog (``redlock_workers``: calls whose
round is over are dropped, releases once the leases they could end have run
out), so that the node is back in the rounds soon after it answers again.
Any error from a node (``READONLY`` after a failover, ``OOM``, ``MISCONF``, a
timeout) or an answer after the deadline counts as that node failing. A take that answers late is
given back if the attempt failed, and kept (it holds the lock on one more node)
if it succeeded.

The fencing token is the largest of the tokens the majority gave; the nodes of
that majority that gave smaller ones are then raised to it (their counters and
hashes), and the attempt fails unless a majority shows it. An acquire proposes
a token a second ahead of its host's clock, which every node gives unless its
counter is already past it, so that the nodes usually agree and that second
round is not needed. Any later majority
shares a node with this one, so it gives a larger token: tokens keep growing
while the majority that answers changes, also when the nodes' counters started
at different times or one node's runs ahead (a fast clock), as long as the
nodes keep their counters. Force-release compares the token on each node.

What Redlock does *not* give (Martin Kleppmann, "How to do distributed locking",
2016, and antirez's reply "Is Redlock safe?", http://antirez.com/news/101): its safety assumes bounded clock drift and
process pauses shorter than the lease; a node that restarts without persistence
can let a second client in, unless it stays down for a lease. A node restarted
without its counter gives tokens from its own clock in microseconds, which need
not be above a token that came from a node whose clock runs ahead: the token is
**not** a strict fencing token across node restarts. Where stale writes must be
refused, use the database or ZooKeeper backend's tokens.
"""

from __future__ import annotations

import collections
import contextlib
import random
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

from django.core import checks
from django.core.exceptions import ImproperlyConfigured

from distlocks.backends.base import BaseLockBackend, LockInfo
from distlocks.backends.redis import RedisBackend
from distlocks.backends.redlock_workers import LATE, PENDING, Call, Failed, Round, connected, submit
from distlocks.exceptions import BackendUnavailable
from distlocks.owner import Owner

#: How long a call waits for a node, as a share of the lease: a node that answers later counts as failing.
NODE_DEADLINE_SHARE = 0.1
#: ... but at least this long (or a third of a shorter lease): a loaded host may take tens of ms to hear a
#: healthy node, and a round ends once a majority answered (the validity counts the time all the same).
MIN_NODE_DEADLINE = 0.2
#: How long an acquire waits at most for nodes this process has not connected to yet (or a round's
#: deadline, if longer), before its timed round: connecting to a node that never answers costs this once.
CONNECT_SECONDS = 1.0
#: How long ``ping`` waits for the nodes, and the inspection and maintenance calls.
PING_SECONDS = 2.0
INSPECT_SECONDS = 10.0
#: How far (µs) the token an acquire proposes runs ahead of this host's clock: the clock skew between
#: this host and the nodes below which they all give the proposed token, with no second round.
TOKEN_LEAD = 1_000_000


def node_deadline(ttl: float) -> float:  # how long a round waits for a node, for a lease of ``ttl`` seconds
    return max(ttl * NODE_DEADLINE_SHARE, min(MIN_NODE_DEADLINE, ttl / 3))


def _settled(need: int) -> Callable[[list[Any]], bool]:
    """Settled once ``need`` nodes said yes, or enough nodes answered no that they cannot.

    A node that failed settles nothing: the others are waited for (until the
    deadline), so that what answered is known when too few did.
    """

    def settled(answers: list[Any]) -> bool:
        yes = sum(1 for answer in answers if answer is not PENDING and answer)
        no = sum(1 for answer in answers if answer is not PENDING and not answer and not isinstance(answer, Failed))
        return yes >= need or (no > len(answers) - need and yes + no >= need)

    return settled


def _connect(node: RedisBackend) -> bool:
    """Open a connection to ``node`` (TCP, the driver's handshake), and look at it as its first call would."""
    with node._reaching():  # a node's error is BackendUnavailable naming it, as its lock calls' are
        client = node.client
        client.ping()
    node._inspect(client)  # its eviction policy, once per process and server
    connected.add(node.cache)
    return True


def _cause(error: Exception | None) -> str:
    """What a node that failed said: the driver's error (a node's BackendUnavailable chains it), or nothing in time."""
    if error is None:
        return "no answer in time"
    said: BaseException = error
    if isinstance(error, BackendUnavailable) and error.__cause__ is not None:
        said = error.__cause__
    return str(said) or type(said).__name__


class _LateTakes:
    """The takes of one acquire that answered after it went on: kept if it acquired, else undone.

    A kept take holds the lock on one more node (it was free there), which
    the holder's renewals and release include, and shows the acquisition's
    token; after a failed attempt it would be a partial lock, so it is given back.
    """

    def __init__(self, key: str, owner: Owner) -> None:
        self.key = key
        self.owner = owner
        self.lock = threading.Lock()
        self.acquired: bool | None = None  # not known yet
        self.token = 0
        self.waiting: list[tuple[RedisBackend, Any]] = []

    def arrived(self, node: RedisBackend, answer: Any) -> None:
        with self.lock:
            if self.acquired is None:
                self.waiting.append((node, answer))
                return
        self._settle_one(node, answer)

    def settle(self, acquired: bool, token: int = 0) -> None:
        with self.lock:
            self.acquired = acquired
            self.token = token
            waiting, self.waiting = self.waiting, []
        for node, answer in waiting:
            self._settle_one(node, answer)

    def _settle_one(self, node: RedisBackend, answer: Any) -> None:
        with contextlib.suppress(Exception):
            if self.acquired and answer and answer != self.token:
                node.raise_token(self.key, self.owner, self.token)
            elif not self.acquired and (answer or isinstance(answer, Failed)):
                # A take that failed may have taken the lock before its answer was lost.
                node.release(self.key, self.owner)


class RedlockBackend(BaseLockBackend):
    """A lock held on a majority of independent Redis servers (Redis cache aliases: django-redis or Django's own)."""

    max_key_length = RedisBackend.max_key_length
    cleanup_noun = RedisBackend.cleanup_noun
    option_names = ("CACHES",)
    location_instead = (
        "OPTIONS['CACHES'] lists the Redis caches (aliases of CACHES: django-redis or Django's own), one per Redis server: "
        "set each server's URL as its cache's LOCATION."
    )

    def __init__(self, alias: str, params: dict[str, Any]) -> None:
        super().__init__(alias, params)
        caches = self.options.get("CACHES")
        if not isinstance(caches, list | tuple) or len(caches) < 1 or not all(isinstance(c, str) for c in caches):
            raise ImproperlyConfigured(
                f"DISTLOCKS[{alias!r}]['OPTIONS']['CACHES'] must be a list of Redis cache aliases"
            )
        if len(set(caches)) != len(caches):
            raise ImproperlyConfigured(f"DISTLOCKS[{alias!r}]['OPTIONS']['CACHES'] names a cache twice")
        # The nodes are Redis backends of their own: same scripts, same keys.
        self.nodes = [RedisBackend(f"{alias}[{cache}]", {"OPTIONS": {"CACHE": cache}}) for cache in caches]
        self.quorum = len(self.nodes) // 2 + 1
        # key -> (the token of this thread's last acquisition, the nodes whose take for it never answered)
        self._unanswered: dict[str, tuple[int, frozenset[RedisBackend]]] = {}

    def _ask(
        self,
        call: Callable[[RedisBackend], Any],
        seconds: float,
        settled: Callable[[list[Any]], bool] | None = None,
        nodes: list[int] | None = None,
        late: Callable[[RedisBackend, Any], Any] | None = None,
        always: bool = False,
        key: str = "",
        lease: float = 0.0,
    ) -> list[Any]:
        """Put ``call`` to the ``nodes`` (indexes; all by default) at once; return their answers in order.

        Waits until all answered, ``settled(answers)`` or ``seconds`` passed; a
        node that raised or did not answer in time gives a false ``Failed``.
        A late answer goes to ``late(node, answer)``, in the node's worker thread.
        With ``always``, a node's worker puts ``call`` to it even after the round
        is over (a release: it must reach a node still busy with a late take),
        until the leases asked for ``key`` before have run out (see ``redlock_workers``).
        """
        asked = list(range(len(self.nodes))) if nodes is None else nodes
        round_ = Round(len(asked), settled, time.monotonic() + seconds)
        for index, node in enumerate(asked):
            submit(Call(round_, index, self.nodes[node], call, late, key, always, lease))
        answers = round_.wait()
        for answer in answers:
            if isinstance(answer, Failed) and isinstance(answer.error, ImproperlyConfigured):
                raise answer.error
        return answers

    def _answered(self, answers: list[Any]) -> None:
        answered = sum(not isinstance(answer, Failed) for answer in answers)
        if answered < self.quorum:
            raise self._unavailable(
                f"only {answered} of {len(self.nodes)} Redis nodes answer, {self.quorum} are needed", answers
            )

    def _connect(self, ttl: float) -> None:
        """Connect to the nodes this process has not reached yet, until a majority is connected, before a timed round.

        A round's deadline (``node_deadline``) and the lock's validity
        count from when the takes are sent; connecting (in a new process, the
        driver's import: a quarter of a second) must count against neither.
        The clients are made here, in the calling thread (no I/O: redis-py
        connects at the first command); each node's thread then opens its
        connection (a PING), and this waits ``CONNECT_SECONDS`` at most (or the
        round's deadline, if longer): BackendUnavailable if a majority did not answer.
        """
        cold = [index for index, node in enumerate(self.nodes) if node.cache not in connected]
        for index in cold:  # every one: a cache that is no Redis cache raises here, not only if it answers first
            self.nodes[index].client  # noqa: B018  (the imports and the client; their errors raise here)
        need = self.quorum - (len(self.nodes) - len(cold))
        if need <= 0:
            return
        answers: list[Any] = [True] * len(self.nodes)  # in the nodes' order, as _answered names them
        for index, answer in zip(
            cold,
            self._ask(_connect, max(CONNECT_SECONDS, node_deadline(ttl)), _settled(need), nodes=cold),
            strict=True,
        ):
            answers[index] = answer
        self._answered(answers)

    def _unavailable(self, what: str, answers: list[Any]) -> BackendUnavailable:
        """BackendUnavailable saying ``what``, then what each node that failed said; the first one's error chained."""
        failed = [
            (node, answer) for node, answer in zip(self.nodes, answers, strict=True) if isinstance(answer, Failed)
        ]
        said = "; ".join(f"{node.address}: {_cause(answer.error)}" for node, answer in failed)
        error = BackendUnavailable(f"Redlock {self.alias!r}: {what} ({said})", alias=self.alias)
        error.__cause__ = next((answer.error for _, answer in failed if answer.error is not None), None)
        return error

    def try_acquire(self, key: str, owner: Owner, ttl: float) -> int | None:
        self._connect(ttl)
        late = _LateTakes(key, owner)
        try:
            return self._try_acquire(key, owner, ttl, late)
        except BaseException:
            if late.acquired is None:
                # Interrupted (a signal handler raised) before the outcome was known: what
                # the nodes took, or will take, is given back, without waiting for them.
                late.settle(acquired=False)
                self._ask(lambda node: node.release(key, owner), 0.0, always=True, key=key)
            raise

    def _try_acquire(self, key: str, owner: Owner, ttl: float, late: _LateTakes) -> int | None:
        started = time.monotonic()
        deadline = node_deadline(ttl)
        # Proposing a token above every node's clock (by up to a second of skew)
        # makes the nodes give the same one, and the second round is not needed.
        least = time.time_ns() // 1000 + TOKEN_LEAD
        tokens = self._ask(
            lambda node: node.take_at_least(key, owner, ttl, least) or 0,
            deadline,
            _settled(self.quorum),
            late=late.arrived,
            key=key,
            lease=ttl,
        )
        won = {index: token for index, token in enumerate(tokens) if token}
        if len(won) >= self.quorum:
            token = max(won.values())
            agreed = self._agree(key, owner, token, won, deadline)
            validity = ttl - (time.monotonic() - started) - (ttl * 0.01 + 0.002)
            if agreed and validity > 0:
                late.settle(acquired=True, token=token)
                lost = frozenset(
                    node for node, answer in zip(self.nodes, tokens, strict=True) if isinstance(answer, Failed)
                )
                if lost:
                    self._unanswered[key] = (token, lost)
                else:
                    self._unanswered.pop(key, None)
                return token
        late.settle(acquired=False)
        # Not a majority in time: undo what was taken (or may have been), everywhere it answered.
        taken = [
            index for index, token in enumerate(tokens) if token or (token is not LATE and isinstance(token, Failed))
        ]
        if taken:
            self._ask(lambda node: node.release(key, owner), deadline, nodes=taken)
        self._answered(tokens)
        return None

    def _agree(self, key: str, owner: Owner, token: int, won: dict[int, int], deadline: float) -> bool:
        """Make the nodes that gave a smaller token show ``token`` and count on from it; True if a majority does.

        Any later majority shares a node with this one, whose counter then
        gives a larger token: tokens grow whatever majority answers next.
        """
        behind = [index for index, given in won.items() if given < token]
        need = self.quorum - (len(won) - len(behind))
        if not behind or need <= 0:
            return need <= 0
        raised = self._ask(lambda node: node.raise_token(key, owner, token), deadline, _settled(need), nodes=behind)
        return sum(bool(answer) for answer in raised) >= need

    # The ``*_token`` forms name the acquisition on each node (every node of it shows its token, see
    # ``_agree`` and ``_LateTakes``): a call that waited in a slow node's backlog, or on its connection,
    # never touches the owner's later acquisition there.

    def reenter(self, key: str, owner: Owner, ttl: float) -> bool:
        return self._majority(lambda node: node.reenter(key, owner, ttl), ttl, key, lease=ttl)

    def reenter_token(self, key: str, owner: Owner, ttl: float, token: int) -> bool:
        return self._majority(lambda node: node.reenter_token(key, owner, ttl, token), ttl, key, lease=ttl)

    def release(self, key: str, owner: Owner) -> bool:
        return self._release(lambda node: node.release(key, owner), key)

    def release_token(self, key: str, owner: Owner, token: int) -> bool:
        """Release by ``token`` on the nodes that gave it; by owner on those whose take never answered: one
        that ran after all holds the node under a token of its own (until its lease ends, else)."""
        last, lost = self._unanswered.get(key, (0, frozenset()))
        if last != token:
            lost = frozenset()
        return self._release(
            lambda node: node.release(key, owner) if node in lost else node.release_token(key, owner, token), key
        )

    def _release(self, call: Callable[[RedisBackend], bool], key: str) -> bool:
        # Also to a node busy with a take that answers late (kept): else it would hold the lock there, for nobody
        # (until the leases set there before have run out: the backlog's policy, see ``redlock_workers``).
        return self._majority(call, self.default_ttl, key, always=True)

    def extend(self, key: str, owner: Owner, ttl: float) -> bool:
        return self._majority(lambda node: node.extend(key, owner, ttl), ttl, key, lease=ttl)

    def extend_token(self, key: str, owner: Owner, ttl: float, token: int) -> bool:
        return self._majority(lambda node: node.extend_token(key, owner, ttl, token), ttl, key, lease=ttl)

    def _majority(
        self, call: Callable[[RedisBackend], bool], ttl: float, key: str, always: bool = False, lease: float = 0.0
    ) -> bool:
        answers = self._ask(call, node_deadline(ttl), _settled(self.quorum), always=always, key=key, lease=lease)
        if sum(bool(answer) for answer in answers) >= self.quorum:
            return True
        self._answered(answers)
        return False

    def wait(self, key: str, attempt: int, remaining: float | None) -> None:
        """Sleep a random while before the next attempt, so that clients do not retry in lockstep."""
        delay = random.uniform(0.002, min(0.005 * 2 ** min(attempt, 4), 0.05))
        time.sleep(delay if remaining is None else min(delay, remaining))

    def held(self) -> Iterator[LockInfo]:
        """Yield the locks held on a majority, with the token and hold count a majority of the nodes show.

        After an acquire the nodes of its majority agree on its token (see
        ``_agree``); a node that took it late shows it too once it answered.
        Without such a majority (nodes restarted meanwhile), the largest token.
        """
        seen: dict[str, list[LockInfo]] = {}
        for infos in self._ask(lambda node: list(node.held()), INSPECT_SECONDS):
            for info in infos or []:  # a node that is down shows nothing
                seen.setdefault(info.key, []).append(info)
        for infos in seen.values():
            if len(infos) >= self.quorum:
                first = infos[0]
                yield LockInfo(
                    alias=self.alias,
                    key=first.key,
                    owner=first.owner,
                    hold_count=self._shown([info.hold_count for info in infos]),
                    token=self._shown([info.token or 0 for info in infos]),
                    acquired_at=first.acquired_at,
                    expires_at=min(info.expires_at for info in infos if info.expires_at),
                )

    def _shown(self, values: list[int]) -> int:
        """The value a majority of the nodes show (a slow node may not have applied the last change yet), else the largest."""
        value, count = collections.Counter(values).most_common(1)[0]
        return value if count >= self.quorum else max(values)

    def force_release(self, key: str, token: int | None = None) -> bool:
        """Free the lock on every node (with ``token``: on every node whose hash shows that token).

        Each node compares and deletes in one script. The nodes of the
        acquisition ``held()`` showed agree on its token, so they are all freed;
        a node held by another acquisition (a newer holder) is left alone.
        With ``token``, True means that acquisition was still held: freed on a
        majority. A node where its holder's release has not landed yet is
        cleaned up too, but an acquisition released on a majority was not held.
        """
        answers = self._ask(lambda node: node.force_release(key, token), INSPECT_SECONDS)
        freed = sum(answer is True for answer in answers)
        return freed >= self.quorum if token is not None else freed > 0

    def clear_expired(self, dry_run: bool = False) -> int:
        answers = self._ask(lambda node: node.clear_expired(dry_run), INSPECT_SECONDS)
        return sum(count for count in answers if not isinstance(count, Failed))

    @property
    def address(self) -> str:
        return ", ".join(node.address for node in self.nodes)

    def ping(self) -> list[checks.CheckMessage]:
        """Raise BackendUnavailable if any node does not answer (with a majority left it still works, degraded).

        Otherwise return the nodes' warnings about their configuration.
        """
        answers = self._ask(lambda node: node.ping() or [], PING_SECONDS)
        down = sum(isinstance(answer, Failed) for answer in answers)
        if down:
            raise self._unavailable(
                f"{down} of {len(self.nodes)} Redis nodes do not answer, {self.quorum} are needed to lock", answers
            )
        return [message for found in answers for message in found]

    def check(self) -> list[checks.CheckMessage]:
        messages = [message for node in self.nodes for message in node.check()]
        if len(self.nodes) < 3:
            messages.append(
                checks.Warning(
                    f"DISTLOCKS[{self.alias!r}] runs Redlock on {len(self.nodes)} node(s): it survives no failure.",
                    hint="Use 3 or 5 independent Redis servers.",
                    id="distlocks.W003",
                )
            )
        return messages
