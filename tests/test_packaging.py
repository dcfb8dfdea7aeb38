"""The wheel and sdist that ``python -m build`` makes install in a fresh virtualenv and carry everything."""

from __future__ import annotations

import contextlib
import fcntl
import os
import subprocess
import sys
import tarfile
import zipfile
from email.parser import Parser

import distlocks
from tests.conftest import ROOT

# What a project needs of the package besides its modules.
DATA = [
    "distlocks/py.typed",
    "distlocks/migrations/0001_initial.py",
    "distlocks/migrations/0002_lock_name_byte_wise.py",
    "distlocks/templates/admin/distlocks/lock/held_locks.html",
    "distlocks/templates/admin/distlocks/lock/change_list.html",
    "distlocks/templates/admin/distlocks/lock/force_release_confirmation.html",
    "distlocks/templates/admin/distlocks/lock/recent_charts.html",
    "distlocks/management/commands/distlocks_cleanup.py",
    "distlocks/metrics/apps.py",
]


def run(*command, cwd, env=None):
    done = subprocess.run(command, cwd=cwd, env=env, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, f"{command} failed:\n{done.stdout}\n{done.stderr}"
    return done.stdout


def clean_env():
    """The environment without this test run's Django settings or paths."""
    return {k: v for k, v in os.environ.items() if k not in ("DJANGO_SETTINGS_MODULE", "PYTHONPATH", "VIRTUAL_ENV")}


@contextlib.contextmanager
def one_build_at_a_time():
    """Lock the checkout while a build writes distlocks.egg-info and the sdist's tree in it.

    Two runs in one checkout (scripts/test.sh's two passes, side by side) then take turns.
    """
    checkout = os.open(ROOT, os.O_RDONLY)
    try:
        fcntl.flock(checkout, fcntl.LOCK_EX)
        yield
    finally:
        os.close(checkout)


def test_wheel_and_sdist_install_in_a_fresh_virtualenv(tmp_path):
    dist = tmp_path / "dist"
    with one_build_at_a_time():
        run(sys.executable, "-m", "build", "--outdir", str(dist), str(ROOT), cwd=tmp_path)
    (sdist,) = dist.glob("distlocks-*.tar.gz")
    (wheel,) = dist.glob("distlocks-*.whl")

    with tarfile.open(sdist) as archive:
        top = sdist.name.removesuffix(".tar.gz")
        in_sdist = {name.removeprefix(f"{top}/") for name in archive.getnames()}
    assert {*DATA, "LICENSE", "README.md", "CHANGELOG.md", "pyproject.toml"} <= in_sdist
    assert not any(name.startswith("tests/") for name in in_sdist)  # the suite needs the whole repository

    with zipfile.ZipFile(wheel) as archive:
        in_wheel = set(archive.namelist())
        (metadata,) = (name for name in in_wheel if name.endswith(".dist-info/METADATA"))
        meta = Parser().parsestr(archive.read(metadata).decode())
    assert set(DATA) <= in_wheel
    assert not any(name.startswith(("tests/", "demo_shop/", "bench/")) for name in in_wheel)
    assert meta["Name"] == "distlocks"
    assert meta["Version"] == distlocks.__version__ == "0.1.0"  # read from distlocks/__init__.py
    assert meta["License-Expression"] == "MIT"
    assert any(name.endswith("licenses/LICENSE") for name in in_wheel)
    assert "prometheus" in meta.get_all("Provides-Extra")
    assert "Typing :: Typed" in meta.get_all("Classifier")

    # A fresh virtualenv and a new project, as a user would start.
    venv = tmp_path / "venv"
    run(sys.executable, "-m", "venv", str(venv), cwd=tmp_path)
    python, env = str(venv / "bin" / "python"), clean_env()
    run(
        python,
        "-m",
        "pip",
        "install",
        "-q",
        "--disable-pip-version-check",
        f"{wheel}[prometheus]",
        cwd=tmp_path,
        env=env,
    )
    where = run(python, "-c", "import distlocks, distlocks.metrics; print(distlocks.__file__)", cwd=tmp_path, env=env)
    package = os.path.dirname(where.strip())
    assert package.startswith(str(venv)), package
    for name in DATA:
        assert os.path.isfile(os.path.join(os.path.dirname(package), name)), name

    (tmp_path / "shopsite").mkdir()  # Django 5.2 wants it to exist
    run(
        str(venv / "bin" / "django-admin"),
        "startproject",
        "shopsite",
        str(tmp_path / "shopsite"),
        cwd=tmp_path,
        env=env,
    )
    settings = tmp_path / "shopsite" / "shopsite" / "settings.py"
    text = settings.read_text()
    settings.write_text(
        text.replace("INSTALLED_APPS = [", 'INSTALLED_APPS = [\n    "distlocks",\n    "distlocks.metrics",', 1)
    )
    project = tmp_path / "shopsite"
    assert "System check identified no issues" in run(python, "manage.py", "check", cwd=project, env=env)
    assert "Applying distlocks.0002_lock_name_byte_wise... OK" in run(
        python, "manage.py", "migrate", cwd=project, env=env
    )
    # The lock works from the installed package, on the new project's SQLite database.
    script = "import django; django.setup(); import distlocks\nwith distlocks.lock('first') as held: print(held.token)"
    env["DJANGO_SETTINGS_MODULE"] = "shopsite.settings"
    assert run(python, "-c", script, cwd=project, env=env).strip().isdigit()


def test_an_editable_install_as_the_demo_makes_says_nothing(tmp_path):
    """``pip install -q -e .`` (scripts/demo.sh, requirements-test.txt) prints no setuptools warning to a new user.

    The checkout's root is the import root (``package-dir``): setuptools puts it on
    sys.path with a plain .pth file, instead of a finder it warns about.
    """
    venv = tmp_path / "venv"
    run(sys.executable, "-m", "venv", "--without-pip", str(venv), cwd=tmp_path)
    python, env = str(venv / "bin" / "python"), clean_env()
    # This run's pip, as new as the one the demo upgrades to (older ones do not pass the backend's warnings on).
    install = ["install", "-q", "--disable-pip-version-check", "--no-deps", "-e", str(ROOT)]
    command = [sys.executable, "-m", "pip", "--python", python, *install]
    with one_build_at_a_time():
        done = subprocess.run(command, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stderr
    # What pip says of this machine's own index configuration is not the package's.
    said = [line for line in done.stdout.splitlines() + done.stderr.splitlines() if "is ignored" not in line]
    assert said == []
    find = "import importlib.util; print(importlib.util.find_spec('distlocks').origin)"  # no Django: --no-deps
    assert run(python, "-c", find, cwd=tmp_path, env=env).strip() == str(ROOT / "distlocks" / "__init__.py")
