"""The held-locks admin page in a real headless Chromium (Debian's), driven by Playwright.

Playwright never downloads a browser here: it drives ``/usr/bin/chromium``. A
Chromium that cannot start fails the test; it is never skipped.
"""

from __future__ import annotations

import os
import threading
from pathlib import Path

import pytest
from django.conf import settings
from django.contrib.admin.models import LogEntry
from django.test import override_settings
from playwright import sync_api

import distlocks
from distlocks.inspection import held_locks

from .conftest import Holder

ROOT = Path(__file__).resolve().parent.parent
# The admin page's picture in the docs (docs/operations/admin.md), refreshed on purpose only:
# DISTLOCKS_REFRESH_SCREENSHOT=1 bash scripts/test.sh -k browser
DOCS_SCREENSHOT = ROOT / "docs" / "admin-locks.png"
CHROMIUM = "/usr/bin/chromium"
CHROMIUM_ARGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]
# The screenshot's backends: the database, Redis and ZooKeeper.
SHOWN = ("default", "redis", "zookeeper")

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.servers("redis", "zookeeper")]


def wait_then_release(name, alias):
    with distlocks.lock(name, using=alias, wait=60):
        pass


def launch(playwright):
    try:
        return playwright.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS, headless=True, timeout=30_000)
    except Exception as exc:
        pytest.fail(f"Chromium ({CHROMIUM}) could not start under Playwright: {exc}", pytrace=False)


def test_force_release_in_a_real_browser(live_server, django_user_model, tmp_path):
    django_user_model.objects.create_superuser("admin", "admin@example.com", "correct horse")
    shown = {alias: settings.DISTLOCKS[alias] for alias in SHOWN}
    with override_settings(DISTLOCKS=shown):
        # The page's lock, and two that stay (one with a waiter queued behind it).
        stock = Holder("stock:42", "redis", thread_name="redis-worker", ttl=30)
        report = Holder("report:nightly", "default", thread_name="default-worker", ttl=60)
        catalog = Holder("import:catalog", "zookeeper", thread_name="zookeeper-worker")
        waiter = threading.Thread(target=wait_then_release, args=("import:catalog", "zookeeper"))
        waiter.start()
        try:
            # No ORM from here on: Playwright's sync API runs an event loop in this thread.
            with sync_api.sync_playwright() as playwright:
                browser = launch(playwright)
                try:
                    page = browser.new_page(viewport={"width": 1200, "height": 700})
                    page.set_default_timeout(20_000)
                    page.goto(f"{live_server.url}/admin/login/?next=/admin/distlocks/lock/held/")
                    page.fill("#id_username", "admin")
                    page.fill("#id_password", "correct horse")
                    page.click("input[type=submit]")
                    page.wait_for_url("**/admin/distlocks/lock/held/")
                    # This test's three locks (the tests' Redis may hold another test's lease too).
                    row, *staying = (
                        page.locator("#result_list tbody tr", has=page.locator("th", has_text=name))
                        for name in ("stock:42", "report:nightly", "import:catalog")
                    )
                    for listed in (row, *staying):
                        sync_api.expect(listed).to_have_count(1)
                    sync_api.expect(row.locator("td.field-alias")).to_have_text("redis")

                    row.locator("input.action-select").check()
                    page.get_by_role("button", name="Force-release selected locks").click()
                    sync_api.expect(page.locator("#content")).to_contain_text("Are you sure")
                    page.get_by_role("button", name="Yes, force-release").click()

                    page.wait_for_url("**/admin/distlocks/lock/held/")
                    sync_api.expect(page.locator(".messagelist .success")).to_contain_text(
                        "Force-released “redis: stock:42”"
                    )
                    sync_api.expect(row).to_have_count(0)
                    for listed in staying:
                        sync_api.expect(listed).to_have_count(1)
                    sync_api.expect(page.locator("td.field-waiters").first).to_be_visible()
                    toggle = page.locator("#toggle-nav-sidebar")  # more room for the table
                    if toggle.is_visible():
                        toggle.click()
                    screenshot = tmp_path / "admin-locks.png"
                    if os.environ.get("DISTLOCKS_REFRESH_SCREENSHOT") == "1":
                        screenshot = DOCS_SCREENSHOT
                    page.screenshot(path=str(screenshot))
                    assert screenshot.stat().st_size > 10_000  # a page, not an empty picture
                finally:
                    browser.close()
        finally:
            lost = stock.release()
            report.release()
            catalog.release()
            waiter.join(60)
        assert isinstance(lost, distlocks.LockLost)
        assert not any(info.key == "stock:42" for info in held_locks(["redis"]).locks)
    entry = LogEntry.objects.get()
    assert (entry.user.username, entry.object_repr) == ("admin", "redis: stock:42")


def log_in(page, live_server, next_url):
    page.goto(f"{live_server.url}/admin/login/?next={next_url}")
    page.fill("#id_username", "admin")
    page.fill("#id_password", "correct horse")
    page.click("input[type=submit]")
    page.wait_for_url(f"**{next_url}")


# How wide the held-locks table, the page and the token cell are (CSS pixels).
WIDTHS = """() => {
    const table = document.querySelector("#result_list");
    const tokens = [...document.querySelectorAll("#result_list tbody td.field-token")];
    return {
        table: table.scrollWidth,
        results: table.parentElement.clientWidth,
        results_right: table.parentElement.getBoundingClientRect().right,
        page: document.documentElement.scrollWidth,
        viewport: window.innerWidth,
        token_right: Math.max(...tokens.map((cell) => cell.getBoundingClientRect().right)),
    };
}"""


def test_the_table_fits_1280_px_and_the_whole_token_is_on_hover(live_server, django_user_model):
    django_user_model.objects.create_superuser("admin", "admin@example.com", "correct horse")
    with override_settings(DISTLOCKS={alias: settings.DISTLOCKS[alias] for alias in SHOWN}):
        stock = Holder("stock:42", "redis", thread_name="ThreadPoolExecutor-0_12", ttl=30)
        report = Holder("report:nightly:2026-11-28:warehouse-7", "default", thread_name="default-worker", ttl=60)
        try:
            assert len(str(stock.token)) == 16  # microseconds: what did not fit
            with sync_api.sync_playwright() as playwright:
                browser = launch(playwright)
                try:
                    page = browser.new_page(viewport={"width": 1280, "height": 800})
                    page.set_default_timeout(20_000)
                    log_in(page, live_server, "/admin/distlocks/lock/held/")
                    assert page.locator("#nav-sidebar").is_visible()  # the narrowest table: both sidebars open
                    widths = page.evaluate(WIDTHS)
                    assert widths["table"] <= widths["results"], widths
                    assert widths["page"] <= widths["viewport"], widths
                    assert widths["token_right"] <= widths["results_right"], widths  # not scrolled out of sight
                    row = page.locator("#result_list tbody tr", has=page.locator("th", has_text="stock:42"))
                    token = row.locator("td.field-token span")
                    sync_api.expect(token).to_have_attribute("title", str(stock.token))
                    sync_api.expect(token).to_have_text(f"…{str(stock.token)[-6:]}")
                finally:
                    browser.close()
        finally:
            stock.release()
            report.release()
