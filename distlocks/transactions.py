"""Run a release once the database transactions open now have ended: committed or rolled back.

Releasing a lock inside ``transaction.atomic()`` before the commit lets the
next holder read the data as it was before this holder's uncommitted writes
(the classic mistake); ``distlocks.lock(..., until="commit")`` and the view
decorator defer their release to here.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable

from django.db import connections


class _TransactionEnd:
    """The ``on_commit`` callback of one transaction; it also notices a rollback.

    Django has no rollback hook, but it drops the ``on_commit`` callbacks of a
    transaction (or savepoint) that rolls back, or of a connection closed in
    one: CPython then frees this object at once, and its finalizer reports the end.
    """

    def __init__(self, ended: Callable[[bool], None]) -> None:
        self._finalizer = weakref.finalize(self, ended, False)
        self._finalizer.atexit = False  # an interpreter that exits mid-transaction releases nothing

    def __call__(self) -> None:
        detached = self._finalizer.detach()
        if detached is not None:
            _, ended, _, _ = detached
            ended(True)


def after_transactions(release: Callable[[bool], None]) -> bool:
    """Call ``release(committed)`` once every transaction open in this thread has ended.

    Return False, calling nothing, when no transaction is open: the caller
    releases at once. ``committed`` is True if any of them committed.
    """
    open_now = [db for db in connections.all(initialized_only=True) if db.in_atomic_block]
    if not open_now:
        return False
    waiting = len(open_now)
    committed = False

    def ended(this_committed: bool) -> None:
        nonlocal waiting, committed
        waiting -= 1
        committed = committed or this_committed
        if waiting == 0:
            release(committed)

    for db in open_now:
        db.on_commit(_TransactionEnd(ended))
    return True
