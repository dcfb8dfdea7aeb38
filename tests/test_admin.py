"""The admin: the Lock table (read-only, never the owner's secret), and the held locks of every backend."""

from __future__ import annotations

import json
import os
import re
import time

import pytest
from django.conf import settings
from django.contrib.admin.models import DELETION, LogEntry
from django.contrib.auth.models import Permission
from django.contrib.contenttypes.models import ContentType
from django.test import Client, override_settings
from django.utils.html import escape

import distlocks
from distlocks.inspection import held_locks
from distlocks.models import Lock
from distlocks.owner import current_owner
from tests.conftest import DB, PROCESS_ALIASES, Holder

pytestmark = [DB, pytest.mark.servers("redis", "zookeeper")]

HELD_URL = "/admin/distlocks/lock/held/"


@pytest.fixture
def holders():
    started = []

    def hold(name, alias="default", **kwargs):
        holder = Holder(name, alias, **kwargs)
        started.append(holder)
        return holder

    yield hold
    for holder in started:
        if holder.thread.is_alive():
            holder.release()


@pytest.fixture
def staff_client(django_user_model):
    """A logged-in staff client with the given distlocks permissions (codenames)."""

    def make(*codenames):
        user = django_user_model.objects.create_user(f"staff-{'-'.join(codenames) or 'none'}", is_staff=True)
        user.user_permissions.add(
            *Permission.objects.filter(content_type__app_label="distlocks", codename__in=codenames)
        )
        client = Client()
        client.force_login(user)
        client.user = user
        return client

    return make


def value(alias, name, token, kind="lock"):
    return json.dumps([alias, name, token, kind])


def release_post(client, alias, name, token, url=HELD_URL, kind="lock"):
    """Tick the row and press the button, then confirm; return the page shown after the redirect."""
    confirm = client.post(url, {"_selected_lock": value(alias, name, token, kind)})
    assert confirm.status_code == 200
    assert "Are you sure" in confirm.content.decode()
    return client.post(url, {"_selected_lock": value(alias, name, token, kind), "post": "yes"}, follow=True)


def token_cell(token):
    """The token's cell: a long one (Redis') as its last 6 digits, the whole token on hover."""
    if len(str(token)) > 8:
        return f'<td class="field-token"><span title="{token}">…{str(token)[-6:]}</span></td>'
    return f'<td class="field-token">{token}</td>'


def listed(alias, name):
    return any(info.key == name for info in held_locks([alias]).locks)


# The database backend's Lock table.


def test_lists_locks_with_a_lease_filter_and_no_secret(admin_client, name):
    live = distlocks.lock(f"{name}-live")
    expired = distlocks.lock(f"{name}-old", ttl=0.2, renew=False)
    with live:
        expired.acquire()
        time.sleep(0.4)
        page = admin_client.get("/admin/distlocks/lock/").content.decode()
        assert f"{name}-live" in page
        assert f"{name}-old" in page
        assert current_owner().secret not in page
        live_only = admin_client.get("/admin/distlocks/lock/?expired=no").content.decode()
        assert f"{name}-live" in live_only
        assert f"{name}-old" not in live_only
        expired_only = admin_client.get("/admin/distlocks/lock/?expired=yes").content.decode()
        assert f"{name}-old" in expired_only
        assert f"{name}-live" not in expired_only
        found = admin_client.get(f"/admin/distlocks/lock/?q={name}-live").content.decode()
        assert f"{name}-old" not in found
        with pytest.raises(distlocks.LockLost):
            expired.release()


def test_no_adding_changing_or_deleting(admin_client, name):
    with distlocks.lock(name) as lk:
        assert admin_client.get("/admin/distlocks/lock/add/").status_code == 403
        page = admin_client.get(f"/admin/distlocks/lock/{lk.token}/change/")
        assert page.status_code == 200  # a read-only view
        assert current_owner().secret not in page.content.decode()
        assert admin_client.post(f"/admin/distlocks/lock/{lk.token}/delete/").status_code == 403


# The held locks of every backend.


