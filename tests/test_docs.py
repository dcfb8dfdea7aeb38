"""Every Python example of the docs runs: README.md and docs/**/*.md, page by page (see docs/contributing.md).

A page's blocks run in order in one namespace, against the test settings with
every lock alias in memory and the demo's app importable as ``shop``. An HTML
comment on the line before a block, ``<!-- example: MARKER -->``, says what
else to do with it: ``module NAME`` (importable as NAME by later blocks),
``pytest`` (its tests are called), ``settings`` (run alone, its DISTLOCKS
checked as ``manage.py check`` does) or ``compile`` (only compiled).
"""

from __future__ import annotations

import io
import re
import sys
import types
import unittest
from dataclasses import dataclass
from pathlib import Path

import pytest
from django.utils.module_loading import import_string

import distlocks.testing
from distlocks import signals
from distlocks.handler import unknown_settings

ROOT = Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
BLOCK = re.compile(r"^(?:<!-- example: (?P<marker>[^>]*?) -->\n)?```python\n(?P<code>.*?)^```$", re.M | re.S)
# Blocks that are only compiled (a models.py, a urls.py): each is an example nobody runs, so they stay few.
MOST_COMPILED_ONLY = 4


@dataclass
class Block:
    page: Path
    line: int
    marker: str
    code: str

    @property
    def where(self) -> str:
        return f"{self.page.relative_to(ROOT)}:{self.line}"

    def compiled(self) -> types.CodeType:
        return compile(self.code, self.where, "exec")


def blocks(page: Path) -> list[Block]:
    text = page.read_text()
    return [
        Block(page, text.count("\n", 0, found.start("code")) + 1, found["marker"] or "", found["code"])
        for found in BLOCK.finditer(text)
    ]


EXAMPLES = {page: blocks(page) for page in PAGES if blocks(page)}


@pytest.fixture
def shop(monkeypatch):
    """``shop`` is the demo's app; modules an example defines (``module shop.views``) join it for one test."""
    import demo_shop.shop
    import demo_shop.shop.models

    monkeypatch.setitem(sys.modules, "shop", demo_shop.shop)
    monkeypatch.setitem(sys.modules, "shop.models", demo_shop.shop.models)

    def install(name: str, namespace: dict) -> None:
        module = types.ModuleType(name)
        module.__dict__.update(namespace)
        monkeypatch.setitem(sys.modules, name, module)
        parent, _, child = name.rpartition(".")
        if parent in sys.modules:
            monkeypatch.setattr(sys.modules[parent], child, module, raising=False)

    return install


@pytest.fixture
def _signal_receivers():
    """Receivers an example connects are gone after it."""
    sent = [signals.lock_acquired, signals.lock_released, signals.lock_lost, signals.lock_acquire_failed]
    saved = [signal.receivers[:] for signal in sent]
    yield
    for signal, receivers in zip(sent, saved, strict=True):
        signal.receivers[:] = receivers
        signal.sender_receivers_cache.clear()


def run_tests(block: Block, namespace: dict) -> None:
    """Call the block's ``test_*`` functions with the plugin's fixtures, each on fresh in-memory aliases, and run its TestCases."""
    defined: dict = dict(namespace)
    exec(block.compiled(), defined)
    fixtures = {"distlocks_backend": "default", "expire_lock": distlocks.testing.expire_lock}
    tests = [value for key, value in defined.items() if key.startswith("test_") and key not in namespace]
    cases = [
        value
        for key, value in defined.items()
        if isinstance(value, type) and issubclass(value, unittest.TestCase) and key not in namespace
    ]
    assert tests or cases, f"{block.where}: a pytest example defines no test"
    for test in tests:
        with distlocks.testing.override_distlocks():
            test(**{name: fixtures[name] for name in test.__code__.co_varnames[: test.__code__.co_argcount]})
    for case in cases:
        output = io.StringIO()
        result = unittest.TextTestRunner(stream=output).run(unittest.defaultTestLoader.loadTestsFromTestCase(case))
        assert result.wasSuccessful(), f"{block.where}:\n{output.getvalue()}"


def check_settings(block: Block) -> None:
    """Run a settings module alone; each DISTLOCKS entry's backend imports and has no key it would not read."""
    settings: dict = {}
    exec(block.compiled(), settings)
    for alias, entry in settings.get("DISTLOCKS", {}).items():
        import_string(entry["BACKEND"])
        assert unknown_settings(alias, entry) == [], block.where


@pytest.mark.django_db(transaction=True)
@pytest.mark.usefixtures("_signal_receivers")
@pytest.mark.parametrize("page", EXAMPLES, ids=lambda page: str(page.relative_to(ROOT)))
def test_the_examples_of_a_page_run(page, distlocks_backend, shop):
    namespace = {"__name__": "docs_example"}
    for block in EXAMPLES[page]:
        kind, _, name = block.marker.partition(" ")
        if kind == "compile":
            block.compiled()
        elif kind == "settings":
            check_settings(block)
        elif kind == "pytest":
            run_tests(block, namespace)
        elif kind == "module" and name:
            module = {"__name__": name}
            exec(block.compiled(), module)
            shop(name, module)
            namespace.update({key: value for key, value in module.items() if not key.startswith("__")})
        elif kind == "":
            exec(block.compiled(), namespace)
        else:
            pytest.fail(f"{block.where}: unknown example marker {block.marker!r}")


def test_few_examples_are_only_compiled():
    compiled = [block.where for found in EXAMPLES.values() for block in found if block.marker == "compile"]
    assert len(compiled) <= MOST_COMPILED_ONLY, compiled


def test_every_check_id_has_its_entry_in_the_docs():
    ids = set()
    for source in (ROOT / "distlocks").rglob("*.py"):
        ids |= set(re.findall(r"distlocks\.([EW]\d{3})", source.read_text()))
    page = (ROOT / "docs" / "operations" / "checks.md").read_text()
    assert len(ids) > 20
    assert [check for check in sorted(ids) if f"{{#{check.lower()}}}" not in page] == []
