"""Start ``tests.worker`` processes by forking a process that has already imported them.

A worker started with ``python -m tests.worker`` spends about 0.5 s of CPU on
imports (Django, distlocks, the drivers) before it does anything, and the suite
starts over a thousand of them: on two cores, most of the suite's CPU. The
template (``python -m tests.zygote SOCKET``) imports all of that once, with the
workers' environment, then forks one child per request. A child is a real
process of its own (its pid, its connections, signals such as SIGKILL and
SIGSTOP), with the caller's pipe as stdout and the caller's stderr; it runs the
scenario as ``python -m tests.worker`` would and exits through the interpreter's
normal shutdown. The template reaps it and tells the caller its exit status.

``ForkedProcess`` is the caller's side: the part of ``subprocess.Popen`` that the
tests use. The caller keeps one template per environment; ``Template.spawn``
returns None where the template could not fork safely or has ended: the caller
then starts the process as before.
"""

from __future__ import annotations

import atexit
import contextlib
import json
import os
import select
import signal
import socket
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# What changes from test to test without changing what a worker imports.
IGNORED_ENV = {"PYTEST_CURRENT_TEST"}


class ForkedProcess:
    """A child of the template, driven like a ``subprocess.Popen`` with ``stdout=PIPE, text=True``."""

    def __init__(self, args: list[str], connection: socket.socket, stdout_fd: int) -> None:
        self.args = args
        self.connection = connection
        self.replies = connection.makefile("r")
        self.pid = int(self.replies.readline())
        self.stdout = os.fdopen(stdout_fd, "r")
        self.returncode: int | None = None

    def wait(self, timeout: float | None = None) -> int:
        if self.returncode is None:
            if not select.select([self.connection], [], [], timeout)[0]:
                raise subprocess.TimeoutExpired(self.args, timeout)  # type: ignore[arg-type]
            status = self.replies.readline()
            self.returncode = os.waitstatus_to_exitcode(int(status)) if status else 255
            self.replies.close()
            self.connection.close()
        return self.returncode

    def poll(self) -> int | None:
        try:
            return self.wait(0)
        except subprocess.TimeoutExpired:
            return None

    def send_signal(self, number: int) -> None:
        if self.poll() is None:  # never a pid that the template has reaped, as Popen
            os.kill(self.pid, number)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def communicate(self, timeout: float | None = None) -> tuple[str, None]:
        output: list[str] = []
        reader = threading.Thread(target=lambda: output.append(self.stdout.read()), daemon=True)
        reader.start()
        reader.join(timeout)
        if reader.is_alive():
            raise subprocess.TimeoutExpired(self.args, timeout)  # type: ignore[arg-type]
        self.stdout.close()
        self.wait(timeout)
        return output[0], None


class Template:
    """The caller's handle on one template process, started with ``env``."""

    def __init__(self, env: dict[str, str]) -> None:
        self.env = env
        self.directory = tempfile.mkdtemp(prefix="distlocks-zygote-")
        self.path = os.path.join(self.directory, "socket")
        self.process = subprocess.Popen(
            [sys.executable, "-m", "tests.zygote", self.path], cwd=ROOT, env=env, stdout=subprocess.PIPE, text=True
        )
        assert self.process.stdout is not None
        self.ready = self.process.stdout.readline().strip() == "ready"
        self.process.stdout.close()

    def spawn(self, arguments: list[str], env: dict[str, str]) -> ForkedProcess | None:
        """A child running ``tests.worker ARGUMENTS`` with ``env`` (the caller picks the template started with
        ``env``, see ``without_ignored``); None if the template cannot fork one."""
        if not self.ready or self.process.poll() is not None:
            return None
        read_end, write_end = os.pipe()
        connection = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            connection.connect(self.path)
            request = json.dumps({"argv": arguments, "env": env}).encode() + b"\n"
            socket.send_fds(connection, [request], [write_end, 2])
            return ForkedProcess([sys.executable, "-m", "tests.worker", *arguments], connection, read_end)
        except (OSError, ValueError):  # the template ended (with the thread that started it): start it fresh
            connection.close()
            os.close(read_end)
            return None
        finally:
            os.close(write_end)

    def stop(self) -> None:
        self.process.kill()
        self.process.wait()
        with contextlib.suppress(OSError):
            os.unlink(self.path)
            os.rmdir(self.directory)


