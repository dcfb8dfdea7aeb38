"""The Redis and ZooKeeper servers that the tests and the benchmarks start for themselves, on loopback ports
(nothing kept on disk). A module of its own, so that ``bench/`` need not import from ``tests/``."""

from __future__ import annotations

import os
import shutil
import subprocess
import time


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

    def __init__(self, port: int, *options: str) -> None:
        self.port = port
        self.options = options  # more redis-server options, such as "--dir", path
        self.process: subprocess.Popen[bytes] | None = None

    def start(self) -> RedisServer:
        binary = shutil.which("redis-server") or "/usr/bin/redis-server"
        command = [binary, "--bind", "127.0.0.1", "--port", str(self.port), "--save", "", "--appendonly", "no"]
        command += self.options
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
