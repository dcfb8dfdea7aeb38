from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import threading
import time
from pathlib import Path

import pytest
from django.conf import settings
from django.db import connections
from django.test import override_settings

from distlocks.backends.db import close_connections
from localservers import RedisServer, answers

# What ``own_redis(cache=...)`` takes: the tests' caches of each kind, django-redis's and Django's own RedisCache.
REDIS_CACHES = ["redis", "redis_django"]
# django-redis's names of the OPTIONS the tests set, and redis-py's, which Django's own RedisCache takes.
REDIS_PY_NAMES = {"SOCKET_CONNECT_TIMEOUT": "socket_connect_timeout", "SOCKET_TIMEOUT": "socket_timeout"}


def cache_options(backend, options):
    """django-redis ``options`` as the cache ``backend`` takes them: as they are, or for Django's own RedisCache
    (which passes its OPTIONS to redis-py's pool) in redis-py's names, CONNECTION_POOL_KWARGS among them."""
    if backend.startswith("django_redis."):
        return options
    options = dict(options)
    pool_options = options.pop("CONNECTION_POOL_KWARGS", {})
    return {REDIS_PY_NAMES[name]: value for name, value in options.items()} | pool_options


def scripts_run(server):
    """How many scripts the Redis ``server`` (a ``RedisServer``) has run, asked on a connection of its own."""
    import redis

    with redis.Redis(port=server.port, socket_timeout=5) as client:
        return client.info("commandstats").get("cmdstat_evalsha", {}).get("calls", 0)


