"""The Redis and ZooKeeper servers that the tests and the benchmarks start for themselves, on loopback ports
(nothing kept on disk). A module of its own, so that ``bench/`` need not import from ``tests/``."""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import time
from typing import Any


def _worker_offset() -> int:
    """Each pytest-xdist worker (gw0, gw1, ...) starts servers of its own, 500 ports above the last one's.

    A worker's tests use the ports from REDIS_PORT and ZK_PORT up to +104 and +349; with up to
    seven workers the ZooKeeper ports stay below the Redis ones. The processes the tests start
    inherit PYTEST_XDIST_WORKER, so they reach their worker's servers.
    """
    return 500 * int(os.environ.get("PYTEST_XDIST_WORKER", "gw0").removeprefix("gw"))


REDIS_PORT = int(os.environ.get("DISTLOCKS_TEST_REDIS_PORT", "16379")) + _worker_offset()
# The Redlock nodes: five independent servers on the next ports.
REDLOCK_PORTS = [REDIS_PORT + 1 + i for i in range(5)]


def redis_url(port: int = REDIS_PORT) -> str:
    return f"redis://127.0.0.1:{port}/0"


def answers(port: int) -> bool:
    # Imported here, not at the top: the test settings import this module, and a new process's
    # first Redlock acquire must pay for ``import redis`` as a user's process does.
    import redis
    from redis.backoff import NoBackoff
    from redis.retry import Retry

    try:  # no retries: redis-py 8 retries a refused connection for seconds by default
        return bool(redis.Redis(port=port, socket_connect_timeout=0.2, retry=Retry(NoBackoff(), 0)).ping())
    except redis.AuthenticationError:  # a Redis with a password (--requirepass) answers too
        return True
    except redis.RedisError:
        return False


class RedisServer:
    """A ``redis-server`` on 127.0.0.1:``port``, stopped by pid."""

    def __init__(self, port: int, *options: str, config: str = "") -> None:
        self.port = port
        self.options = options  # more redis-server options, such as "--dir", path
        self.config = config  # a configuration file (a sentinel's: it needs one)
        self.process: subprocess.Popen[bytes] | None = None

    def start(self) -> RedisServer:
        binary = shutil.which("redis-server") or "/usr/bin/redis-server"
        command = [binary, *([self.config] if self.config else []), "--bind", "127.0.0.1", "--port", str(self.port)]
        command += ["--save", "", "--appendonly", "no", *self.options]
        self.process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 10
        while not answers(self.port):
            if self.process.poll() is not None or time.monotonic() > deadline:
                self.stop()  # reaped now, not left to the garbage collector
                raise RuntimeError(f"redis-server did not start on port {self.port}")
            time.sleep(0.05)
        return self

    def stop(self) -> None:
        if self.process is not None:
            self.process.terminate()
            self.process.wait(10)
            self.process = None

    def restart(self) -> None:
        self.stop()
        self.start()


# The Redis Cluster of the cluster tests: three primaries and their replicas, and the ports of their cluster bus.
CLUSTER_PORTS = [REDIS_PORT + 110 + i for i in range(6)]
CLUSTER_BUS_PORTS = [REDIS_PORT + 120 + i for i in range(6)]


def cluster_info(port: int) -> dict[str, str]:
    """``CLUSTER INFO`` of the node on ``port`` ({} if it does not answer)."""
    import redis

    try:
        info = redis.Redis(port=port, socket_timeout=1, socket_connect_timeout=0.2).cluster("INFO")
    except redis.RedisError:
        return {}
    return {str(name): str(value) for name, value in info.items()}  # redis-py parses it


