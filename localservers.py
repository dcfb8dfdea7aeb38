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
