from __future__ import annotations

import contextlib
import gc
import json
import os
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path

import pytest
from django.db import connections

import distlocks
from distlocks.backends.db import close_connections
from localservers import (
    CLUSTER_BUS_PORTS,
    CLUSTER_PORTS,
    REDIS_PORT,
    REDLOCK_PORTS,
    SENTINEL_DATA_PORTS,
    SENTINEL_PORTS,
    ZK_PORT,
    ClusterServers,
    RedisServer,
    SentinelServers,
    ZooKeeperServer,
    answers,
    zk_answers,
)
from tests.cleanup import Cleanup
from tests.zygote import Template, without_ignored

ROOT = Path(__file__).resolve().parent.parent
DB_ALIASES = ["default", "mariadb", "postgresql"]
# The native database locks (GET_LOCK, advisory locks), on the databases of DB_ALIASES.
NATIVE_ALIASES = ["mariadb_native", "postgresql_native"]
ALIASES = [*DB_ALIASES, *NATIVE_ALIASES, "redis", "redlock", "zookeeper", "locmem"]
# Backends that lock across processes. LocMem keeps its locks in one process's
# memory: the tests where other processes race or hold do not apply to it.
PROCESS_ALIASES = [alias for alias in ALIASES if alias != "locmem"]
# Backends whose locks are leases that run out after ttl (ZooKeeper's end with the session).
LEASE_ALIASES = [alias for alias in ALIASES if alias != "zookeeper"]
# Mark modules that use the database: every test runs on its own committed data.
DB = pytest.mark.django_db(transaction=True, databases=DB_ALIASES)

# The longest tests (a minute and more on a busy machine: the benchmarks, the packages, the oversell
# races) start first, so that a pass's xdist workers do not end waiting for one of them.
LONGEST_FIRST = ("tests/test_bench.py::", "tests/test_packaging.py::", "tests/test_commands.py::")


def pytest_collection_modifyitems(items):
    items.sort(key=lambda item: not item.nodeid.startswith(LONGEST_FIRST))  # stable: the rest keep their order


# The servers that the lock aliases of the ``alias`` parametrisation need.
ALIAS_SERVERS = {
    "redis": "redis",
    "redlock": "redis",
    "zookeeper": "zookeeper",
    "cluster": "cluster",
    "sentinel": "sentinel",
}
SERVER_FIXTURES = {
    "redis": "redis_servers",
    "zookeeper": "zookeeper_server",
    "cluster": "redis_cluster",
    "sentinel": "redis_sentinel",
}


@pytest.fixture(autouse=True)
def _servers(request):
    """Start (once a session) the servers this test needs: its ``alias``'s, and those its ``servers`` marker names.

    So a test of SQLite alone starts no Redis and no JVM.
    """
    needed = {name for marker in request.node.iter_markers("servers") for name in marker.args}
    callspec = getattr(request.node, "callspec", None)
    if callspec is not None and callspec.params.get("alias") in ALIAS_SERVERS:
        needed.add(ALIAS_SERVERS[callspec.params["alias"]])
    for server in sorted(needed):
        request.getfixturevalue(SERVER_FIXTURES[server])


@pytest.fixture(scope="session")
def redis_servers():
    """The tests' Redis servers on loopback ports of their own: one, and five Redlock nodes."""
    taken = [port for port in [REDIS_PORT, *REDLOCK_PORTS] if answers(port)]
    assert not taken, f"something already answers on port(s) {taken}: stop it, or set DISTLOCKS_TEST_REDIS_PORT"
    main = RedisServer(REDIS_PORT).start()
    nodes = [RedisServer(port).start() for port in REDLOCK_PORTS]
    yield nodes
    for server in [main, *nodes]:
        server.stop()


