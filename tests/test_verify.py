"""manage.py distlocks_verify: the history checks on made-up histories, then real runs against every backend."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import threading
import time
from io import StringIO
from pathlib import Path

import pytest
from django.core.management import CommandError, call_command
from django.db import connections

from distlocks.verify.history import History, Section, Write, check, clobbers, overlaps, stale_writes, token_disorder

from .conftest import DB, LEASE_ALIASES, PROCESS_ALIASES, ROOT, worker_env

pytestmark = pytest.mark.servers("redis", "zookeeper")

# --- the checks, on histories made by hand ---------------------------------


def section(process, token, start, end, called=None, outcome="ok"):
    return Section(process, token, start if called is None else called, start, end, outcome)


def test_overlap_of_two_processes_is_found_and_back_to_back_sections_are_not():
    a, b, c = section(1, 1, 0.0, 1.0), section(2, 2, 1.0, 2.0), section(3, 3, 1.5, 1.6)
    assert overlaps([c, a, b]) == [(b, c)]
    assert overlaps([a, section(1, 2, 0.5, 0.7)]) == []  # one process: not a race between holders


def test_tokens_must_grow_in_real_time_order_only():
    first = section(1, 5, 0.0, 1.0)
    later = section(2, 4, 2.0, 3.0, called=1.5)  # asked after `first` had the lock
    assert token_disorder([first, later]) == [(first, later)]
    # Asked before `first` had it (paused inside acquire, say): the order is unknown, no violation.
    concurrent = section(2, 4, 2.0, 3.0, called=-0.5)
    assert token_disorder([first, concurrent]) == []
    assert token_disorder([first, section(2, 6, 2.0, 3.0, called=1.5)]) == []


def test_a_stale_write_is_one_committed_after_a_larger_token():
    writes = [Write(1, 1, 1, 1), Write(2, 2, 3, 2), Write(3, 1, 2, 3), Write(4, 2, 4, 4)]
    assert stale_writes(writes) == [(writes[1], writes[2])]


def test_lost_updates_and_where_they_were_lost():
    # Process 1 read 1 and paused; process 2 went to 3; process 1 woke and wrote 2.
    writes = [Write(1, 2, 1, 1), Write(2, 2, 2, 2), Write(3, 2, 3, 3), Write(4, 1, 1, 2)]
    history = History([], writes, initial=0, final=2)
    verdict = check(history)
    assert verdict.lost_updates == 2
    assert clobbers(writes, 0) == [(writes[2], writes[3])]
    [lost] = [v for v in verdict.violations if v.kind == "lost_update"]
    assert "4 increments were committed but the counter went from 0 to 2" in lost.detail
    assert "process 1 (token 1) set it to 2 when it was at 3" in lost.detail


def test_a_clean_history_has_no_violation():
    sections = [section(1, 1, 0.0, 1.0), section(2, 2, 1.1, 2.0, called=0.5), section(1, 3, 2.1, 3.0, called=1.0)]
    writes = [Write(i, s.process, s.token, i) for i, s in enumerate(sections, 1)]
    verdict = check(History(sections, writes, initial=0, final=3))
    assert verdict.violations == []
    assert verdict.as_dict()["cycles"] == 3


def test_with_a_fence_an_overlap_is_reported_but_not_a_violation():
    paused = section(1, 1, 0.0, 3.0, outcome="rejected")
    sections = [paused, section(2, 2, 1.0, 1.5)]
    history = History(sections, [Write(1, 2, 2, 1)], initial=0, final=1)
    [overlap] = check(history).violations
    assert overlap.kind == "overlap"
    assert overlap.detail == (
        "process 1 (token 1, 0.000s-3.000s) was still inside when 1 section(s) of other processes ran "
        "(tokens 2-2, 1.000s-1.500s)"
    )
    fenced = check(history, fenced=True)
    assert fenced.violations == []
    assert (len(fenced.overlaps), fenced.stale_writes_rejected) == (1, 1)


# --- real runs ---------------------------------------------------------------

KEYS = {"alias", "cycles", "violations", "overlaps", "token_order_violations", "lost_updates", "stale_writes_rejected"}


def verify(tmp_path, alias, *args):
    """Run the command; return (passed, the --json result, what it printed)."""
    path = tmp_path / f"{alias}.json"
    out = StringIO()
    error = ""
    try:
        call_command("distlocks_verify", "--using", alias, "--json", str(path), *args, stdout=out, stderr=StringIO())
    except CommandError as exc:
        error = str(exc)
    passed = not error
    assert passed or "violation(s) found" in error, error
    result = json.loads(path.read_text())
    assert set(result) >= KEYS
    assert result["alias"] == alias
    assert passed == (result["violations"] == [])
    return passed, result, out.getvalue()


def verify_tables():
    return [t for t in connections["default"].introspection.table_names() if t.startswith("distlocks_verify_")]


@DB
@pytest.mark.parametrize("alias", PROCESS_ALIASES)
def test_a_clean_run_finds_no_violation(tmp_path, alias):
    passed, result, printed = verify(tmp_path, alias, "--processes", 3, "--seconds", 2)
    assert passed, result["violations"]
    assert result["cycles"] >= 3
    assert result["overlaps"] == result["lost_updates"] == result["token_order_violations"] == 0
    assert result["counter"] == result["writes_committed"] > 0
    assert f"No violation in {result['cycles']} critical sections." in printed
    assert verify_tables() == []


@DB
def test_a_database_named_by_a_path_as_startproject_writes_it(tmp_path, monkeypatch):
    """Django's startproject names SQLite's file ``BASE_DIR / "db.sqlite3"``, a Path: the workers get its name."""
    settings_dict = connections["default"].settings_dict
    monkeypatch.setitem(settings_dict, "NAME", Path(settings_dict["NAME"]))
    passed, result, _ = verify(tmp_path, "default", "--processes", 2, "--seconds", 1)
    assert passed, result["violations"]
    assert result["cycles"] >= 2


@DB
@pytest.mark.parametrize("alias", [alias for alias in LEASE_ALIASES if alias in PROCESS_ALIASES])
def test_a_holder_paused_past_its_lease_overlaps_the_next_one(tmp_path, alias):
    passed, result, printed = verify(tmp_path, alias, "--ttl", 0.5, "--no-renew", "--faults", "pause", "--seconds", 4)
    assert not passed, (result["cycles"], result["notes"], result["timeline"]["faults"])
    assert result["faults"]["pause"] >= 1
    assert result["overlaps"] >= 1
    kinds = {violation["kind"] for violation in result["violations"]}
    assert "overlap" in kinds
    # The paused holder woke and wrote what it had read before the others wrote:
    # a stale write (after theirs), or a lost update (theirs came after, computed from the same read).
    assert kinds & {"stale_write", "lost_update"}
    assert "VIOLATION overlap" in printed
    paused = {fault["process"] for fault in result["timeline"]["faults"]}
    released = {s["released"] for s in result["timeline"]["sections"] if s["process"] in paused}
    assert "lost" in released  # the paused holder was told at release


@DB
@pytest.mark.parametrize(
    ("alias", "database"),
    [
        ("default", "default"),
        ("mariadb", "mariadb"),
        ("postgresql", "postgresql"),
        ("redis", "postgresql"),
        ("redlock", "mariadb"),
    ],
)
def test_with_the_fence_the_paused_holders_write_is_rejected_and_no_update_lost(tmp_path, alias, database):
    args = ["--ttl", 0.5, "--no-renew", "--faults", "pause", "--seconds", 4, "--fence", "--database", database]
    passed, result, printed = verify(tmp_path, alias, *args)
    assert passed, result["violations"]
    assert result["faults"]["pause"] >= 1
    assert result["overlaps"] >= 1  # the lease still ran out under the paused holder
    assert result["stale_writes_rejected"] >= 1
    assert result["lost_updates"] == result["stale_writes_accepted"] == 0
    assert result["counter"] == result["writes_committed"]
    paused = {fault["process"] for fault in result["timeline"]["faults"]}
    assert "rejected" in {s["outcome"] for s in result["timeline"]["sections"] if s["process"] in paused}
    assert "No violation" in printed


@DB
def test_zookeeper_holder_paused_past_its_session_overlaps_the_next_one(tmp_path):
    # The session (4 s in the test settings) ends, not a lease.
    passed, result, _ = verify(tmp_path, "zookeeper", "--faults", "pause", "--seconds", 12)
    assert not passed, (result["cycles"], result["notes"], result["timeline"]["faults"])
    assert result["faults"]["pause"] >= 1
    assert result["overlaps"] >= 1


@DB
@pytest.mark.parametrize("alias", PROCESS_ALIASES)
def test_a_killed_holder_is_no_violation(tmp_path, alias):
    # ZooKeeper frees a dead holder's lock when its session ends (4 s here), the others after the lease.
    seconds = 7 if alias == "zookeeper" else 3
    passed, result, _ = verify(tmp_path, alias, "--ttl", 1, "--faults", "kill", "--seconds", seconds)
    assert passed, result["violations"]
    [kill, *_] = result["timeline"]["faults"]
    assert kill["kind"] == "kill"
    sections = result["timeline"]["sections"]
    assert any(s["outcome"] == "killed" for s in sections)
    # The lock moved on to another process after the kill.
    assert any(s["start"] > kill["start"] and s["process"] != kill["process"] for s in sections)


@DB
def test_plot_writes_a_png_timeline(tmp_path):
    png = tmp_path / "timeline.png"
    verify(tmp_path, "redis", "--ttl", 0.5, "--no-renew", "--faults", "pause,kill", "--seconds", 3, "--plot", str(png))
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@DB
def test_two_runs_at_once_do_not_clash(tmp_path):
    results = {}

    def one(alias):
        results[alias] = verify(tmp_path, alias, "--processes", 2, "--seconds", 2)
        connections.close_all()

    threads = [threading.Thread(target=one, args=(alias,)) for alias in ("redis", "postgresql")]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    assert {alias: passed for alias, (passed, _, _) in results.items()} == {"redis": True, "postgresql": True}


def children(pid):
    with open(f"/proc/{pid}/task/{pid}/children") as listed:
        return [int(child) for child in listed.read().split()]


# Start a command with Ctrl-C's default action, as a terminal does: a process started in the background by a
# shell (CI's, or ``... &``) inherits SIGINT ignored, and so would the command, whatever it does.
SIGINT_AS_IN_A_TERMINAL = [
    sys.executable,
    "-c",
    "import os, signal, sys; signal.signal(signal.SIGINT, signal.SIG_DFL); os.execv(sys.executable, [sys.executable, *sys.argv[1:]])",
]


def signal_masks(pid):
    """The signals process ``pid`` ignores, blocks and catches (/proc/PID/status), for a failure's message."""
    with open(f"/proc/{pid}/status") as status:
        return " ".join(line.strip() for line in status if line.startswith(("SigIgn", "SigBlk", "SigCgt")))


