"""Settings of the benchmarks: the test settings on databases of their own, plus django-db-mutex."""

from __future__ import annotations

from tests.settings import *  # noqa: F403
from tests.settings import BASE_DIR, DATABASES, INSTALLED_APPS

DATABASES["default"]["NAME"] = str(BASE_DIR / "bench.sqlite3")
DATABASES["mariadb"]["NAME"] = "distlocks_bench"
DATABASES["postgresql"]["NAME"] = "distlocks_bench"
INSTALLED_APPS = [*INSTALLED_APPS, "db_mutex"]
