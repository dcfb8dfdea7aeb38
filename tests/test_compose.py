"""docker-compose.yml brings up the whole demo; validated here by docker-compose itself (no engine needed)."""

from __future__ import annotations

import shutil
import subprocess

import yaml

from .conftest import ROOT


def compose_config():
    binary = shutil.which("docker-compose")
    assert binary, "docker-compose is missing: scripts/test.sh installs Debian's docker-compose package"
    done = subprocess.run(
        [binary, "config"], cwd=ROOT, capture_output=True, text=True, timeout=60, env={"PATH": "/usr/bin:/bin"}
    )
    assert done.returncode == 0, done.stderr
    return yaml.safe_load(done.stdout)


def test_the_compose_file_is_valid_and_runs_the_whole_demo():
    services = compose_config()["services"]
    assert set(services) == {"mariadb", "redis", "zookeeper", "web", "worker"}
    for app in ("web", "worker"):
        environment = services[app]["environment"]
        assert environment["DISTLOCKS_DB"] == "mariadb"
        assert environment["DISTLOCKS_REDIS_URL"].startswith("redis://redis:")
        assert environment["DISTLOCKS_ZOOKEEPER"] == "zookeeper:2181"
        assert environment["CELERY_BROKER_URL"].startswith("redis://redis:")
        assert environment["DJANGO_SECRET_KEY"] == ""  # never a key in the repo
        assert set(services[app]["depends_on"]) >= {"mariadb", "redis", "zookeeper"}
    assert services["worker"]["command"][:3] == ["celery", "-A", "demo_shop.celery"]
