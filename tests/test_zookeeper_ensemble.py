"""ZooKeeper as users run it: a 3-node ensemble, with a follower and then the leader stopped."""

from __future__ import annotations

import time

import pytest

from localservers import ZooKeeperServer, zk_answers

from .conftest import DB, ZK_PORT, guarded_events, wait_until

pytestmark = DB

# Client, peer and election ports of the three servers, away from the standalone one.
SERVERS = [(i, ZK_PORT + 10 + i, ZK_PORT + 20 + i, ZK_PORT + 30 + i) for i in (1, 2, 3)]
CONNECT = ",".join(f"127.0.0.1:{client}" for _, client, _, _ in SERVERS)


@pytest.fixture(scope="module")
def ensemble(tmp_path_factory):
    peers = [(myid, peer, election) for myid, _, peer, election in SERVERS]
    servers = [
        ZooKeeperServer(client, str(tmp_path_factory.mktemp(f"zk{myid}")), ensemble=peers, myid=myid)
        for myid, client, _, _ in SERVERS
    ]
    for server in servers:
        assert not zk_answers(server.port), f"port {server.port} is taken"
        server.start(wait=False)
    for server in servers:
        server.wait_ready()
    wait_for_quorum(servers)
    yield servers
    for server in servers:
        server.stop()


def wait_for_quorum(servers, timeout=60):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        modes = [server.mode() for server in servers if server.process is not None]
        if "leader" in modes and modes.count("follower") >= 1:
            return
        time.sleep(0.2)
    raise AssertionError(f"no quorum: {[server.mode() for server in servers]}")


def test_never_two_holders_while_a_follower_then_the_leader_stop(ensemble, workers, tmp_path, name, monkeypatch):
    monkeypatch.setenv("DISTLOCKS_TEST_ZK_ENSEMBLE", CONNECT)
    log, stop = tmp_path / "events", tmp_path / "stop"
    log.touch()
    running = [workers("guarded", "zk_ensemble", name, 240, log, stop) for _ in range(3)]

    def entered_since(moment):
        """The workers that entered the critical section after ``moment`` (so far: whole lines only)."""
        text = log.read_text()
        lines = text.splitlines()[: text.count("\n")]
        return {pid for event, pid, at, *_ in map(str.split, lines) if event == "enter" and float(at) > moment}

    wait_until(lambda: len(entered_since(0)) == 3, timeout=60)
    follower = next(server for server in ensemble if server.mode() == "follower")
    follower.stop()
    stopped_follower = time.monotonic()
    # Those that were connected to it too: they went on on the others.
    wait_until(lambda: len(entered_since(stopped_follower)) == 3, timeout=60)
    leader = next(server for server in ensemble if server.mode() == "leader")
    leader.stop()
    stopped_leader = time.monotonic()
    time.sleep(4)  # no quorum meanwhile, for as long as a session's timeout (SESSION_TIMEOUT)
    follower.start(wait=False)
    leader.start(wait=False)
    restarted = time.monotonic()
    wait_until(lambda: entered_since(restarted), timeout=90)
    stop.touch()
    for worker in running:
        assert worker.finish(timeout=120) == ["done"]
    events = guarded_events(log)
    entered = [(float(at), pid) for event, pid, at, *_ in events if event == "enter"]
    # The lock worked with a follower down, and again after the restart.
    assert any(stopped_follower < at < stopped_leader for at, _ in entered)
    assert any(at > restarted for at, _ in entered)
    assert len({pid for _, pid in entered}) == 3
