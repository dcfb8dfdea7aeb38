"""Leader election: one leader at a time across real processes, on every backend, under SIGKILL and SIGSTOP."""

from __future__ import annotations

import signal
import threading
import time
from io import StringIO

import pytest
from django.core.management import call_command

import distlocks
from distlocks.inspection import force_release, held_locks
from distlocks.signals import lock_lost

from .conftest import ALIASES, DB, PROCESS_ALIASES, guarded_events, wait_until

pytestmark = DB

# A term's lease in these tests, and how long a standby may take beyond it to be elected (a loaded machine).
TTL = 1.5
MARGIN = 3.0


def lease(alias):
    """How long after the leader's last sign of life the server may give its lock to another: ZooKeeper's session timeout."""
    return 4.0 if alias == "zookeeper" else TTL


def elected(worker):
    """Read the worker's lines up to "elected TOKEN": return the token."""
    assert worker.line() == ["campaigning"]
    answer = worker.line()
    assert answer[0] == "elected", answer
    return int(answer[1])


def until_elected(worker, within):
    """Wait (reading its stdout) for a standby's "elected TOKEN"; return (token, seconds it took)."""
    started = time.monotonic()
    result = {}
    reader = threading.Thread(target=lambda: result.update(answer=worker.line()), daemon=True)
    reader.start()
    reader.join(within)
    took = time.monotonic() - started
    assert "answer" in result, f"no standby elected within {within:.1f}s"
    assert result["answer"][0] == "elected", result["answer"]
    return int(result["answer"][1]), took


@pytest.fixture
def leader_and_standby(alias, name, workers, leave_nothing):
    """A leader process (ttl ``TTL``) and a standby campaigning behind it: (leader, its token, standby)."""

    def start(ttl=TTL, go=""):
        leader = workers("lead", alias, name, ttl, go)
        token = elected(leader)
        standby = workers("lead", alias, name, ttl)
        assert standby.line() == ["campaigning"]
        info = distlocks.election(name, using=alias).leader()
        assert info is not None
        assert (info.token, info.kind) == (token, "leader")
        return leader, token, standby

    return start


@pytest.mark.parametrize("alias", PROCESS_ALIASES, indirect=True)
def test_one_leader_at_a_time_and_each_term_has_a_larger_token(alias, name, workers, tmp_path, leave_nothing):
    log = tmp_path / "terms"
    campaigners = [workers("terms", alias, name, 1, log) for _ in range(3)]
    for campaigner in campaigners:
        assert campaigner.finish() == ["done"]
    events = guarded_events(log)  # no two terms at once, tokens strictly increasing
    leaders = {pid for event, pid, *_ in events if event == "enter"}
    assert len(leaders) >= 2, "the terms never changed hands"


@pytest.mark.parametrize("alias", PROCESS_ALIASES, indirect=True)
def test_a_killed_leader_is_replaced_within_its_lease(alias, name, leader_and_standby):
    leader, token, standby = leader_and_standby()
    leader.kill()
    new_token, took = until_elected(standby, lease(alias) + MARGIN)
    assert new_token > token
    assert distlocks.election(name, using=alias).leader().token == new_token


@pytest.mark.parametrize("alias", PROCESS_ALIASES, indirect=True)
def test_a_paused_leader_is_replaced_and_finds_its_term_lost_before_it_acts(alias, name, leader_and_standby, tmp_path):
    go = tmp_path / "go"
    leader, token, standby = leader_and_standby(go=go)
    leader.process.send_signal(signal.SIGSTOP)  # a GC pause, a VM migration: no renewal
    try:
        new_token, _ = until_elected(standby, lease(alias) + MARGIN)
        go.touch()  # the first thing it does on waking is to ask whether it still leads
    finally:
        leader.process.send_signal(signal.SIGCONT)
    assert new_token > token
    assert leader.finish() == ["lost", "LeadershipLost", "resigned", "LeadershipLost"]
    assert distlocks.election(name, using=alias).leader().token == new_token


@pytest.mark.parametrize("alias", PROCESS_ALIASES, indirect=True)
def test_a_leader_that_exits_cleanly_hands_over_at_once(alias, name, leader_and_standby):
    leader, token, standby = leader_and_standby(ttl=30)
    leader.process.send_signal(signal.SIGTERM)
    new_token, took = until_elected(standby, 5)
    assert new_token > token
    assert took < 2  # resigned: not the 30 s lease running out
    assert leader.process.wait(5) == 0


