"""Helpers for users' tests: every lock alias in memory, and leases that run out on demand.

It reaches the backends through ``inspection`` (as the admin does), and LocMem's
test hook ``expire()``; it never takes or releases a lock itself.

Apache Curator's ``curator-test`` is the model: code that takes locks is
tested without a lock server, and a lost lock is something a test can cause.
The pytest fixtures ``distlocks_backend`` and ``expire_lock`` (``distlocks.pytest_plugin``)
wrap these.
"""

from __future__ import annotations

import contextlib
import threading
import uuid
from typing import Any

from django.test.utils import TestContextDecorator, override_settings

from distlocks import inspection
from distlocks.backends import locmem
from distlocks.handler import DEFAULT_ALIAS, locks
from distlocks.lock import DistributedLock
from distlocks.signals import lock_lost
from distlocks.watchdog import watchdog

LOCMEM_BACKEND = "distlocks.backends.locmem.LocMemBackend"


def _in_memory(configured: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """Each configured alias, and ``"default"``, as a LocMem alias on a store of its own, with its TTL and KEY_PREFIX."""
    setting: dict[str, dict[str, Any]] = {}
    for alias in {DEFAULT_ALIAS: None, **configured}:
        params = configured.get(alias)
        entry: dict[str, Any] = {"BACKEND": LOCMEM_BACKEND, "LOCATION": f"distlocks-test-{alias}-{uuid.uuid4().hex}"}
        if isinstance(params, dict):
            entry.update({key: params[key] for key in ("TTL", "KEY_PREFIX") if key in params})
        setting[alias] = entry
    return setting


class override_distlocks(TestContextDecorator):  # noqa: N801 - named like Django's override_settings
    """Swap the ``DISTLOCKS`` setting while a test runs: a decorator (of functions and TestCase classes) or a context manager.

    With no argument, every configured alias (and ``"default"``) becomes an
    in-memory ``LocMemBackend`` alias with its ``TTL`` and ``KEY_PREFIX``,
    empty at each entry, so code that names ``using="redis"`` runs without
    Redis. Given a dict, that dict is ``DISTLOCKS``. Either way the backends are
    made anew on entry and on exit. Entering returns the setting in force. In
    memory, a lock still held on exit is lost then (``lock_lost``), as if its
    lease had run out: its renewals never reach the restored backends. A lock
    held when it begins is renewed on the in-memory backend meanwhile, and lost.
    """

    def __init__(self, distlocks: dict[str, Any] | None = None) -> None:
        if distlocks is not None and not isinstance(distlocks, dict):
            raise ValueError(f"distlocks must be a DISTLOCKS dict of aliases or None, not {type(distlocks).__name__}")
        super().__init__()
        self.distlocks = distlocks
        self._entered: list[tuple[override_settings, list[str]]] = []

    def enable(self) -> dict[str, Any]:
        setting = self.distlocks
        stores: list[str] = []
        if setting is None:
            setting = _in_memory(locks.settings)
            stores = [entry["LOCATION"] for entry in setting.values()]
        override = override_settings(DISTLOCKS=setting)
        override.enable()
        locks.reset()  # also without the app's setting_changed receiver (distlocks not in INSTALLED_APPS)
        self._entered.append((override, stores))
        return setting

    def disable(self) -> None:
        override, stores = self._entered.pop()
        try:
            if stores:
                _lose_leftovers()
        finally:
            override.disable()
            locks.reset()
            for name in stores:
                locmem.forget(name)


def _lose_leftovers() -> None:
    """Expire the locks a test left held, while their aliases are still in memory.

    Renewed on the settings restored after it, they would reach real servers.
    """
    for alias in locks:
        backend = locks[alias]
        if isinstance(backend, locmem.LocMemBackend):
            for info in inspection.held_locks([alias]).locks:
                name = info.key[len(backend.key_prefix) + 1 :] if backend.key_prefix else info.key
                with contextlib.suppress(AssertionError):  # a holder that ended meanwhile is told nothing
                    _expire(backend, name, info.key, 1.0)


def expire_lock(lock: DistributedLock | str, *, using: str = DEFAULT_ALIAS, timeout: float = 5.0) -> None:
    """End the lease of a held lock on a LocMem alias now, as if its holder had not renewed it in time.

    ``lock`` is a lock object, or a name on ``using``; whichever thread holds
    it is affected. If the hold is renewed (``renew=True``, the default), its
    watchdog renews at once, finds the lease gone, marks the hold lost and sends
    ``lock_lost``: this returns once every ``lock_lost`` receiver has run, so a
    test can check the holder's reaction without sleeping. A hold taken with
    ``renew=False`` learns it at its release or re-entry (``LockLost``).
    Another thread may take the lock from now on. Raise ValueError if the
    alias is not a LocMem alias or the lock is not held.
    """
    if isinstance(lock, DistributedLock):
        name, alias, key = lock.name, lock.alias, lock.key
    elif isinstance(lock, str) and lock:
        name, alias, key = lock, using, locks[using].make_key(lock)
    else:
        raise ValueError(f"lock must be a DistributedLock or a lock name, not {lock!r}")
    backend = locks[alias]
    if not isinstance(backend, locmem.LocMemBackend):
        raise ValueError(
            f"expire_lock works on LocMem aliases, and {alias!r} is a {type(backend).__name__}: "
            "use the distlocks_backend fixture or override_distlocks()"
        )
    if not _expire(backend, name, key, timeout):
        raise ValueError(f"Lock {name!r} on {alias!r} is not held: there is no lease to end")


def _expire(backend: locmem.LocMemBackend, name: str, key: str, timeout: float) -> bool:
    """End the lease of ``key``; wait until a renewed holder was told. False if it was not held."""
    holder = inspection.holder(backend.alias, key)
    if holder is None or holder.token is None:
        return False
    alias, token = backend.alias, holder.token
    told = threading.Event()

    def on_lost(sender: Any, **kwargs: Any) -> None:
        if (kwargs["name"], kwargs["alias"], kwargs["token"]) == (name, alias, token):
            told.set()  # connected last: every receiver connected before it has run

    renewed = watchdog().renews(alias, key, token)
    lock_lost.connect(on_lost, weak=False)
    try:
        if backend.expire(key) != token or not renewed:
            return True  # released and taken again meanwhile, or nobody renews it: nobody to wait for
        if not told.wait(timeout):
            raise AssertionError(f"the holder of {name!r} on {alias!r} was not told of its loss within {timeout}s")
        return True
    finally:
        lock_lost.disconnect(on_lost)