def test_the_page_is_linked_from_the_app_index_and_the_lock_list(admin_client):
    assert HELD_URL in admin_client.get("/admin/distlocks/").content.decode()
    assert HELD_URL in admin_client.get("/admin/distlocks/lock/").content.decode()
    page = admin_client.get(HELD_URL).content.decode()
    assert '<ol class="breadcrumbs">' in page
    assert 'href="/admin/distlocks/"' in page
    assert 'id="recent-locking"' not in page  # charts only with distlocks.metrics (tests/test_metrics.py)


def test_held_locks_is_in_the_sidebar_and_the_app_index_for_who_may_see_it(admin_client, staff_client):
    entry = re.compile(
        rf'<tr class="model-heldlock[^"]*">\s*<th scope="row" id="distlocks-heldlock">\s*<a href="{HELD_URL}"[^>]*>Held locks</a>'
    )
    # The index, the app index, and the sidebar of the app's pages.
    for url in ("/admin/", "/admin/distlocks/", "/admin/distlocks/lock/", HELD_URL):
        assert entry.search(admin_client.get(url).content.decode()), url
        assert 'class="model-lock' in admin_client.get(url).content.decode()
    for codename in ("view_lock", "force_release_lock"):
        assert entry.search(staff_client(codename).get("/admin/").content.decode()), codename
    assert "Held locks" not in staff_client().get("/admin/").content.decode()
    # No page of its own to add, change or delete.
    assert admin_client.get("/admin/distlocks/heldlock/").status_code == 404


@pytest.fixture
def many_held(name):
    """250 locks on the database backend, taken detached (no thread each) and freed afterwards."""
    taken = [distlocks.lock(f"{name}-{i:03d}") for i in range(250)]
    for lock in taken:
        assert lock.take_detached(lease=300) is not None
    yield taken
    for lock in taken:
        lock.release_detached()


def test_many_held_locks_are_paged_keeping_the_search_and_filters(name, many_held, admin_client):
    url = f"{HELD_URL}?q={name}&alias=default"
    first = admin_client.get(url).content.decode()
    assert first.count('<td class="field-token">') == 100
    assert f">{name}-000</th>" in first
    assert f">{name}-099</th>" in first
    assert f">{name}-100</th>" not in first
    assert "250 locks held" in first
    # Page links keep the search and the filter.
    assert '<span class="this-page">1</span>' in first
    assert f'<a href="?q={name}&amp;alias=default&amp;p=2">2</a>' in first
    assert f'<a href="?q={name}&amp;alias=default&amp;p=3" class="end">3</a>' in first

    second = admin_client.get(f"{url}&p=2").content.decode()
    assert second.count('<td class="field-token">') == 100
    assert f">{name}-100</th>" in second
    assert f">{name}-199</th>" in second
    assert f">{name}-099</th>" not in second
    assert '<span class="this-page">2</span>' in second
    assert f'<a href="?q={name}&amp;alias=default&amp;p=1">1</a>' in second

    third = admin_client.get(f"{url}&kind=lock&p=3").content.decode()
    assert third.count('<td class="field-token">') == 50
    assert f">{name}-200</th>" in third
    assert f">{name}-249</th>" in third
    assert "250 locks held" in third
    # The search form keeps the filters (not the page); the filter links keep the search, and start at page 1.
    assert '<input type="hidden" name="alias" value="default">' in third
    assert '<input type="hidden" name="kind" value="lock">' in third
    assert f'href="?q={name}&amp;kind=lock&amp;alias=redis"' in third
    assert "p=3&amp;alias=" not in third
    # A page past the end is the last one; nonsense is the first.
    assert f">{name}-249</th>" in admin_client.get(f"{url}&p=9").content.decode()
    assert f">{name}-000</th>" in admin_client.get(f"{url}&p=x").content.decode()
    # Fewer than a page: no page links.
    one = admin_client.get(f"{HELD_URL}?q={name}-24&alias=default").content.decode()
    assert one.count('<td class="field-token">') == 10
    assert "this-page" not in one