def state(pid):
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return None


@DB
@pytest.mark.parametrize("number", [signal.SIGINT, signal.SIGTERM])
def test_ctrl_c_or_sigterm_during_a_pause_ends_every_process_and_drops_the_tables(number):
    command = subprocess.Popen(
        [
            *SIGINT_AS_IN_A_TERMINAL,
            "manage.py",
            "distlocks_verify",
            "--skip-checks",
            "--using",
            "redis",
            "--processes",
            "2",
            "--seconds",
            "60",
        ]
        + ["--ttl", "1", "--no-renew", "--faults", "pause"],
        cwd=ROOT,
        env={**worker_env(), "PYTHONFAULTHANDLER": "1"},  # SIGABRT prints where it is stuck
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        deadline = time.monotonic() + 60
        while not any(state(child) == "T" for child in children(command.pid)):  # a worker is paused
            assert command.poll() is None, command.stderr.read()
            assert time.monotonic() < deadline, "no worker was paused within 60 s"
            time.sleep(0.02)
        workers = children(command.pid)
        command.send_signal(number)
        try:
            command.wait(30)
        except subprocess.TimeoutExpired:
            masks = signal_masks(command.pid)
            command.send_signal(signal.SIGABRT)
            pytest.fail(
                f"the command ({masks}) did not end within 30 s of signal {number}: {command.communicate(10)[1]}"
            )
    finally:
        if command.poll() is None:
            command.kill()
            command.wait()
        command.stderr.close()
    deadline = time.monotonic() + 10
    while any(state(worker) not in (None, "Z") for worker in workers):
        assert time.monotonic() < deadline, [(worker, state(worker)) for worker in workers]
        time.sleep(0.02)
    assert verify_tables() == []


@DB
@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--using", "nowhere"], "--using: 'nowhere' is not an alias of DISTLOCKS"),
        (["--using", "locmem"], r"--using: 'locmem' keeps its locks in one process \(LocMemBackend\)"),
        (["--using", "default", "--processes", "1"], "--processes must be at least 2"),
        (["--using", "default", "--seconds", "0"], "--seconds must be a positive number"),
        (["--using", "default", "--ttl", "-1"], "--ttl must be a positive number"),
        (["--using", "default", "--faults", "kill,crash"], "--faults: unknown fault crash; choose from kill, pause"),
        (["--using", "default", "--database", "nope"], "--database: 'nope' is not an alias of DATABASES"),
        (
            ["--using", "default", "--faults", "pause", "--seconds", "5"],
            r"--seconds: a pause must outlast the lease \(30s\)",
        ),
        ([], "the following arguments are required: --using"),
    ],
)
def test_bad_arguments_name_the_option(args, message):
    with pytest.raises(CommandError, match=message):
        call_command("distlocks_verify", *args, stdout=StringIO(), stderr=StringIO())
    assert verify_tables() == []


def test_a_database_that_does_not_answer_is_a_clear_error():
    command = [sys.executable, "manage.py", "distlocks_verify", "--skip-checks", "--using", "redis"]
    done = subprocess.run(
        [*command, "--database", "postgresql_down"],
        cwd=ROOT,
        env=worker_env(),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 1
    assert "CommandError: --database 'postgresql_down': connection failed" in done.stderr
