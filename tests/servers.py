"""Redis servers of the tests' own, on loopback ports (nothing kept on disk)."""

from __future__ import annotations

import os
import shutil
import subprocess
import time

import redis

REDIS_PORT = int(os.environ.get("DISTLOCKS_TEST_REDIS_PORT", "16379"))
# The Redlock nodes: five independent servers on the next ports.
REDLOCK_PORTS = [REDIS_PORT + 1 + i for i in range(5)]


def redis_url(port: int = REDIS_PORT) -> str:
    return f"redis://127.0.0.1:{port}/0"


def answers(port: int) -> bool:
    try:
        return bool(redis.Redis(port=port, socket_connect_timeout=0.2).ping())
    except redis.RedisError:
        return False


class RedisServer:
    """A ``redis-server`` on 127.0.0.1:``port``, stopped by pid."""

    def __init__(self, port: int) -> None:
        self.port = port
        self.process: subprocess.Popen[bytes] | None = None

    def start(self) -> RedisServer:
        binary = shutil.which("redis-server") or "/usr/bin/redis-server"
        command = [binary, "--bind", "127.0.0.1", "--port", str(self.port), "--save", "", "--appendonly", "no"]
        self.process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 10
        while not answers(self.port):
            if self.process.poll() is not None or time.monotonic() > deadline:
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
