"""The Lock table's admin: read-only, never shows the owner's secret."""

from __future__ import annotations

import time

import pytest

import distlocks
from distlocks.owner import current_owner

pytestmark = pytest.mark.django_db(transaction=True)


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