def test_a_lock_held_elsewhere_is_listed_and_force_released(alias, name, holders, admin_client, admin_user):
    holder = holders(name, alias, ttl=30)
    page = admin_client.get(f"{HELD_URL}?alias={alias}").content.decode()
    assert name in page
    assert f"{os.getpid()}:<wbr>holder-{name}/<wbr>" in page  # the owner: host:pid:thread
    assert token_cell(holder.token) in page
    if alias == "zookeeper":  # no lease, but it knows its waiters
        assert ">session</span></td>" in page
        assert '<td class="field-waiters">0</td>' in page
    else:
        assert " s</td>" in page
    assert f'value="{escape(value(alias, name, holder.token))}"' in page  # its checkbox

    after = release_post(admin_client, alias, name, holder.token, url=f"{HELD_URL}?alias={alias}")
    assert after.redirect_chain[-1] == (f"{HELD_URL}?alias={alias}", 302)
    shown = after.content.decode()
    assert f"Force-released “{alias}: {name}”" in shown
    assert token_cell(holder.token) not in shown
    assert not listed(alias, name)

    entry = LogEntry.objects.get()
    assert entry.user == admin_user
    assert entry.object_repr == f"{alias}: {name}"
    assert entry.content_type == ContentType.objects.get_for_model(Lock)
    assert entry.action_flag == DELETION
    assert "Force-released" in entry.get_change_message()
    assert f"token {holder.token}" in entry.get_change_message()

    assert isinstance(holder.release(), distlocks.LockLost)


@pytest.mark.parametrize("aliases", [("default", "redis", "zookeeper")])
def test_search_and_backend_filter(aliases, name, holders, admin_client):
    for alias in aliases:
        holders(f"{name}-{alias}", alias)
    page = admin_client.get(HELD_URL).content.decode()
    assert all(f"{name}-{alias}" in page for alias in aliases)

    only_redis = admin_client.get(f"{HELD_URL}?alias=redis").content.decode()
    assert f"{name}-redis" in only_redis
    assert f"{name}-default" not in only_redis
    assert f"{name}-zookeeper" not in only_redis

    found = admin_client.get(f"{HELD_URL}?q={name.upper()}-ZOOK").content.decode()
    assert f"{name}-zookeeper" in found
    assert f"{name}-redis" not in found
    # Search and filter together, and the owner is searched too.
    both = admin_client.get(f"{HELD_URL}?q=holder-{name}-re&alias=redis").content.decode()
    assert f"{name}-redis" in both
    assert f"{name}-default" not in both
    assert (
        admin_client.get(f"{HELD_URL}?q={name}&alias=default").content.decode().count('<td class="field-token">') == 1
    )
    # The filter links keep the search.
    assert f"?q={name}&amp;alias=redis" in admin_client.get(f"{HELD_URL}?q={name}").content.decode()


def test_an_unknown_backend_filter_warns(admin_client):
    page = admin_client.get(f"{HELD_URL}?alias=nowhere")
    assert page.status_code == 200
    assert "Backend “nowhere” could not list its locks: no such backend in DISTLOCKS" in page.content.decode()


def test_a_viewer_without_the_permission_sees_no_button_and_cannot_release(name, holders, staff_client):
    holder = holders(name, "redis")
    viewer = staff_client("view_lock")
    page = viewer.get(HELD_URL)
    assert page.status_code == 200
    assert name in page.content.decode()
    assert 'name="_selected_lock"' not in page.content.decode()
    assert "Force-release selected locks" not in page.content.decode()
    for data in (
        {"_selected_lock": value("redis", name, holder.token)},
        {"_selected_lock": value("redis", name, holder.token), "post": "yes"},
    ):
        assert viewer.post(HELD_URL, data).status_code == 403
    assert listed("redis", name)
    assert not LogEntry.objects.exists()
    assert holder.release() is None


def test_staff_without_any_distlocks_permission_is_refused(staff_client):
    assert staff_client().get(HELD_URL).status_code == 403


def test_anonymous_users_are_sent_to_the_login(client):
    page = client.get(HELD_URL)
    assert page.status_code == 302
    assert page["Location"].startswith("/admin/login/")