@pytest.fixture
def own_redis(settings):
    """Return ``start(port, *server_args, cache="redis", **options)``: a Redis of the test's own as lock
    alias "own".

    Its cache "own" has the BACKEND of the tests' cache ``cache``: "redis"
    (django-redis) or "redis_django" (Django's own RedisCache, whose client
    distlocks keeps one per process). ``options`` are written as django-redis's
    OPTIONS (default: connect and socket timeouts of 1 and 2 s) and passed to
    Django's cache in redis-py's names. The server may be frozen
    (``frozen(server)``), restarted or killed without disturbing other tests.
    """
    servers = []

    def start(port, *server_args, cache="redis", **options):
        assert not answers(port), f"port {port} is taken"
        servers.append(RedisServer(port, *server_args).start())
        backend = settings.CACHES[cache]["BACKEND"]
        settings.CACHES = {
            **settings.CACHES,
            "own": {
                "BACKEND": backend,
                "LOCATION": f"redis://127.0.0.1:{port}/0",
                "OPTIONS": cache_options(backend, options or {"SOCKET_CONNECT_TIMEOUT": 1, "SOCKET_TIMEOUT": 2}),
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
    """SIGSTOP ``server`` while the block runs: it accepts connections (the kernel does) but answers nothing.

    The block starts once every thread of the server has stopped: ``kill`` returns before they do, and on a
    loaded machine a thread of ZooKeeper's JVM still answered a request sent just after it.
    """
    os.kill(server.process.pid, signal.SIGSTOP)
    deadline = time.monotonic() + 5
    while not stopped(server.process.pid) and time.monotonic() < deadline:
        time.sleep(0.005)
    try:
        yield
    finally:
        os.kill(server.process.pid, signal.SIGCONT)


def stopped(pid):
    """Whether every thread of process ``pid`` is stopped (state T in /proc)."""
    for task in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{task}/stat") as stat:
                state = stat.read().rpartition(")")[2].split()[0]
        except FileNotFoundError:  # a thread that ended meanwhile
            continue
        if state not in ("T", "t"):
            return False
    return True


class FreezableProxy:
    """A TCP proxy to a server on loopback ``port``.

    ``frozen()`` passes nothing on, like a hung server; ``frozen_after()`` the
    same from a request on, once it has passed that request on (the server runs
    it, its answer is lost); ``stalled()`` black-holes only the connections open
    now (a NAT or firewall that dropped their state) while new ones flow. With
    ``connect_delay``, each new connection passes nothing on for that many
    seconds first (a long link's handshakes).
    """

    def __init__(self, port, connect_delay=0.0):
        self.target = port
        self.connect_delay = connect_delay
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        self.flowing = threading.Event()
        self.flowing.set()
        self.sockets = [self.listener]
        self.stuck = set()  # sockets whose bytes go nowhere
        self.freezes_after = None  # a client's request (its bytes) after which the proxy freezes
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self):
        while True:
            try:
                client, _ = self.listener.accept()
            except OSError:
                return
            if self.connect_delay:  # the next connection is accepted meanwhile
                threading.Thread(target=self._open, args=(client,), daemon=True).start()
            else:
                self._open(client)

    def _open(self, client):
        time.sleep(self.connect_delay)
        try:
            server = socket.create_connection(("127.0.0.1", self.target))
        except OSError:  # the server is gone (the test is over)
            client.close()
            return
        self.sockets += [client, server]
        for source, sink in ((client, server), (server, client)):
            threading.Thread(target=self._pipe, args=(source, sink), daemon=True).start()

    def _pipe(self, source, sink):
        from_client = source in self.sockets[1::2]
        with contextlib.suppress(OSError):
            while data := source.recv(65536):
                freezes_after = self.freezes_after
                if from_client and freezes_after is not None and freezes_after(data):
                    # Frozen before the request goes on: its answer cannot slip through first.
                    self.freezes_after = None
                    self.flowing.clear()
                else:
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

    @contextlib.contextmanager
    def frozen_after(self, request, most=10):
        """While the block runs (for at most ``most`` seconds), pass everything on until a client sends a chunk
        for which ``request(data)`` is true; pass that on, then nothing: the server runs it, its answer is held."""
        self.freezes_after = request
        thaw = threading.Timer(most, self.flowing.set)
        thaw.start()
        try:
            yield
        finally:
            self.freezes_after = None
            thaw.cancel()
            self.flowing.set()

    def stall(self):
        """From now on, drop whatever the connections open now carry, both ways, for good."""
        self.stuck.update(self.sockets[1:])

    def stall_to(self, addresses):
        """``stall()`` only the connections that the server sees coming from ``addresses`` ("ip:port")."""
        pairs = list(self.sockets[1:])
        for client, server in zip(pairs[0::2], pairs[1::2], strict=True):
            if "{}:{}".format(*server.getsockname()) in addresses:
                self.stuck.update((client, server))

    def close(self):
        self.flowing.set()
        for sock in self.sockets:
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)  # wakes the pipe threads; close() alone would not
            sock.close()


def _free_port():
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _wait_for(process, what, ready, seconds=60):
    deadline = time.monotonic() + seconds
    while not ready():
        assert process.poll() is None, f"{what} exited with {process.returncode}"
        assert time.monotonic() < deadline, f"{what} did not start within {seconds}s"
        time.sleep(0.1)


def _accepts(port):
    with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), timeout=1):
        return True
    return False


@pytest.fixture
def pgbouncer():
    """A PgBouncer of the test's own in transaction pooling mode, in front of the tests' PostgreSQL; its port.

    Every database of that server, the tests' user trusted (PgBouncer runs as
    ``nobody`` when the tests run as root: it refuses to run as root).
    """
    from django.db import connections

    database = connections["postgresql"].settings_dict
    directory = Path(tempfile.mkdtemp(prefix="distlocks-pgbouncer-"))
    port = _free_port()
    (directory / "users.txt").write_text(f'"{database["USER"]}" "{database["PASSWORD"] or ""}"\n')
    (directory / "pgbouncer.ini").write_text(
        "[databases]\n"
        f"* = host={database['HOST'] or '127.0.0.1'} port={database['PORT'] or 5432}\n"
        "[pgbouncer]\n"
        f"listen_addr = 127.0.0.1\nlisten_port = {port}\nunix_socket_dir =\n"
        f"auth_type = trust\nauth_file = {directory / 'users.txt'}\npool_mode = transaction\n"
        "ignore_startup_parameters = extra_float_digits,options\n"
    )
    for path in (directory, *directory.iterdir()):
        path.chmod(0o755)
    command = [shutil.which("pgbouncer") or "/usr/sbin/pgbouncer", str(directory / "pgbouncer.ini")]
    if os.getuid() == 0:
        command[1:1] = ["-u", "nobody"]
    process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        _wait_for(process, "pgbouncer", lambda: _accepts(port))
        yield port
    finally:
        process.terminate()
        process.wait(10)
        shutil.rmtree(directory, ignore_errors=True)


