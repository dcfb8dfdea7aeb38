"""The demo's DATABASES entries per vendor, shared by its settings, the tests' and the benchmarks'."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

BASE_DIR = Path(__file__).resolve().parent.parent


def database(vendor: str, name: str | None = None) -> dict[str, Any]:
    """Return the DATABASES entry of the demo on ``vendor``."""
    if vendor == "sqlite":
        return {
            "ENGINE": "django.db.backends.sqlite3",
            "NAME": name or BASE_DIR / "demo.sqlite3",
            # WAL lets readers run beside the writer; IMMEDIATE makes atomic()
            # take the write lock at BEGIN, SQLite's stand-in for FOR UPDATE.
            "OPTIONS": {
                "timeout": 60,
                "transaction_mode": "IMMEDIATE",
                "init_command": "PRAGMA journal_mode=WAL; PRAGMA synchronous=NORMAL",
            },
        }
    if vendor == "mariadb":
        return {
            "ENGINE": "django.db.backends.mysql",
            "NAME": name or "distlocks_demo",
            "HOST": os.environ.get("MYSQL_HOST", "127.0.0.1"),
            "PORT": os.environ.get("MYSQL_PORT", "3306"),
            "USER": os.environ.get("MYSQL_USER", "root"),
            "PASSWORD": os.environ.get("MYSQL_PASSWORD", ""),
            "OPTIONS": {"charset": "utf8mb4"},
        }
    if vendor == "postgresql":
        return {
            "ENGINE": "django.db.backends.postgresql",
            "NAME": name or "distlocks_demo",
            "HOST": os.environ.get("PGHOST", "127.0.0.1"),
            "PORT": os.environ.get("PGPORT", "5432"),
            "USER": os.environ.get("PGUSER", "postgres"),
            "PASSWORD": os.environ.get("PGPASSWORD", ""),
        }
    raise ValueError(f"DISTLOCKS_DB must be sqlite, mariadb or postgresql, not {vendor!r}")