def test_the_permission_alone_lets_a_user_see_and_release(name, holders, staff_client):
    holder = holders(name, "default")
    releaser = staff_client("force_release_lock")
    page = releaser.get(HELD_URL).content.decode()
    assert f'value="{escape(value("default", name, holder.token))}"' in page  # its checkbox
    assert "Force-release selected locks" in page
    assert HELD_URL in releaser.get("/admin/distlocks/").content.decode()
    after = release_post(releaser, "default", name, holder.token)
    assert f"Force-released “default: {name}”" in after.content.decode()
    assert LogEntry.objects.get().user == releaser.user
    assert isinstance(holder.release(), distlocks.LockLost)


def test_nothing_is_released_without_confirmation(name, holders, admin_client):
    holder = holders(name, "default")
    confirm = admin_client.post(HELD_URL, {"_selected_lock": value("default", name, holder.token)})
    assert confirm.status_code == 200
    assert f"default: {name}" in confirm.content.decode()
    assert 'name="post" value="yes"' in confirm.content.decode()
    assert listed("default", name)
    assert admin_client.post(HELD_URL, {}, follow=True).content.decode().count("Tick the locks") == 1
    assert holder.release() is None


def test_selected_locks_are_released_together(name, holders, admin_client):
    one, two, kept = holders(f"{name}-1", "redis"), holders(f"{name}-2", "zookeeper"), holders(f"{name}-3", "redis")
    chosen = [value("redis", f"{name}-1", one.token), value("zookeeper", f"{name}-2", two.token)]
    after = admin_client.post(HELD_URL, {"_selected_lock": chosen, "post": "yes"}, follow=True).content.decode()
    assert f"Force-released “redis: {name}-1”" in after
    assert f"Force-released “zookeeper: {name}-2”" in after
    assert sorted(LogEntry.objects.values_list("object_repr", flat=True)) == [
        f"redis: {name}-1",
        f"zookeeper: {name}-2",
    ]
    assert listed("redis", f"{name}-3")
    assert isinstance(one.release(), distlocks.LockLost)
    assert isinstance(two.release(), distlocks.LockLost)
    assert kept.release() is None


def test_a_lock_no_longer_held_says_so(name, holders, admin_client):
    holder = holders(name, "redis")
    token = holder.token
    assert holder.release() is None
    after = admin_client.post(HELD_URL, {"_selected_lock": value("redis", name, token), "post": "yes"}, follow=True)
    assert f"“redis: {name}” is no longer held: nothing to release." in after.content.decode()
    assert not LogEntry.objects.exists()


def test_a_lock_taken_again_since_it_was_shown_is_not_released(name, holders, admin_client):
    first = holders(name, "default")
    old_token = first.token
    assert first.release() is None
    second = holders(name, "default")
    after = admin_client.post(
        HELD_URL, {"_selected_lock": value("default", name, old_token), "post": "yes"}, follow=True
    )
    assert f"was released and taken again (token {second.token})" in after.content.decode()
    assert listed("default", name)
    assert not LogEntry.objects.exists()
    assert second.release() is None


def test_force_release_needs_the_csrf_token(name, holders, admin_user):
    holder = holders(name, "default")
    client = Client(enforce_csrf_checks=True)
    client.force_login(admin_user)
    data = {"_selected_lock": value("default", name, holder.token), "post": "yes"}
    assert client.post(HELD_URL, data).status_code == 403
    assert listed("default", name)
    assert holder.release() is None


def test_a_backend_that_is_down_is_a_warning_not_an_error(name, holders, admin_client):
    holders(f"{name}-db", "default")
    holders(f"{name}-redis", "redis")
    down = {"BACKEND": "distlocks.backends.redis.RedisBackend", "OPTIONS": {"CACHE": "redis_down"}}
    with override_settings(DISTLOCKS={**settings.DISTLOCKS, "redis_down": down}):
        page = admin_client.get(HELD_URL)
        assert page.status_code == 200
        shown = page.content.decode()
        assert '<li class="warning">Backend “redis_down” could not list its locks:' in shown
        assert f"{name}-db" in shown
        assert f"{name}-redis" in shown
        # Releasing on it reports the error too.
        after = admin_client.post(HELD_URL, {"_selected_lock": value("redis_down", "x", 1), "post": "yes"}, follow=True)
        assert after.status_code == 200
        assert "“redis_down: x” could not be released:" in after.content.decode()
    assert not LogEntry.objects.exists()