def _galera_ready(socket_path):
    """The node takes statements: it answers a ping before wsrep is ready, and then refuses them (1047)."""
    query = ["mariadb", "--no-defaults", f"--socket={socket_path}", "-uroot", "--connect-timeout=1", "-N", "-e"]
    shown = subprocess.run([*query, "SHOW STATUS LIKE 'wsrep_ready'"], capture_output=True, text=True, timeout=30)
    return shown.returncode == 0 and shown.stdout.split()[-1:] == ["ON"]


@pytest.fixture
def galera(tmp_path):
    """A one-node Galera cluster (MariaDB with the wsrep provider, bootstrapped) of the test's own; its socket."""
    data, socket_path = tmp_path / "data", tmp_path / "mariadb.sock"
    user = ["--user=root"] if os.getuid() == 0 else []
    subprocess.run(
        ["mariadb-install-db", "--no-defaults", *user, f"--datadir={data}", "--auth-root-authentication-method=normal"],
        check=True,
        capture_output=True,
        timeout=300,
    )
    command = [
        "/usr/sbin/mariadbd",
        "--no-defaults",
        *user,
        f"--datadir={data}",
        "--skip-networking",
        f"--socket={socket_path}",
        f"--pid-file={tmp_path / 'mariadb.pid'}",
        f"--log-error={tmp_path / 'error.log'}",
        "--wsrep-on=ON",
        "--wsrep-provider=/usr/lib/galera/libgalera_smm.so",
        "--wsrep-cluster-address=gcomm://",
        f"--wsrep-provider-options=gmcast.listen_addr=tcp://127.0.0.1:{_free_port()}",
        "--wsrep-node-address=127.0.0.1",
        "--binlog-format=ROW",
        "--innodb-autoinc-lock-mode=2",
    ]
    process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        _wait_for(process, "mariadbd (Galera)", lambda: _galera_ready(socket_path))
        yield str(socket_path)
    finally:
        process.terminate()
        process.wait(60)


