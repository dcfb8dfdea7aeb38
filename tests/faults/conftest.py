from __future__ import annotations

import contextlib
import os
import signal
import socket
import threading

import pytest

import distlocks
from tests.servers import RedisServer, answers


@pytest.fixture
def own_redis(settings):
    """Return ``start(port, *server_args, **cache_options)``: a Redis of the test's own as lock alias "own".

    ``cache_options`` are the django-redis cache's OPTIONS (default: connect
    and socket timeouts of 1 and 2 s). The server may be frozen
    (``frozen(server)``), restarted or killed without disturbing other tests.
    """
    servers = []

    def start(port, *server_args, **cache_options):
        assert not answers(port), f"port {port} is taken"
        servers.append(RedisServer(port, *server_args).start())
        options = cache_options or {"SOCKET_CONNECT_TIMEOUT": 1, "SOCKET_TIMEOUT": 2}
        settings.CACHES = {
            **settings.CACHES,
            "own": {
                "BACKEND": "django_redis.cache.RedisCache",
                "LOCATION": f"redis://127.0.0.1:{port}/0",
                "OPTIONS": options,
            },
        }
        settings.DISTLOCKS = {
            **settings.DISTLOCKS,
            "own": {"BACKEND": "distlocks.backends.redis.RedisBackend", "OPTIONS": {"CACHE": "own"}},
        }
        return servers[-1]

    yield start
    for server in servers:
        with contextlib.suppress(ProcessLookupError):
            os.kill(server.process.pid, signal.SIGCONT)
        server.stop()


@contextlib.contextmanager
def frozen(server):
    """SIGSTOP ``server`` while the block runs: it accepts connections (the kernel does) but answers nothing."""
    os.kill(server.process.pid, signal.SIGSTOP)
    try:
        yield
    finally:
        os.kill(server.process.pid, signal.SIGCONT)


class FreezableProxy:
    """A TCP proxy to a server on loopback ``port``.

    ``frozen()`` passes nothing on, like a hung server; ``stalled()`` black-holes
    only the connections open now (a NAT or firewall that dropped their state)
    while new ones flow.
    """

    def __init__(self, port):
        self.target = port
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        self.flowing = threading.Event()
        self.flowing.set()
        self.sockets = [self.listener]
        self.stuck = set()  # sockets whose bytes go nowhere
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self):
        while True:
            try:
                client, _ = self.listener.accept()
            except OSError:
                return
            server = socket.create_connection(("127.0.0.1", self.target))
            self.sockets += [client, server]
            for source, sink in ((client, server), (server, client)):
                threading.Thread(target=self._pipe, args=(source, sink), daemon=True).start()

    def _pipe(self, source, sink):
        with contextlib.suppress(OSError):
            while data := source.recv(65536):
                self.flowing.wait()
                if source not in self.stuck:
                    sink.sendall(data)
        with contextlib.suppress(OSError):
            sink.shutdown(socket.SHUT_WR)

    @contextlib.contextmanager
    def frozen(self, most=10):
        """Pass nothing on while the block runs (for at most ``most`` seconds)."""
        self.flowing.clear()
        thaw = threading.Timer(most, self.flowing.set)
        thaw.start()
        try:
            yield
        finally:
            thaw.cancel()
            self.flowing.set()

    def stall(self):
        """From now on, drop whatever the connections open now carry, both ways, for good."""
        self.stuck.update(self.sockets[1:])

    def close(self):
        self.flowing.set()
        for sock in self.sockets:
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)  # wakes the pipe threads; close() alone would not
            sock.close()


def free_elsewhere(name, alias, **lock_options):
    """Whether another thread (another owner) takes the lock at once; it gives it back."""
    result = []

    def take():
        lk = distlocks.lock(name, using=alias, **lock_options)
        result.append(lk.acquire(wait=0))
        if result[0]:
            lk.release()

    thread = threading.Thread(target=take)
    thread.start()
    thread.join(30)
    return result[0]
