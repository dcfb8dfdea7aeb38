"""The benchmarks' runner of contending processes: one that dies stops the run at once (no servers needed)."""

from __future__ import annotations

import os
import sys
import time

import pytest

from bench.common import run_contenders

from .conftest import ROOT

# A contender that records its pid; the first to start waits until the two others
# stand at the start line (start_together, where they would wait for it for ever), then exits 3.
CONTENDER = f"""
import os, sys, time
from pathlib import Path
sys.path.insert(0, {str(ROOT)!r})
from bench.common import start_together
here = Path(sys.argv[1])
(here / f"pid.{{os.getpid()}}").touch()
try:
    os.close(os.open(here / "first", os.O_CREAT | os.O_EXCL))
except FileExistsError:
    start_together(here / "counter", 3)
    print("{{}}")
else:
    while len(list(here.glob("counter.ready.*"))) < 2:
        time.sleep(0.01)
    sys.exit(3)
"""


def gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return False


def test_a_contender_that_dies_stops_the_run_at_once_and_leaves_no_process(tmp_path):
    command = [sys.executable, "-c", CONTENDER, str(tmp_path)]
    started = time.monotonic()
    # The run's own deadline is 60 s + CONTENDERS_GRACE away: only the failure can end it this soon.
    with pytest.raises(RuntimeError, match=r"^a contender exited with 3: ") as raised:
        run_contenders(command, tmp_path / "counter", 3, seconds=60)
    assert time.monotonic() - started < 30
    assert str(raised.value).endswith(" ".join(command))
    pids = [int(path.name.split(".")[1]) for path in tmp_path.glob("pid.*")]
    assert len(pids) == 3
    assert [pid for pid in pids if not gone(pid)] == []
