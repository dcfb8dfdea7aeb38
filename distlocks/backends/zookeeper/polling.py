"""kazoo's threading handler, waiting on its sockets with one ``poll(2)`` call.

kazoo's connection thread waits before each read and write of a request
(about 15 times in an acquire + release). Its handler's ``select`` makes a
new epoll object each time: create it, register each socket, wait, close it,
five system calls where ``poll`` makes one. Neither has select(2)'s limit on
file descriptor numbers.
"""

from __future__ import annotations

import select
from collections.abc import Sequence
from typing import Any

from kazoo.handlers.threading import SequentialThreadingHandler
from kazoo.handlers.utils import fileobj_to_fd

# What makes a socket count as ready to read, and to write: as the selectors module counts an epoll event, an
# error or a hang-up counts as both, so that the read or write that follows meets it.
_READABLE = select.POLLIN | select.POLLPRI | select.POLLERR | select.POLLHUP
_WRITABLE = select.POLLOUT | select.POLLERR | select.POLLHUP


class PollingHandler(SequentialThreadingHandler):
    """``SequentialThreadingHandler`` whose ``select`` is one ``poll``: same answers, a fifth of the system calls."""

    def select(
        self, rlist: Sequence[Any], wlist: Sequence[Any], xlist: Sequence[Any], timeout: float | None = None
    ) -> tuple[list[Any], list[Any], list[Any]]:
        if timeout is not None and timeout < 0:
            raise ValueError("timeout must be non-negative")
        wanted: dict[int, int] = {}
        for objects, mask in ((rlist, select.POLLIN | select.POLLPRI), (wlist, select.POLLOUT)):
            for fileobj in objects:
                fd = fileobj_to_fd(fileobj)
                wanted[fd] = wanted.get(fd, 0) | mask
        poller = select.poll()
        for fd, mask in wanted.items():
            poller.register(fd, mask)
        ready = dict(poller.poll(None if timeout is None else timeout * 1000))
        if any(events & select.POLLNVAL for events in ready.values()):
            raise ValueError("Invalid event mask or fd")  # a closed socket, as kazoo's own select raises
        readable = [obj for obj in rlist if ready.get(fileobj_to_fd(obj), 0) & _READABLE]
        writable = [obj for obj in wlist if ready.get(fileobj_to_fd(obj), 0) & _WRITABLE]
        return readable, writable, []