@pytest.fixture(scope="session")
def redis_cluster(tmp_path_factory):
    """The tests' Redis Cluster (3 primaries, a replica each) on loopback ports of their own: lock alias "cluster"."""
    taken = [port for port in CLUSTER_PORTS if answers(port)]
    assert not taken, f"something already answers on port(s) {taken}: stop it, or set DISTLOCKS_TEST_REDIS_PORT"
    cluster = ClusterServers(CLUSTER_PORTS, CLUSTER_BUS_PORTS, str(tmp_path_factory.mktemp("cluster"))).start()
    yield cluster
    cluster.stop()


@pytest.fixture
def cluster_alias(monkeypatch, settings):
    """The lock alias "cluster" on the tests' Redis Cluster, here and in the worker processes the test starts."""
    from tests.settings import CLUSTER_LOCKS

    monkeypatch.setenv("DISTLOCKS_TEST_CLUSTER", "1")
    settings.DISTLOCKS = {**settings.DISTLOCKS, "cluster": CLUSTER_LOCKS}
    return "cluster"


@pytest.fixture(scope="session")
def redis_sentinel(tmp_path_factory):
    """The tests' Sentinel group (a master, two replicas, three sentinels) on loopback ports of their own: lock
    alias "sentinel". A test that fails it over uses ``sentinel_group``, which restores it."""
    taken = [port for port in [*SENTINEL_DATA_PORTS, *SENTINEL_PORTS] if answers(port)]
    assert not taken, f"something already answers on port(s) {taken}: stop it, or set DISTLOCKS_TEST_REDIS_PORT"
    group = SentinelServers(SENTINEL_DATA_PORTS, SENTINEL_PORTS, str(tmp_path_factory.mktemp("sentinel"))).start()
    yield group
    group.stop()


@pytest.fixture
def sentinel_group(redis_sentinel):
    """The tests' Sentinel group, for a test that fails it over or stops its servers: whole and ready again after."""
    redis_sentinel.wait_ready()
    yield redis_sentinel
    redis_sentinel.restore()


@pytest.fixture
def sentinel_alias(monkeypatch, settings):
    """The lock alias "sentinel" on the tests' Sentinel group, here and in the worker processes the test starts."""
    from tests.settings import SENTINEL_LOCKS

    monkeypatch.setenv("DISTLOCKS_TEST_SENTINEL", "1")
    settings.DISTLOCKS = {**settings.DISTLOCKS, "sentinel": SENTINEL_LOCKS}
    return "sentinel"


def on_each_primary(cluster, name):
    """A lock name of ``name``'s whose hash lies on each primary of ``cluster`` now: {port: name}."""
    from redis.crc import key_slot

    from distlocks.backends.redis.keys import lock_hash
    from distlocks.handler import locks

    served = cluster.primaries()
    found = {}
    backend = locks["cluster"]
    for i in range(10_000):
        candidate = f"{name}-{i}"
        slot = key_slot(lock_hash(backend.make_key(candidate)).encode())
        port = next(port for port, ranges in served.items() if any(a <= slot <= b for a, b in ranges))
        found.setdefault(port, candidate)
        if len(found) == len(served):
            return found
    raise AssertionError("no name found for some primary")


@pytest.fixture(scope="session")
def zookeeper_server(tmp_path_factory):
    """The tests' standalone ZooKeeper, on a loopback port of its own."""
    assert not zk_answers(ZK_PORT), (
        f"something already answers on port {ZK_PORT}: stop it, or set DISTLOCKS_TEST_ZK_PORT"
    )
    server = ZooKeeperServer(ZK_PORT, str(tmp_path_factory.mktemp("zookeeper"))).start()
    yield server
    server.stop()


@pytest.fixture(params=ALIASES)
def alias(request):
    """Each configured lock alias; the module must be marked ``DB`` for the databases."""
    request.getfixturevalue("transactional_db")
    return request.param


@pytest.fixture(scope="session", autouse=True)
def _empty_only_what_tests_wrote():
    """Between transactional tests, empty the tables a test wrote to instead of flushing every database (cleanup.py)."""
    from django.test import TransactionTestCase

    flush = TransactionTestCase._fixture_teardown
    cleanup = Cleanup(flush)
    TransactionTestCase._fixture_teardown = lambda test_case: cleanup.teardown(test_case)
    yield
    TransactionTestCase._fixture_teardown = flush


