"""ZooKeeper lock backend on kazoo: ephemeral sequential nodes.

Guarantees: a lock on ``name`` is the lowest of distlocks' ephemeral
sequential children (``lock-<id>-<sequence>``) of ``ROOT/<name>``; other
children (a stranger's) neither block nor hold it. A waiter watches only the
child just below its own (no herd) and gets the lock in the order it asked.
An ephemeral node lives as long as the session that created it, so a holder
that crashes or is cut off frees its lock when its session expires
(``SESSION_TIMEOUT``), not after a lease: on this backend ``ttl`` only sets how
often the watchdog checks that the node is still there (``ttl_is_lease`` is
False: a hold that cannot be checked for longer than ``ttl`` is not lost for
that, only once its session may have expired, below).

Faults: when the connection is ``SUSPENDED`` the holder cannot know whether it
still holds the lock. Its holds are checked at once and renewals fail until it
reconnects; once the negotiated session timeout has passed since the server
last heard from this process (the send time of the last answered ping or
request), the server may have expired the session and handed the lock on, so
every hold is given up (``lock_lost``, and ``LockLost`` on release) and its node
is deleted if the session comes back after all. When the session is ``LOST``
every lock held through it is lost at once. Re-entering or releasing a lock
whose node is gone (force-released) raises ``LockLost``. A node is never left to
"expire", as no lease would end it: a hold whose last release, ``drop()`` (a
thread that ended holding it) or creation could not reach the server is
deleted in the background as soon as the connection allows, and an inner
release or a failed re-entry never puts the hold count out of step.

Time: an acquire's requests share one bound, its ``wait`` plus
``CONNECT_TIMEOUT`` (each other call: ``CONNECT_TIMEOUT``), the first
connection included: a client that does not connect in time is closed in
the background and the next call starts another. kazoo's log messages
("Connection dropped", its reconnection attempts) go to the logger
``distlocks.backends.zookeeper.kazoo``, never by Python's last-resort handler
to stderr.

The fencing token is the node's creation zxid: ZooKeeper's transaction ids only
grow, across leader elections and the deletion of empty lock parents, so it is
strictly increasing per lock name (and across all of them). ``force_release``
with a token deletes exactly the node created at that zxid, never a later
holder's. A read-write lock's queue is not served in creation order (a
downgrade passes a queued writer), so a side's token is the zxid of a write
to its node made once it is let in, unless nothing happened under the lock
since its node's creation (see ``rw.ZooKeeperSide``).

Access: with ``OPTIONS['AUTH']`` (e.g. ``[("digest", "user:password")]``), lock
nodes and the parents distlocks creates get ``CREATOR_ALL_ACL`` plus world read:
only that identity can create, change or delete them. ZooKeeper checks a
deletion against the parent's ACL, and a ``ROOT`` or lock parent that existed
before keeps its own: turn ``AUTH`` on with a fresh ``ROOT``.
``OPTIONS['ACL']`` replaces that default: a list of ``kazoo.security.ACL``
(e.g. ``[make_digest_acl("user", "password", all=True)]``). Without either,
nodes are world-writable, as kazoo creates them.

Names: any name works; ``.`` and ``..`` (which ZooKeeper refuses as node names)
are stored as ``%2E`` and ``%2E%2E``, every other character as ``quote()``
escapes it.

kazoo's ``Lock`` recipe is not used: it is not reentrant, it takes 4 requests
per acquire + release where 3 do (create, list, delete), and its tokens would
have to be read separately. Reentrancy is counted here, in the process.
"""

from __future__ import annotations

from distlocks.backends.zookeeper.backend import ZooKeeperBackend

__all__ = ["ZooKeeperBackend"]
