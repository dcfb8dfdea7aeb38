"""Reproduce the stock-decrement race against a real multi-process server."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import IO, Any, cast

from django.conf import settings
from django.core.management.base import BaseCommand, CommandError, CommandParser
from django.db import connection
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from demo_shop.shop.models import Order, Stock
from demo_shop.shop.strategies import PLAIN
from distlocks.handler import locks
from distlocks.models import Lock
from distlocks.verify.processes import halted

PRODUCT = "P-1001"


def default_strategies() -> list[str]:
    """Every strategy the configuration allows; the pitfall where it can show."""
    names = [*PLAIN, *(f"lock:{alias}" for alias in locks), f"fenced:{next(iter(locks))}"]
    if connection.vendor != "sqlite":  # SQLite serializes transactions itself
        names.append(f"pitfall:{next(iter(locks))}")
    return names


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


class Cluster:
    """The demo under gunicorn with several worker processes, on a loopback port.

    With a ``lease`` (fault mode), every lock alias's lease is that long, and a
    worker told to pause stops itself and waits for ``resume()``.
    """

    def __init__(self, workers: int, lease: float | None = None) -> None:
        self.port = free_port()
        env = {**os.environ, "DJANGO_SETTINGS_MODULE": os.environ.get("DJANGO_SETTINGS_MODULE", "demo_shop.settings")}
        self.pause_dir: Path | None = None
        if lease is not None:
            env["DEMO_LOCK_TTL"] = str(lease)
            self.pause_dir = Path(tempfile.mkdtemp(prefix="oversell-pauses-"))
            env["DEMO_PAUSE_DIR"] = str(self.pause_dir)
        # Serve the database this process uses (a test database, say).
        env["DISTLOCKS_DB_NAME"] = str(connection.settings_dict["NAME"])
        command = [sys.executable, "-m", "gunicorn", "demo_shop.wsgi:application"]
        command += ["--workers", str(workers), "--bind", f"127.0.0.1:{self.port}", "--log-level", "warning"]
        command += ["--timeout", "90"]  # beyond the longest --pause: a stopped worker sends no heartbeat
        # Imported once, then forked: every worker is ready when the first answers (each importing
        # Django itself, on a busy machine one worker could serve the whole race alone, and race nobody).
        command += ["--preload"]
        self.process = subprocess.Popen(command, env=env, cwd=settings.BASE_DIR)
        self.url = f"http://127.0.0.1:{self.port}"
        deadline = time.monotonic() + 60
        while True:
            if self.process.poll() is not None:
                raise CommandError(f"gunicorn exited with status {self.process.returncode}")
            try:
                with urllib.request.urlopen(f"{self.url}/health/", timeout=5):
                    return
            except OSError:
                if time.monotonic() > deadline:
                    self.stop()
                    raise CommandError("gunicorn did not answer within 60s") from None
                time.sleep(0.1)

    def buy(self, strategy: str, product_id: str, pause: bool = False) -> int:
        headers = {"X-Demo-Pause": "1"} if pause else {}
        request = urllib.request.Request(f"{self.url}/buy/{strategy}/{product_id}/", method="POST", headers=headers)
        try:
            with urllib.request.urlopen(request, timeout=120) as response:
                return int(response.status)
        except urllib.error.HTTPError as exc:
            return int(exc.code)

    def paused(self) -> list[int]:
        """The workers that have stopped themselves between a read and a write, in the order they stopped."""
        if self.pause_dir is None:
            return []
        stopped = []
        for path in sorted(self.pause_dir.iterdir(), key=lambda path: path.stat().st_mtime_ns):
            try:
                os.kill(int(path.name), 0)
            except ProcessLookupError:  # gunicorn ended it (a timeout): it will not sell, nor be continued
                path.unlink(missing_ok=True)
                continue
            if halted(int(path.name)):
                stopped.append(int(path.name))
        return stopped

    def resume(self, pid: int) -> None:
        assert self.pause_dir is not None
        (self.pause_dir / str(pid)).unlink()
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGCONT)

    def stop(self) -> None:
        if self.pause_dir is not None:  # a stopped worker would not even hear SIGTERM
            for path in self.pause_dir.iterdir():
                with contextlib.suppress(ProcessLookupError):
                    os.kill(int(path.name), signal.SIGCONT)
            shutil.rmtree(self.pause_dir, ignore_errors=True)  # a continued worker may write its file meanwhile
        self.process.terminate()
        try:
            self.process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()


class Command(BaseCommand):
    help = "Fire concurrent buyers at a multi-process server, once per strategy, and count oversold units."

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("--strategies", help="Comma-separated, e.g. none,lock:default (default: all).")
        parser.add_argument("--stock", type=int, default=50, help="Initial stock (default 50).")
        parser.add_argument("--buyers", type=int, default=100, help="Buy requests per strategy (default 100).")
        parser.add_argument("--concurrency", type=int, default=16, help="Requests in flight (default 16).")
        parser.add_argument("--workers", type=int, default=4, help="gunicorn worker processes (default 4).")
        parser.add_argument("--json", dest="json_path", help="Also write the results as JSON to this path.")
        parser.add_argument(
            "--pause-every",
            type=int,
            default=0,
            help="Fault mode: every Nth buyer's server process stops (SIGSTOP) between its read and its write, "
            "until its lease has run out and another buyer has sold (default 0: no pauses).",
        )
        parser.add_argument(
            "--lease", type=float, default=1.0, help="Fault mode: every lock alias's lease in seconds (default 1)."
        )
        parser.add_argument(
            "--pause",
            type=float,
            default=10.0,
            help="Fault mode: the longest a paused buyer waits for another to sell, for locks that outlast it "
            "(default 10 seconds).",
        )

    def handle(self, *args: Any, **options: Any) -> None:
        for option in ("stock", "buyers", "concurrency", "workers"):
            if options[option] < 1:
                raise CommandError(f"--{option} must be at least 1")
        if options["pause_every"] < 0:
            raise CommandError("--pause-every must be 0 (no pauses) or more")
        if options["pause_every"] and not 0 < options["lease"] < options["pause"] <= 60:
            raise CommandError("--lease and --pause must be more than 0, --pause longer and at most 60 seconds")
        if options["pause_every"] and options["workers"] < 2:
            raise CommandError("--pause-every needs --workers 2 or more: a stopped worker serves nobody")
        if options["pause_every"] and connection.vendor == "sqlite":
            raise CommandError(
                "--pause-every needs MariaDB or PostgreSQL: on SQLite a paused buyer's transaction holds "
                "the one write lock, so nobody can sell while it is stopped"
            )
        strategies = self._strategies(options["strategies"])
        console = Console(file=cast(IO[str], self.stdout), force_terminal=False, width=120)
        cluster = Cluster(options["workers"], lease=options["lease"] if options["pause_every"] else None)
        results = []
        try:
            with Progress(
                TextColumn("{task.description:<22}"),
                BarColumn(),
                MofNCompleteColumn(),
                TimeElapsedColumn(),
                console=Console(stderr=True),
                transient=False,
            ) as progress:
                for strategy in strategies:
                    task = progress.add_task(strategy, total=options["buyers"])
                    results.append(self._run(cluster, strategy, options, lambda task=task: progress.advance(task)))
        finally:
            cluster.stop()
        console.print(self._table(results))
        if options["json_path"]:
            Path(options["json_path"]).write_text(json.dumps(results, indent=2) + "\n")

    def _strategies(self, spec: str | None) -> list[str]:
        if not spec:
            return default_strategies()
        names = [name.strip() for name in spec.split(",") if name.strip()]
        valid = {*PLAIN, *(f"{kind}:{alias}" for kind in ("lock", "fenced", "pitfall") for alias in locks)}
        unknown = [name for name in names if name not in valid]
        if unknown or not names:
            raise CommandError(
                f"unknown strategy {', '.join(unknown) or repr(spec)}; choose from: {', '.join(sorted(valid))}"
            )
        return names

    def _run(self, cluster: Cluster, strategy: str, options: dict[str, Any], advance: Any) -> dict[str, Any]:
        initial = options["stock"]
        Stock.objects.update_or_create(
            product_id=PRODUCT, warehouse=1, defaults={"count": initial, "version": 0, "fence_token": 0}
        )
        Order.objects.filter(product_id=PRODUCT).delete()
        Lock.objects.all().delete()

        def one(number: int) -> int:
            every = options["pause_every"]
            status = cluster.buy(strategy, PRODUCT, pause=bool(every) and number % every == every - 1)
            advance()
            return status

        started = time.monotonic()
        with ThreadPoolExecutor(options["concurrency"]) as pool:
            futures = [pool.submit(one, number) for number in range(options["buyers"])]
            paused = (0, 0)
            if options["pause_every"]:
                paused = self._continue_paused(cluster, futures, options["workers"], options["pause"])
            statuses = [future.result() for future in futures]
        elapsed = time.monotonic() - started
        orders = Order.objects.filter(product_id=PRODUCT).count()
        final = Stock.objects.get(product_id=PRODUCT, warehouse=1).count
        return {
            "strategy": strategy,
            "database": connection.display_name,
            "initial_stock": initial,
            "requests": options["buyers"],
            "orders": orders,
            "final_stock": final,
            "oversold": max(0, orders - initial),
            "lost_updates": orders - (initial - final),
            "errors": sum(1 for status in statuses if status not in (200, 409)),
            "paused": paused[0],
            "overtaken": paused[1],  # the paused buyers continued after another had sold
            "requests_per_second": round(options["buyers"] / elapsed, 1),
        }

    def _continue_paused(
        self, cluster: Cluster, futures: list[Future[int]], workers: int, longest: float
    ) -> tuple[int, int]:
        """Continue each paused buyer once another has sold since it stopped; return (paused, overtaken).

        That sale proves its lease ran out and a newer holder wrote: the count it
        read is stale, whatever the timing. When nobody else can sell (every
        worker paused, no other buyer left, or no sale for ``longest`` seconds: a
        lock that outlasts the pause), the last to stop goes on first: it holds
        the newest lock, so a fenced row refuses the others after its write.
        """
        seen: dict[int, int] = {}  # a paused worker: the stock when it was first seen stopped
        paused = overtaken = 0
        stock, moved = -1, 0.0  # the stock when last read, and when it last moved or a buyer paused
        while not all(future.done() for future in futures):
            new = [pid for pid in cluster.paused() if pid not in seen]
            if seen or new:
                current = Stock.objects.get(product_id=PRODUCT, warehouse=1).count
                if new or current != stock:
                    stock, moved = current, time.monotonic()
                seen.update(dict.fromkeys(new, stock))  # read after it stopped: its own write is yet to come
                paused += len(new)
                ready = [pid for pid, count in seen.items() if stock < count]
                overtaken += len(ready)
                unfinished = sum(not future.done() for future in futures)
                if not ready and (len(seen) in (workers, unfinished) or time.monotonic() - moved > longest):
                    ready, moved = [next(reversed(seen))], time.monotonic()
                for pid in ready:
                    del seen[pid]
                    cluster.resume(pid)
            time.sleep(0.01)
        return paused, overtaken

    def _table(self, results: list[dict[str, Any]]) -> Table:
        table = Table(title=f"Oversell race on {connection.display_name} ({connection.settings_dict['NAME']})")
        columns = ["strategy", "initial_stock", "orders", "final_stock", "oversold", "lost_updates", "errors"]
        for column in [*columns, "requests_per_second"]:
            table.add_column(column.replace("_", " "), justify="left" if column == "strategy" else "right")
        for row in results:
            bad = row["oversold"] or row["lost_updates"] or row["final_stock"] < 0
            style = "red" if bad else "green"
            table.add_row(*(str(row[column]) for column in columns), f"{row['requests_per_second']:.0f}", style=style)
        return table
