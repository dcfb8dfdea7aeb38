"""The names of a lock's keys in Redis: one hash tag per lock, so that all its keys share a cluster slot."""

from __future__ import annotations

import functools
import re

# A key's braces and backslashes, escaped in its hash tag: a '}' would end the tag early.
_ESCAPES = {"\\": "\\\\", "{": "\\(", "}": "\\)"}
_UNESCAPES = {escaped[1]: char for char, escaped in _ESCAPES.items()}


@functools.lru_cache(maxsize=4096)  # built at every acquire and release
def lock_hash(key: str) -> str:
    """The name of a lock's hash: the key is its hash tag, so that all the lock's keys share a cluster slot.

    Braces are escaped so that the tag always ends where the key does and is
    never empty; keys without braces or backslashes stay as they are.
    """
    if "{" in key or "}" in key or "\\" in key:
        key = "".join(_ESCAPES.get(char, char) for char in key)
    return f"distlocks:{{{key}}}"


#: The end of a read-write lock's hash name: ``lock_hash(key) + RW_SUFFIX`` (a lock's ends in "}").
RW_SUFFIX = ":rw"


def key_of(name: str) -> str:
    """The key of a lock from the name of its hash (the reverse of ``lock_hash``)."""
    tagged = name[len("distlocks:{") : -1]
    return re.sub(r"\\(.)", lambda escaped: _UNESCAPES.get(escaped[1], escaped[1]), tagged)


@functools.lru_cache(maxsize=4096)  # built at every acquire and release
def lock_keys(name: str) -> tuple[str, str, str]:
    """A lock's hash, fencing counter and waiters' queue, from the hash's name."""
    return name, f"{name}:fence", f"{name}:queue"


@functools.lru_cache(maxsize=4096)  # built at every acquire
def acquire_keys(key: str) -> tuple[str, str, str, str]:
    """The keys of the lock ``key`` as its acquire script gets them: ``lock_keys`` and the attempts voided (``strays``)."""
    name = lock_hash(key)
    return (*lock_keys(name), f"{name}:void")


@functools.lru_cache(maxsize=4096)  # built at every acquire
def rw_acquire_keys(key: str) -> tuple[str, str, str, str]:
    """The keys of the read-write lock ``key`` as its acquire script gets them (as ``acquire_keys``)."""
    name = lock_hash(key) + RW_SUFFIX
    return (*lock_keys(name), f"{name}:void")


def keys_of_lock(key: str) -> tuple[str, str, str]:
    """The hash, fencing counter and waiters' queue of the lock ``key``."""
    return lock_keys(lock_hash(key))


def keys_of_read_write_lock(key: str) -> tuple[str, str, str]:
    """The hash, fencing counter and waiters' queue of the read-write lock ``key`` (both its sides).

    The hash's name is also the slot of the lock's waits (``RedisBackend.waiter``).
    """
    return lock_keys(lock_hash(key) + RW_SUFFIX)