class ClusterServers:
    """A Redis Cluster on loopback ports: ``len(ports) / 2`` primaries with one replica each, made by
    ``redis-cli --cluster create`` (nodes' files in ``directory``), stopped by pid."""

    def __init__(self, ports: list[int], bus_ports: list[int], directory: str) -> None:
        self.directory = directory
        # A dead primary's replica takes over within seconds; replicas are in sync at once, not after 5 s.
        options = ["--cluster-enabled", "yes", "--cluster-node-timeout", "1000", "--repl-diskless-sync-delay", "0"]
        self.servers = [
            RedisServer(
                port,
                *options,
                "--cluster-port",
                str(bus),
                "--cluster-config-file",
                f"nodes-{port}.conf",
                "--dir",
                directory,
            )
            for port, bus in zip(ports, bus_ports, strict=True)
        ]

    def start(self) -> ClusterServers:
        try:
            for server in self.servers:
                server.start()
            binary = shutil.which("redis-cli") or "/usr/bin/redis-cli"
            nodes = [f"127.0.0.1:{server.port}" for server in self.servers]
            subprocess.run(
                [binary, "--cluster", "create", *nodes, "--cluster-replicas", "1", "--cluster-yes"],
                check=True,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.PIPE,
                timeout=60,
            )
            self.wait_ready()
        except BaseException:
            self.stop()
            raise
        return self

    def wait_ready(self, timeout: float = 30) -> None:
        """Wait until every live node says ``cluster_state:ok`` and every primary has a replica in sync."""
        deadline = time.monotonic() + timeout
        while not self.ready():
            if time.monotonic() > deadline:
                raise RuntimeError(f"the Redis Cluster on {[s.port for s in self.servers]} did not become ready")
            time.sleep(0.05)

    def ready(self) -> bool:
        import redis

        live = [server for server in self.servers if server.process is not None]
        if not all(cluster_info(server.port).get("cluster_state") == "ok" for server in live):
            return False
        for server in live:
            try:
                replication = redis.Redis(port=server.port, socket_timeout=1).info("replication")
            except redis.RedisError:
                return False
            if replication.get("role") == "slave" and replication.get("master_link_status") != "up":
                return False
        return True

    def primaries(self) -> dict[int, list[tuple[int, int]]]:
        """The port of each primary and the ranges of slots it serves, as the first live node that answers says."""
        import redis

        for server in self.servers:
            if server.process is None:
                continue
            try:
                slots = redis.Redis(port=server.port, socket_timeout=1).execute_command("CLUSTER SLOTS")
            except redis.RedisError:
                continue
            served: dict[int, list[tuple[int, int]]] = {}
            for first, last, primary, *_ in slots:
                served.setdefault(int(primary[1]), []).append((int(first), int(last)))
            return served
        raise RuntimeError("no node of the cluster answers")

    def primary_of(self, key: str) -> RedisServer:
        """The server that is the primary of ``key``'s slot now."""
        from redis.crc import key_slot

        slot = key_slot(key.encode())
        for port, ranges in self.primaries().items():
            if any(first <= slot <= last for first, last in ranges):
                return next(server for server in self.servers if server.port == port)
        raise RuntimeError(f"no node serves the slot of {key!r}")

    def replica_of(self, primary: RedisServer) -> RedisServer:
        """The server that replicates ``primary`` now."""
        import redis

        nodes = redis.Redis(port=primary.port, socket_timeout=1).cluster("NODES")
        me = next(node for node in nodes.values() if "myself" in node["flags"])
        port = next(int(address.split(":")[1]) for address, n in nodes.items() if n["master_id"] == me["node_id"])
        return next(server for server in self.servers if server.port == port)

    def wait_synced(self, primary: RedisServer, timeout: float = 10) -> None:
        """Wait until ``primary``'s replica has every write it made so far."""
        import redis

        client = redis.Redis(port=primary.port, socket_timeout=1)
        deadline = time.monotonic() + timeout
        while True:
            info = client.info("replication")
            if info.get("slave0", {}).get("offset") == info["master_repl_offset"]:
                return
            if time.monotonic() > deadline:
                raise RuntimeError(f"the replica of {primary.port} did not catch up")
            time.sleep(0.01)

    def move_slot(self, slot: int, to: RedisServer) -> None:
        """Move ``slot`` and its keys to the primary ``to``, as ``redis-cli --cluster reshard`` does."""
        import redis

        def node(server: RedisServer) -> redis.Redis:
            return redis.Redis(port=server.port, socket_timeout=5)

        source = next(s for s in self.servers if any(a <= slot <= b for a, b in self.primaries().get(s.port, [])))
        source_id, to_id = node(source).cluster("MYID"), node(to).cluster("MYID")
        node(to).cluster("SETSLOT", slot, "IMPORTING", source_id)
        node(source).cluster("SETSLOT", slot, "MIGRATING", to_id)
        while keys := node(source).cluster("GETKEYSINSLOT", slot, 100):
            node(source).migrate("127.0.0.1", to.port, keys, 0, 5000)
        others = [s for s in self.servers if s.port in self.primaries() and s not in (to, source)]
        for server in [to, source, *others]:  # once each: a node told again drops the slot's subscribers
            node(server).cluster("SETSLOT", slot, "NODE", to_id)

    def stop(self) -> None:
        for server in self.servers:
            server.stop()