@pytest.fixture(scope="session", autouse=True)
def _freeze_what_the_session_keeps():
    """Leave what exists before the first test (modules, classes, the collected tests) out of later collections.

    ``_collect_garbage`` then looks only at the newer objects: some 10 ms a test instead of 100.
    """
    gc.collect()
    gc.freeze()
    yield
    gc.unfreeze()


@pytest.fixture(autouse=True)
def _collect_garbage(request):
    """Collect the test's garbage in its own teardown: a pipe or socket it left open is then a ResourceWarning
    (an error) of this test, not of whichever later test a collection happens to run in.

    The test's fixture values stay referenced until its teardown ends: let go of them first.
    """
    yield
    request.node.funcargs.clear()
    gc.collect()


def wait_until(condition, timeout=15.0):
    """Poll ``condition`` until it is true; fail after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.02)


def taken_by_another_thread(lock, wait=0):
    """Whether another thread (another owner) takes ``lock`` within ``wait`` seconds (0: at once); it gives back
    what it took."""
    taken = []

    def take():
        taken.append(lock.acquire(wait=wait))
        if taken[0]:
            lock.release()

    thread = threading.Thread(target=take)
    thread.start()
    thread.join(wait + 30)
    assert taken, f"the other thread's acquire(wait={wait}) did not return within {wait + 30} s"
    return taken[0]


@pytest.fixture(autouse=True)
def _close_lock_connections():
    # Lock connections live as long as their thread; the test databases can only
    # be dropped once they are closed.
    yield
    close_connections()


@pytest.fixture
def name():
    """A lock name of this test's own."""
    return f"test-{uuid.uuid4().hex}"


def worker_env():
    env = dict(os.environ)
    env["DJANGO_SETTINGS_MODULE"] = "tests.settings"
    env["DISTLOCKS_TEST_DATABASES"] = json.dumps({a: str(connections[a].settings_dict["NAME"]) for a in DB_ALIASES})
    env["DISTLOCKS_DB_NAME"] = str(connections["default"].settings_dict["NAME"])
    return env


# The templates that fork the tests.worker processes of this pytest process (tests/zygote.py), by
# environment: a test that changes os.environ gets one of its own, a few at most.
_templates: dict[frozenset, Template] = {}


def _template(env):
    key = frozenset(without_ignored(env).items())
    template = _templates.get(key)
    if template is None or template.process.poll() is not None:
        if template is None and len(_templates) >= 3:
            return None
        template = _templates[key] = Template(env)
    return template


@pytest.fixture(scope="session", autouse=True)
def _stop_the_templates():
    yield
    for template in _templates.values():
        template.stop()


class Worker:
    """A ``tests.worker`` process, read line by line.

    Forked from the template that has imported it already (tests/zygote.py), unless
    it needs a fresh interpreter: a ``prefix`` command, ``fresh=True`` (a test of
    what a new process does first), or an environment other than the template's.
    """

    def __init__(self, *arguments, prefix=(), fresh=False):
        arguments = [str(argument) for argument in arguments]
        env = worker_env()
        template = None if prefix or fresh else _template(env)
        forked = template.spawn(arguments, env) if template else None
        self.process = forked or subprocess.Popen(
            [*prefix, sys.executable, "-m", "tests.worker", *arguments],
            cwd=ROOT,
            env=env,
            stdout=subprocess.PIPE,
            text=True,
        )

    def line(self):
        line = self.process.stdout.readline()
        assert line, f"worker exited with {self.process.wait()} before answering"
        return line.split()

    def finish(self, timeout=120):
        out, _ = self.process.communicate(timeout=timeout)
        assert self.process.returncode == 0, out
        return out.split()

    def kill(self):
        """SIGKILL the worker (a no-op once it has ended), reap it and close its pipe.

        Left to the garbage collector, an open pipe is a ResourceWarning in
        whichever later test the collection happens to run.
        """
        self.process.kill()
        self.process.wait()
        self.process.stdout.close()