@pytest.mark.parametrize("alias", PROCESS_ALIASES, indirect=True)
def test_semaphore_permits_and_multi_lock_members_are_listed_and_force_released(
    alias, leave_nothing, name, workers, admin_client
):
    from io import StringIO

    from django.core.management import call_command

    holder = workers("hold_permit", alias, name, 1, 30)
    _, slot, token = holder.line()
    permit = distlocks.semaphore(name, 1, using=alias).slots[int(slot)].key
    both = distlocks.multi_lock([f"{name}-b", f"{name}-a"], using=alias)
    assert both.acquire(wait=5)
    try:
        out = StringIO()
        call_command("distlocks_list", "--using", alias, "--json", stdout=out)
        shown = {row["key"]: row for row in json.loads(out.getvalue())}
        assert permit.endswith(f"sem:{name}#{slot}")
        assert shown[permit]["token"] == int(token)
        assert shown[permit]["owner"].endswith("task permits=1")
        assert {member.key for member in both.locks} <= set(shown)
        assert shown[permit]["kind"] == "semaphore"
        assert {shown[member.key]["kind"] for member in both.locks} == {"multi"}

        page = admin_client.get(f"{HELD_URL}?alias={alias}").content.decode()
        assert escape(f"sem:{name}#{slot}") in page
        after = release_post(admin_client, alias, permit, int(token), url=f"{HELD_URL}?alias={alias}")
        assert f"Force-released “{alias}: {permit}”" in after.content.decode()
        # The permit is free again at once, while its holder still runs.
        assert workers("take_permit", alias, name, 1, 0).finish()[:2] == ["acquired", slot]
        assert holder.process.poll() is None
        release_post(admin_client, alias, both.locks[0].key, both.tokens[f"{name}-a"], url=f"{HELD_URL}?alias={alias}")
        with pytest.raises(distlocks.LockLost):
            both.release()
    finally:
        while both.hold_count:
            both.release()
    assert not listed(alias, both.locks[1].key)


@pytest.mark.parametrize("alias", ["default", "postgresql", "redis", "zookeeper"], indirect=True)
def test_read_write_holders_are_listed_by_kind_filtered_and_force_released_one_by_one(
    alias, leave_nothing, name, workers, admin_client
):
    from io import StringIO

    from django.core.management import call_command

    readers = [workers("rw_hold", alias, name, "read", 30) for _ in range(2)]
    tokens = [int(reader.line()[1]) for reader in readers]
    key = distlocks.read_write_lock(name, using=alias).key
    plain = distlocks.lock(f"{name}-plain", using=alias)
    with plain:
        out = StringIO()
        call_command("distlocks_list", "--using", alias, "--json", stdout=out)
        shown = [(row["key"], row["kind"], row["token"]) for row in json.loads(out.getvalue()) if name in row["key"]]
        assert sorted(shown) == sorted(
            [(key, "read", tokens[0]), (key, "read", tokens[1]), (plain.key, "lock", plain.token)]
        )

        page = admin_client.get(f"{HELD_URL}?alias={alias}").content.decode()
        assert '<td class="field-kind">read-write: read</td>' in page
        assert '<td class="field-kind">lock</td>' in page
        only_reads = admin_client.get(f"{HELD_URL}?alias={alias}&kind=read").content.decode()
        assert escape(key) in only_reads
        assert escape(plain.key) not in only_reads
        assert f'value="{escape(value(alias, key, tokens[0], "read"))}"' in only_reads

        after = release_post(admin_client, alias, key, tokens[0], url=f"{HELD_URL}?alias={alias}", kind="read")
        assert f"Force-released “{alias}: {key} (read)”" in after.content.decode()
        left = [info.token for info in held_locks([alias]).locks if info.key == key]
        assert left == [tokens[1]]  # the other reader still holds it
        assert workers("rw_take", alias, name, "write", 0).finish() == ["busy"]
        call_command("distlocks_release", key, "--using", alias, "--kind", "read", "--yes", stdout=StringIO())
        assert workers("rw_take", alias, name, "write", 5).finish()[0] == "acquired"
    for reader in readers:
        reader.kill()