# The Sentinel group of the Sentinel tests: a master, two replicas and three sentinels.
SENTINEL_DATA_PORTS = [REDIS_PORT + 130 + i for i in range(3)]
SENTINEL_PORTS = [REDIS_PORT + 133 + i for i in range(3)]
SENTINEL_SERVICE = "distlocks"
# Sentinels' timings: a master silent this long is down, and a failover takes a second or two.
SENTINEL_DOWN_AFTER_MS = 800
SENTINEL_FAILOVER_TIMEOUT_MS = 2000
# Redis 7's SENTINEL DEBUG: how often a sentinel asks INFO, says hello, and how long it stays in TILT after its
# timer jumped (a busy machine): defaults of 10 s, 2 s and 30 s would make the group slow to see changes.
SENTINEL_DEBUG = ["info-period", "250", "publish-period", "250", "ping-period", "200", "tilt-period", "1000"]


class SentinelServers:
    """A Redis Sentinel group on loopback ports: a master, replicas and sentinels monitoring them as
    ``SENTINEL_SERVICE``, each sentinel's configuration (in ``directory``) naming the others, so that it is ready at
    once. Stopped by pid."""

    def __init__(self, data_ports: list[int], sentinel_ports: list[int], directory: str) -> None:
        self.directory = directory
        self.data_ports = data_ports
        self.servers = [self._data_server(port, None if i == 0 else data_ports[0]) for i, port in enumerate(data_ports)]
        self.sentinels = [
            RedisServer(port, "--sentinel", config=self._sentinel_config(port, sentinel_ports))
            for port in sentinel_ports
        ]

    def _data_server(self, port: int, master: int | None) -> RedisServer:
        directory = os.path.join(self.directory, str(port))
        os.makedirs(directory, exist_ok=True)
        # No wait for more replicas before a full sync (5 s by default).
        options = ["--dir", directory, "--repl-diskless-sync-delay", "0"]
        return RedisServer(port, *options, *(["--replicaof", "127.0.0.1", str(master)] if master else []))

    def _sentinel_config(self, port: int, ports: list[int]) -> str:
        path = os.path.join(self.directory, f"sentinel-{port}.conf")
        service, master = SENTINEL_SERVICE, self.data_ports[0]
        lines = [
            f"dir {self.directory}",
            f"logfile {os.path.join(self.directory, f'sentinel-{port}.log')}",  # what it saw, when a test fails
            f"sentinel myid {port:040x}",
            f"sentinel monitor {service} 127.0.0.1 {master} 2",
            f"sentinel down-after-milliseconds {service} {SENTINEL_DOWN_AFTER_MS}",
            f"sentinel failover-timeout {service} {SENTINEL_FAILOVER_TIMEOUT_MS}",
            *(f"sentinel known-replica {service} 127.0.0.1 {replica}" for replica in self.data_ports[1:]),
            *(f"sentinel known-sentinel {service} 127.0.0.1 {other} {other:040x}" for other in ports if other != port),
        ]
        with open(path, "w") as file:  # the sentinel rewrites it as it learns
            file.write("\n".join(lines) + "\n")
        return path

    def start(self) -> SentinelServers:
        try:
            for server in [*self.servers, *self.sentinels]:
                server.start()
            for sentinel in self.sentinels:
                self.sentinel(sentinel).execute_command("SENTINEL DEBUG", *SENTINEL_DEBUG)
            self.wait_ready()
        except BaseException:
            self.stop()
            raise
        return self

    def sentinel(self, server: RedisServer) -> Any:
        import redis

        return redis.Redis(port=server.port, socket_timeout=2, socket_connect_timeout=0.5)

    def client(self, server: RedisServer) -> Any:
        import redis

        return redis.Redis(port=server.port, socket_timeout=2, socket_connect_timeout=0.5)

    def master(self) -> RedisServer:
        """The data server that the sentinels agree is the master now (RuntimeError if they do not agree)."""
        ports = set()
        for sentinel in self.sentinels:
            if sentinel.process is not None:
                ports.add(int(self.sentinel(sentinel).sentinel_get_master_addr_by_name(SENTINEL_SERVICE)[1]))
        if len(ports) != 1:
            raise RuntimeError(f"the sentinels name masters {sorted(ports)}")
        [port] = ports
        return next(server for server in self.servers if server.port == port)

    def _live_master(self) -> RedisServer | None:
        import redis

        try:
            master = self.master()
        except (redis.RedisError, RuntimeError):
            return None
        return master if master.process is not None else None

    def replicas(self) -> list[RedisServer]:
        master = self.master()
        return [server for server in self.servers if server is not master]

    def wait_ready(self, timeout: float = 30) -> None:
        """Wait until every sentinel names one master that every replica follows, in sync, and sees them all up."""
        deadline = time.monotonic() + timeout
        while not self.ready():
            if time.monotonic() > deadline:
                raise RuntimeError(f"the Sentinel group on {self.data_ports} did not become ready")
            time.sleep(0.05)

    def ready(self) -> bool:
        import redis

        try:
            master = self.master()
            offset = self.client(master).info("replication")["master_repl_offset"]
            for replica in self.replicas():
                info = self.client(replica).info("replication")
                if (info.get("master_port"), info.get("master_link_status")) != (master.port, "up"):
                    return False
                if info.get("slave_repl_offset", -1) < offset:
                    return False
            for sentinel in self.sentinels:
                client = self.sentinel(sentinel)
                state = client.sentinel_master(SENTINEL_SERVICE)
                if state["flags"] != "master" or state["num-other-sentinels"] != len(self.sentinels) - 1:
                    return False
                # A master demoted a moment ago: the sentinels would fail it over.
                if state["role-reported"] != "master":
                    return False
                seen = client.sentinel_slaves(SENTINEL_SERVICE)
                up = {int(replica["port"]) for replica in seen if replica["flags"] == "slave"}
                if up != {replica.port for replica in self.replicas()}:
                    return False
        except (redis.RedisError, RuntimeError, KeyError, StopIteration):
            return False
        return True

    def kill(self, server: RedisServer) -> None:
        """SIGKILL ``server`` (a data server): no chance to answer or to flush anything."""
        assert server.process is not None
        server.process.kill()
        server.process.wait()
        server.process = None

    def restore(self) -> None:
        """Go on with every frozen server, start every stopped sentinel and data server again (the latter as a replica
        of the master now), and wait until the group is ready."""
        for server in [*self.sentinels, *self.servers]:
            if server.process is not None:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(server.process.pid, signal.SIGCONT)
        for sentinel in self.sentinels:  # with the configuration it rewrote: it knows what happened
            if sentinel.process is None:
                sentinel.start()
                self.sentinel(sentinel).execute_command("SENTINEL DEBUG", *SENTINEL_DEBUG)
        deadline = time.monotonic() + 30
        while (master := self._live_master()) is None:  # the sentinels agree on a master that runs
            if time.monotonic() > deadline:
                raise RuntimeError(f"the sentinels of {self.data_ports} name no live master")
            time.sleep(0.05)
        for i, server in enumerate(self.servers):
            if server.process is None:
                self.servers[i] = self._data_server(server.port, master.port).start()
        self.wait_ready()

    def stop(self) -> None:
        for server in [*self.sentinels, *self.servers]:
            with contextlib.suppress(ProcessLookupError):
                if server.process is not None:
                    os.kill(server.process.pid, signal.SIGCONT)
            server.stop()