@pytest.mark.parametrize("alias", ALIASES, indirect=True)
def test_run_campaigns_again_after_a_loss(alias, name, leave_nothing):
    """A term lost (force-released from the admin) ends in on_lost, and run() is elected again with a larger token."""
    election = distlocks.election(name, using=alias, ttl=1)
    terms, told = [], []

    def on_elected(term):
        terms.append(term.token)
        if len(terms) == 1:
            assert force_release(alias, f"leader:{name}")
            wait_until(lambda: term.lost)
            term.check()  # raises LeadershipLost
        return "done"

    assert election.run(on_elected, told.append) == "done"
    assert terms[1] > terms[0]
    assert [term.token for term in told] == [terms[0]]
    assert told[0].lost
    assert election.leader() is None  # returning resigned


def lose_a_term(election, alias, name, terms):
    """Lead; force-release the term's lock as an operator would; once the term knows, check() it and leave."""
    with election.lead(wait=0) as term:
        terms.append(term)
        assert not term.lost
        term.check()
        assert force_release(alias, f"leader:{name}")
        wait_until(lambda: term.lost)
        with pytest.raises(distlocks.LeadershipLost, match=rf"\(term {term.token}\)"):
            term.check()


@pytest.mark.parametrize("alias", ["default", "redis", "locmem"], indirect=True)
def test_a_lost_term_is_told_and_leaving_it_raises(alias, name, leave_nothing):
    election = distlocks.election(name, using=alias, ttl=1)
    signals, terms = [], []

    def receiver(sender, **kwargs):
        signals.append((kwargs["name"], kwargs["token"]))

    lock_lost.connect(receiver)
    try:
        with pytest.raises(distlocks.LeadershipLost, match=f"Leadership of '{name}' on '{alias}' was lost"):
            lose_a_term(election, alias, name, terms)  # leaving the block raises
        wait_until(lambda: signals)
        assert signals == [(f"leader:{name}", terms[0].token)]
    finally:
        lock_lost.disconnect(receiver)
    assert issubclass(distlocks.LeadershipLost, distlocks.LockLost)


@pytest.mark.parametrize("alias", ["default", "zookeeper", "locmem"], indirect=True)
def test_leader_and_listing(alias, name, leave_nothing):
    election = distlocks.election(name, using=alias, ttl=5)
    assert election.leader() is None
    with election.lead(wait=0) as term:
        info = election.leader()
        assert (info.token, info.kind, info.alias) == (term.token, "leader", alias)
        assert [i.kind for i in held_locks([alias]).locks if name in i.key] == ["leader"]
        out = StringIO()
        call_command("distlocks_list", "--using", alias, stdout=out)
        assert any(name in line and " leader " in f" {line} " for line in out.getvalue().splitlines())
        other = threading.Thread(target=lambda: result.append(_try_lead(election)))
        result = []
        other.start()
        other.join()
        assert result == [f"Leadership of {name!r} on {alias!r} not won within 0.0s"]
        with pytest.raises(ValueError, match="held by this thread already"), election.lead():
            pass
    assert election.leader() is None


def _try_lead(election):
    try:
        with election.lead(wait=0):
            return "elected"
    except distlocks.LockNotAcquired as exc:
        return str(exc)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"name": ""}, "name must not be empty"),
        ({"name": 7}, "name must be a str"),
        ({"name": "x", "ttl": 0}, "ttl must be"),
        ({"name": "x", "using": 3}, "using must be"),
    ],
)
def test_bad_arguments(kwargs, message):
    with pytest.raises(ValueError, match=message):
        distlocks.election(**kwargs)


def test_a_negative_wait_is_refused():
    with pytest.raises(ValueError, match="wait must be 0 or more seconds"), distlocks.election("x").lead(wait=-1):
        pass


@pytest.mark.parametrize("alias", ["default", "redis"], indirect=True)
def test_a_leader_force_released_from_the_admin_is_told(alias, name, admin_client, workers, leave_nothing):
    """The admin lists the leader process as kind "leader"; force-releasing it ends the term, and the leader knows."""
    from django.utils.html import escape

    from tests.test_admin import HELD_URL, release_post

    leader = workers("lead_until_lost", alias, name, 3)
    token = elected(leader)
    key = distlocks.election(name, using=alias).leader().key
    page = admin_client.get(f"{HELD_URL}?alias={alias}&kind=leader").content.decode()
    assert escape(key) in page
    assert '<td class="field-kind">leader</td>' in page
    after = release_post(admin_client, alias, key, token, url=f"{HELD_URL}?alias={alias}", kind="leader")
    assert f"Force-released “{alias}: {key}”" in after.content.decode()
    # Told at its next renewal, within a third of its lease.
    assert leader.finish(timeout=10) == ["lost", "LeadershipLost", "resigned", "LeadershipLost"]