@pytest.fixture
def workers():
    started = []

    def start(*arguments, fresh=False):
        worker = Worker(*arguments, fresh=fresh)
        started.append(worker)
        return worker

    yield start
    for worker in started:  # those that ended by themselves too: their pipes are still open
        worker.kill()


@pytest.fixture
def leave_nothing(alias, name):
    """Force-release what the test left held under its name (killed workers' locks, a semaphore's permits record).

    Other tests list every held lock of an alias: they must find none of this test's.
    """
    yield
    from distlocks.inspection import force_release, held_locks

    for info in held_locks([alias]).locks:
        if name in info.key:
            force_release(alias, info.key, kind=info.kind)
    record = distlocks.semaphore(name, 1, using=alias).marker  # a lease held by nobody: not listed
    if not record.session_bound:
        force_release(alias, record.key)


@pytest.fixture
def lock_factory(alias, name):
    """Make locks on this test's alias and name; release what the test left held."""
    made = []

    def make(lock_name=None, **kwargs):
        lk = distlocks.lock(lock_name or name, using=alias, **kwargs)
        made.append(lk)
        return lk

    yield make
    for lk in made:
        while lk.hold_count:
            with contextlib.suppress(distlocks.LockError):
                lk.release()


def queue_waiters(name, alias, labels, *, gap, hold=0.0, queued=None):
    """Start one thread per label that waits for the lock, in this order, ``gap`` seconds apart.

    With ``queued`` (a function of how many are started), each is started once
    ``queued(started)`` is true: the ones before are in the queue. Return
    (threads, order): each thread appends its label to ``order`` once it holds
    the lock, then keeps it ``hold`` seconds.
    """
    order = []

    def wait_then_hold(label):
        with distlocks.lock(name, using=alias, wait=20):
            order.append(label)
            time.sleep(hold)

    threads = []
    for label in labels:
        thread = threading.Thread(target=wait_then_hold, args=(label,))
        thread.start()
        threads.append(thread)
        time.sleep(gap)
        deadline = time.monotonic() + 30
        while queued is not None and not queued(len(threads)):
            assert time.monotonic() < deadline, f"{label} did not queue in time"
            time.sleep(0.01)
    return threads, order


class Holder:
    """Hold a lock (or ``lock``, any kind) in a thread of its own until ``release()``, which returns what releasing raised."""

    def __init__(self, name, alias="default", thread_name=None, lock=None, **kwargs):
        self.lock = lock or distlocks.lock(name, using=alias, **kwargs)
        self.acquired = threading.Event()
        self.go = threading.Event()
        self.error = None
        self.token = None
        self.thread = threading.Thread(target=self._run, name=thread_name or f"holder-{name}")
        self.thread.start()
        assert self.acquired.wait(30), "the holder thread did not get the lock"

    def _run(self):
        self.lock.acquire()
        self.token = self.lock.token
        self.acquired.set()
        self.go.wait(60)
        try:
            self.lock.release()
        except distlocks.LockError as exc:
            self.error = exc

    def release(self):
        self.go.set()
        self.thread.join(30)
        assert not self.thread.is_alive()
        return self.error


def guarded_events(log):
    """The events ``tests.worker guarded`` processes wrote to ``log``, checked for mutual exclusion.

    Each "enter" must be followed by the same process's "exit": no two processes inside at once.
    The tokens of the entries (in the order they were taken) must strictly increase.
    """
    events = [line.split() for line in log.read_text().splitlines()]
    inside = None
    last_token = 0
    for event, pid, *rest in events:
        if event == "enter":
            assert inside is None, f"{pid} entered while {inside} was inside"
            inside = pid
            token = int(rest[1])
            assert token > last_token, f"{pid} entered with token {token} after token {last_token}"
            last_token = token
        elif event == "exit":
            assert inside == pid
            inside = None
    return events