ZK_PORT = int(os.environ.get("DISTLOCKS_TEST_ZK_PORT", "12181")) + _worker_offset()
ZK_JAR = "/usr/share/java/zookeeper.jar"  # Debian's zookeeper package


def zk_answers(port: int) -> bool:
    import socket

    try:
        with socket.create_connection(("127.0.0.1", port), timeout=0.5) as sock:
            sock.sendall(b"ruok")
            return sock.recv(4) == b"imok"
    except OSError:
        return False


class ZooKeeperServer:
    """A ZooKeeper server on 127.0.0.1:``port`` (standalone, or one of an ensemble), stopped by pid."""

    def __init__(self, port: int, directory: str, ensemble: list[tuple[int, int, int]] | None = None, myid: int = 1):
        self.port = port
        self.directory = directory
        self.ensemble = ensemble or []
        self.myid = myid
        self.process: subprocess.Popen[bytes] | None = None

    def start(self, wait: bool = True) -> ZooKeeperServer:
        data = os.path.join(self.directory, "data")
        os.makedirs(data, exist_ok=True)
        lines = [
            "tickTime=500",
            "initLimit=20",
            "syncLimit=10",
            f"dataDir={data}",
            f"clientPort={self.port}",
            "clientPortAddress=127.0.0.1",
            "admin.enableServer=false",
            "4lw.commands.whitelist=ruok,srvr,stat",
            "minSessionTimeout=1000",
            "maxSessionTimeout=60000",
        ]
        for myid, peer, election in self.ensemble:
            lines.append(f"server.{myid}=127.0.0.1:{peer}:{election}")
        if self.ensemble:
            with open(os.path.join(data, "myid"), "w") as file:
                file.write(str(self.myid))
        config = os.path.join(self.directory, "zoo.cfg")
        with open(config, "w") as file:
            file.write("\n".join(lines) + "\n")
        command = ["java", "-Xmx256m", "-cp", ZK_JAR, "org.apache.zookeeper.server.quorum.QuorumPeerMain", config]
        self.process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        if wait:
            self.wait_ready()
        return self

    def wait_ready(self, timeout: float = 60) -> None:
        deadline = time.monotonic() + timeout
        while not zk_answers(self.port):
            if self.process is None or self.process.poll() is not None or time.monotonic() > deadline:
                self.stop()  # reaped now, not left to the garbage collector
                raise RuntimeError(f"ZooKeeper did not start on port {self.port}")
            time.sleep(0.1)

    def stop(self) -> None:
        if self.process is not None:
            self.process.kill()
            self.process.wait(10)
            self.process = None

    def mode(self) -> str:
        """'leader', 'follower' or 'standalone' (ZooKeeper's srvr command), or '' if it does not answer."""
        import socket

        try:
            with socket.create_connection(("127.0.0.1", self.port), timeout=1) as sock:
                sock.sendall(b"srvr")
                reply = b""
                while chunk := sock.recv(4096):
                    reply += chunk
        except OSError:
            return ""
        for line in reply.decode(errors="replace").splitlines():
            if line.startswith("Mode:"):
                return line.split(":", 1)[1].strip()
        return ""