class PostgresServer:
    """A PostgreSQL server of the test's own, from its own data directory: it can be crashed (SIGKILL) and started again.

    Runs as ``postgres`` when the tests run as root (the server refuses root).
    """

    def __init__(self, bin_dir: Path, directory: Path) -> None:
        self.bin_dir, self.data, self.port = bin_dir, directory / "data", _free_port()
        self.user = "postgres" if os.getuid() == 0 else None
        self.process: subprocess.Popen[bytes] | None = None
        initdb = [str(bin_dir / "initdb"), "-D", str(self.data), "-A", "trust", "-U", "postgres"]
        subprocess.run(initdb, user=self.user, check=True, capture_output=True, timeout=300)

    def start(self) -> None:
        command = [str(self.bin_dir / "postgres"), "-D", str(self.data), "-p", str(self.port)]
        command += ["-c", "listen_addresses=127.0.0.1", "-c", f"unix_socket_directories={self.data}"]
        self.process = subprocess.Popen(command, user=self.user, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        _wait_for(self.process, "postgres", self._answers)

    def _answers(self) -> bool:
        ready = [str(self.bin_dir / "pg_isready"), "-q", "-h", "127.0.0.1", "-p", str(self.port)]
        return subprocess.run(ready, timeout=30).returncode == 0

    def crash(self) -> None:
        """SIGKILL the postmaster and every process of the server at once: nothing is shut down cleanly."""
        assert self.process is not None
        children = [pid for pid in _pids() if _stat(pid)[1:2] == [str(self.process.pid)]]
        for pid in [self.process.pid, *children]:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        self.process.wait(30)
        for pid in children:
            while _stat(pid)[:1] not in ([], ["Z"]):  # the new postmaster must find none still using the old memory
                time.sleep(0.01)


def _pids() -> list[int]:
    return [int(entry.name) for entry in Path("/proc").iterdir() if entry.name.isdigit()]


def _stat(pid: int) -> list[str]:
    """Process ``pid``'s state and parent (``/proc/PID/stat`` after the name), or [] if it is gone."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[:2]
    except (FileNotFoundError, ProcessLookupError):
        return []


@pytest.fixture
def own_postgresql():
    """A PostgreSQL server of the test's own (see PostgresServer), started; its binaries come with Debian's postgresql."""
    found = sorted(Path("/usr/lib/postgresql").glob("*/bin/initdb"))
    if not found:
        pytest.fail(
            "no PostgreSQL server binaries under /usr/lib/postgresql: install Debian's postgresql (scripts/test.sh does)"
        )
    directory = Path(tempfile.mkdtemp(prefix="distlocks-postgresql-"))
    if os.getuid() == 0:
        shutil.chown(directory, "postgres")
    server = PostgresServer(found[-1].parent, directory)
    try:
        server.start()
        yield server
    finally:
        if server.process is not None and server.process.poll() is None:
            server.process.terminate()
            server.process.wait(60)
        shutil.rmtree(directory, ignore_errors=True)


class HandshakeOnlyProxy(FreezableProxy):
    """A proxy that lets each connection's login through, then drops all it carries from the client's first
    statement on: a server that answers the login and then hangs (or a firewall that dropped the connection)."""

    def __init__(self, port, vendor):
        self.vendor = vendor
        super().__init__(port)

    def _pipe(self, source, sink):
        if source not in self.sockets[1::2]:  # from the server
            super()._pipe(source, sink)
            return
        with contextlib.suppress(OSError):
            while data := source.recv(65536):
                if self._is_statement(data):
                    self.stuck.add(source)
                if source not in self.stuck:
                    sink.sendall(data)

    def _is_statement(self, data):
        """PostgreSQL's login messages begin with their length (a 0 byte), its statements with their type (Q,
        P...); MySQL's are packets numbered 1 and up, a statement's packet is number 0."""
        if self.vendor == "postgresql":
            return data[0] != 0
        return len(data) > 3 and data[3] == 0


@contextlib.contextmanager
def behind_proxy(alias, proxy_class=FreezableProxy, **options):
    """Yield a ``proxy_class`` to the database of lock ``alias``, and lock alias "proxied" (TIMEOUT 1 s, and any
    other ``options`` of its ``OPTIONS``) through it.

    On the way out the Django connection "proxied" is forgotten too: a later
    use of the name must not reach this proxy's closed port.
    """
    database = settings.DISTLOCKS[alias].get("OPTIONS", {}).get("DATABASE", "default")
    database_settings = dict(connections[database].settings_dict)
    proxy = proxy_class(int(database_settings["PORT"]))
    connections.settings["proxied"] = {**database_settings, "HOST": "127.0.0.1", "PORT": str(proxy.port)}
    proxied = {
        "BACKEND": settings.DISTLOCKS[alias]["BACKEND"],
        "OPTIONS": {"DATABASE": "proxied", "TIMEOUT": 1, **options},
    }
    try:
        with override_settings(DISTLOCKS={**settings.DISTLOCKS, "proxied": proxied}):
            yield proxy
    finally:
        close_connections()  # while the proxy still passes the goodbye on
        proxy.close()
        del connections.settings["proxied"]
        with contextlib.suppress(AttributeError):
            del connections["proxied"]
