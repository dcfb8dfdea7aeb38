"""What the demo's, the tests' and the benchmarks' settings share, none of it read from the environment but hosts.

The apps, middleware and templates of the demo shop, and a DATABASES entry per vendor.
"""

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


INSTALLED_APPS = [
    "django.contrib.admin",
    "django.contrib.auth",
    "django.contrib.contenttypes",
    "django.contrib.sessions",
    "django.contrib.messages",
    "django.contrib.staticfiles",
    "distlocks",
    "demo_shop.shop",
]

MIDDLEWARE = [
    "django.middleware.security.SecurityMiddleware",
    "django.contrib.sessions.middleware.SessionMiddleware",
    "django.middleware.common.CommonMiddleware",
    "django.middleware.csrf.CsrfViewMiddleware",
    "django.contrib.auth.middleware.AuthenticationMiddleware",
    "django.contrib.messages.middleware.MessageMiddleware",
]

TEMPLATES = [
    {
        "BACKEND": "django.template.backends.django.DjangoTemplates",
        "APP_DIRS": True,
        "OPTIONS": {
            "context_processors": [
                "django.template.context_processors.request",
                "django.contrib.auth.context_processors.auth",
                "django.contrib.messages.context_processors.messages",
            ]
        },
    }
]
