"""The verifier's worker processes: started, read, signalled and always cleaned up."""

from __future__ import annotations

import contextlib
import json
import os
import select
import signal
import subprocess
import sys
import tempfile
import threading
import time
from typing import Any

from distlocks.verify.history import Section


def halted(pid: int) -> bool:
    """True once process ``pid`` is stopped (Linux's /proc tells; elsewhere, after a moment)."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] in ("T", "t")
    except (OSError, IndexError):
        time.sleep(0.03)
        return True


class Worker:
    """A ``distlocks.verify.worker`` process; a thread reads its events as they come."""

    def __init__(self, config: dict[str, Any]) -> None:
        self.stderr = tempfile.TemporaryFile(mode="w+")  # noqa: SIM115 (closed by Pool.close)
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(path for path in sys.path if path)}
        self.process = subprocess.Popen(
            [sys.executable, "-m", "distlocks.verify.worker", json.dumps(config)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self.stderr,
            text=True,
            env=env,
            # Its own session: Ctrl-C reaches only the command, which then stops the workers itself.
            start_new_session=True,
        )
        self.pid = self.process.pid
        self.events: list[dict[str, Any]] = []
        self.in_window = False  # between the read and the write of a section, as far as its events tell
        self.done_start = 0.0  # when its last finished section started
        self.killed_at: float | None = None
        self.ended_at: float | None = None  # when its stdout closed
        self.stopped = False  # SIGSTOPped and not yet continued
        self._reader = threading.Thread(target=self._read, name=f"verify-reader-{self.pid}", daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.process.stdout is not None
        started = 0.0
        for line in self.process.stdout:
            try:
                event = json.loads(line)
            except ValueError:  # a line cut short by SIGKILL
                continue
            self.events.append(event)
            if event["event"] == "enter":
                started = event["start"]
            elif event["event"] in ("read", "write", "exit"):
                self.in_window = event["event"] == "read"
            if event["event"] == "exit":
                self.done_start = started
        self.ended_at = time.monotonic()

    @property
    def ready(self) -> bool:
        return bool(self.events)

    def go(self, deadline: float) -> None:
        """Start its loop (once it is ready), until ``deadline`` on the monotonic clock."""
        assert self.process.stdin is not None
        with contextlib.suppress(BrokenPipeError):
            self.process.stdin.write(f"{deadline!r}\n")
            self.process.stdin.close()

    def signal(self, number: int) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.kill(self.pid, number)

    def pause(self) -> None:
        """SIGSTOP the process; return once it has stopped and what it wrote before has been read."""
        self.stopped = True
        self.signal(signal.SIGSTOP)
        deadline = time.monotonic() + 1.0
        while not halted(self.pid) and time.monotonic() < deadline:
            time.sleep(0.001)
        assert self.process.stdout is not None
        while select.select([self.process.stdout], [], [], 0)[0] and time.monotonic() < deadline:
            time.sleep(0.001)
        time.sleep(0.02)  # the reader handles the lines it took

    def resume(self) -> None:
        self.signal(signal.SIGCONT)
        self.stopped = False

    def kill(self) -> float:
        """SIGKILL the process; return when, on the monotonic clock."""
        self.signal(signal.SIGKILL)
        self.killed_at = time.monotonic()
        self.process.wait()
        self.in_window = self.stopped = False
        return self.killed_at

    def finish(self, timeout: float) -> None:
        """Let the process end by itself within ``timeout`` seconds, else kill it; read all it said."""
        if self.stopped:
            self.resume()
        try:
            self.process.wait(timeout)
        except subprocess.TimeoutExpired:
            self.kill()
        self._reader.join(5)

    def failure(self) -> str | None:
        """What the process wrote on stderr if it ended with an error (not killed by the verifier)."""
        code = self.process.poll()
        if code in (None, 0) or self.killed_at is not None:
            return None
        self.stderr.seek(0)
        lines = self.stderr.read().strip().splitlines()
        return f"process {self.pid} exited with status {code}: {lines[-1] if lines else 'no output'}"

    def errors(self) -> list[str]:
        return [event["error"] for event in self.events if event["event"] == "error"]

    def sections(self) -> list[Section]:
        """Its critical sections; one it did not leave ends when it was killed (or when it ended)."""
        found = []
        entered: dict[str, Any] | None = None
        for event in self.events:
            if event["event"] == "enter":
                entered = event
            elif event["event"] == "exit" and entered is not None:
                found.append(self._section(entered, event["end"], event["outcome"], event["released"]))
                entered = None
        if entered is not None:
            end = self.killed_at or self.ended_at or time.monotonic()
            found.append(self._section(entered, end, "killed" if self.killed_at else "unfinished", "-"))
        return found

    def _section(self, entered: dict[str, Any], end: float, outcome: str, released: str) -> Section:
        return Section(self.pid, entered["token"], entered["called"], entered["start"], end, outcome, released)


class Pool:
    """The run's workers: ``size`` of them alive, a killed one replaced at once."""

    def __init__(self, size: int, config: dict[str, Any]) -> None:
        self.config = config
        self.deadline: float | None = None
        self.workers: list[Worker] = []
        self.alive: list[Worker] = []
        for _ in range(size):
            self._start()

    def _start(self) -> None:
        worker = Worker(self.config)
        self.workers.append(worker)
        self.alive.append(worker)
        if self.deadline is not None:
            worker.go(self.deadline)

    def wait_ready(self, timeout: float) -> str | None:
        """Wait until every worker is ready to go; return why not, if one ended or ``timeout`` passed."""
        deadline = time.monotonic() + timeout
        while not all(worker.ready for worker in self.workers):
            for worker in self.workers:
                if not worker.ready and worker.process.poll() is not None:
                    worker.finish(0)
                    return worker.failure() or f"process {worker.pid} ended before it was ready"
            if time.monotonic() > deadline:
                return f"the worker processes were not ready within {timeout:.0f}s"
            time.sleep(0.01)
        return None

    def go(self, deadline: float) -> None:
        self.deadline = deadline
        for worker in self.workers:
            worker.go(deadline)

    def replace(self, worker: Worker) -> None:
        self.alive.remove(worker)
        self._start()

    def cycles(self) -> int:
        return sum(sum(1 for event in worker.events if event["event"] == "enter") for worker in self.workers)

    def holder(self, within: float) -> Worker | None:
        """A live worker between the read and the write of its section, waiting up to ``within`` seconds for one.

        A fault there hurts most: a paused holder then writes what it read
        before others wrote.
        """
        deadline = time.monotonic() + within
        while True:
            for worker in self.alive:
                if worker.in_window and not worker.stopped and worker.process.poll() is None:
                    return worker
            if time.monotonic() >= deadline:
                return None
            time.sleep(0.002)

    def taken_over(self, since: float, victim: Worker) -> bool:
        """True once another worker has been through a whole section that started after ``since``."""
        return any(worker.done_start > since for worker in self.workers if worker is not victim)

    def stop(self, timeout: float) -> None:
        """Continue every paused worker, wait ``timeout`` seconds for them all to end, kill the rest."""
        for worker in self.workers:
            if worker.stopped:
                worker.resume()
        deadline = time.monotonic() + timeout
        for worker in self.workers:
            worker.finish(max(0.0, deadline - time.monotonic()))

    def close(self) -> None:
        for worker in self.workers:
            for stream in (worker.process.stdin, worker.process.stdout, worker.stderr):
                if stream is not None:
                    stream.close()