def without_ignored(env: dict[str, str]) -> dict[str, str]:
    return {key: value for key, value in env.items() if key not in IGNORED_ENV}


def _read_request(connection: socket.socket) -> tuple[dict, list[int]]:
    data, fds, _, _ = socket.recv_fds(connection, 1 << 20, 2)
    while not data.endswith(b"\n"):
        more = connection.recv(1 << 20)
        if not more:
            raise EOFError("the caller went away mid-request")
        data += more
    return json.loads(data), fds


def serve(path: str) -> dict:
    """Fork a child per request until killed; return (in the child) the request it is to run."""
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path)
    listener.listen(128)
    wake_read, wake_write = os.pipe()
    os.set_blocking(wake_read, False)
    os.set_blocking(wake_write, False)
    signal.set_wakeup_fd(wake_write)
    signal.signal(signal.SIGCHLD, lambda number, frame: None)
    children: dict[int, socket.socket] = {}  # pid: the caller's connection, told the exit status
    print("ready", flush=True)
    while True:
        ready = select.select([listener.fileno(), wake_read], [], [])[0]
        if wake_read in ready:
            while True:
                try:
                    if not os.read(wake_read, 512):
                        break
                except BlockingIOError:
                    break
            _reap(children)
        if listener.fileno() in ready:
            connection, _ = listener.accept()
            try:
                request, fds = _read_request(connection)
            except (OSError, EOFError, ValueError):
                connection.close()
                continue
            pid = os.fork()
            if pid == 0:
                signal.set_wakeup_fd(-1)
                signal.signal(signal.SIGCHLD, signal.SIG_DFL)
                for other in [listener, connection, *children.values()]:
                    other.close()
                os.close(wake_read)
                os.close(wake_write)
                os.dup2(fds[0], 1)
                os.dup2(fds[1], 2)
                for fd in fds:
                    os.close(fd)
                return request
            for fd in fds:
                os.close(fd)
            children[pid] = connection
            with contextlib.suppress(OSError):  # the caller is gone; the child is still reaped
                connection.sendall(f"{pid}\n".encode())
            _reap(children)  # a child that ended before its connection was recorded


def end_without_finalizing(code: object) -> None:
    """End the child as the interpreter would, up to its atexit handlers, then skip its finalization.

    Finalizing frees every module of the template's copy-on-write memory: 0.1-0.17 s a child, the test
    waiting. Unflushed output is flushed; the kernel closes the sockets and files.
    """
    threading._shutdown()  # type: ignore[attr-defined]  # the interpreter's own first step: the threads' exit hooks
    # (an executor's workers are told to end), then it joins the non-daemon threads
    atexit._run_exitfuncs()
    if code is not None and not isinstance(code, int):
        print(code, file=sys.stderr)
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(OSError):  # the caller went away
            stream.flush()
    os._exit(code if isinstance(code, int) else int(code is not None))


def _reap(children: dict[int, socket.socket]) -> None:
    while True:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        connection = children.pop(pid, None)
        if connection is not None:
            with contextlib.suppress(OSError):
                connection.sendall(f"{status}\n".encode())
            connection.close()


if __name__ == "__main__":
    import ctypes
    import random

    # 1: PR_SET_PDEATHSIG: it ends with the thread of the pytest process that started it (then a new one is made).
    ctypes.CDLL(None).prctl(1, signal.SIGKILL)

    import tests.worker

    # What the workers' backends import on first use: imported here once, not in each child.
    for module in ("redis", "django_redis", "kazoo.client", "psycopg", "MySQLdb"):
        __import__(module)
    if threading.active_count() != 1:  # forking a process with threads is not safe
        print(f"unsafe: {threading.active_count()} threads", flush=True)
        sys.exit(1)
    request = serve(sys.argv[1])
    # In a forked child: be the process that ``python -m tests.worker ARGV`` would be.
    random.seed()
    os.environ.clear()
    os.environ.update(request["env"])
    sys.argv = [tests.worker.__file__, *request["argv"]]
    try:
        tests.worker.main(request["argv"])
    except SystemExit as exit:
        end_without_finalizing(exit.code)
    end_without_finalizing(0)
