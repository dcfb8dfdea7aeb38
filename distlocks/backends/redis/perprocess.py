"""Clients shared by all of a process's threads: made once per key, made anew in a forked child.

redis-py's sync clients are thread-safe (each command borrows a connection
from the pool). One per process, not one per thread, also means a thread that
ends leaves no pool of open sockets behind for the garbage collector.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable, Hashable
from typing import Any


class PerProcess:
    """This process's clients by key (tests point an alias at other servers: the key holds what they are made of)."""

    def __init__(self) -> None:
        self._made: dict[Hashable, Any] = {}
        self._lock = threading.Lock()
        os.register_at_fork(after_in_child=self._forget)  # redis-py's clients are not to be shared across a fork

    def get(self, key: Hashable, make: Callable[[], Any]) -> Any:
        found = self._made.get(key)
        if found is not None:
            return found
        with self._lock:
            found = self._made.get(key)
            if found is None:
                found = self._made[key] = make()
        return found

    def _forget(self) -> None:
        self._lock = threading.Lock()
        self._made.clear()
