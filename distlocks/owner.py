"""Who holds a lock: host, pid and thread, plus a per-thread secret."""

from __future__ import annotations

import os
import secrets
import socket
import threading
from dataclasses import dataclass

_local = threading.local()


@dataclass(frozen=True)
class Owner:
    """The identity of the calling thread, as a backend records it.

    ``secret`` is random per thread and per process (regenerated after fork), so
    a reused pid in another container or a reused thread id is never mistaken for
    the owner, and nobody can release a lock without holding the secret.
    """

    host: str
    pid: int
    thread: str
    secret: str

    def __str__(self) -> str:
        return f"{self.host}:{self.pid}:{self.thread}"


def current_owner() -> Owner:
    """Return the calling thread's owner identity."""
    owner: Owner | None = getattr(_local, "owner", None)
    if owner is None or owner.pid != os.getpid():
        thread = threading.current_thread()
        owner = Owner(
            host=socket.gethostname(),
            pid=os.getpid(),
            thread=f"{thread.name}/{thread.ident}",
            secret=secrets.token_hex(16),
        )
        _local.owner = owner
    return owner
