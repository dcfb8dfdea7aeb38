"""System checks for DISTLOCKS and ImproperlyConfigured errors."""

from __future__ import annotations

import pytest
from django.core.exceptions import ImproperlyConfigured

import distlocks
from distlocks.checks import check_distlocks

DB = "distlocks.backends.db.DatabaseBackend"


def ids(settings_value, settings):
    settings.DISTLOCKS = settings_value
    return [(message.id, message.msg) for message in check_distlocks()]


def test_the_test_settings_are_fine():
    assert check_distlocks() == []


def test_no_setting_means_the_database_on_default(settings):
    del settings.DISTLOCKS
    assert check_distlocks() == []
    assert distlocks.lock("x").alias == "default"


@pytest.mark.parametrize(
    ("value", "check_id", "text"),
    [
        ([], "distlocks.E001", "DISTLOCKS must be a dict"),
        ({"default": "db"}, "distlocks.E002", "DISTLOCKS['default'] must be a dict"),
        ({"default": {}}, "distlocks.E002", "DISTLOCKS['default'] has no 'BACKEND'"),
        ({"default": {"BACKEND": "distlocks.backends.nope.Backend"}}, "distlocks.E002", "cannot import BACKEND"),
        ({"default": {"BACKEND": DB, "TTL": 0}}, "distlocks.E002", "DISTLOCKS['default']: TTL must be"),
        ({"default": {"BACKEND": DB, "OPTIONS": []}}, "distlocks.E002", "['OPTIONS'] must be a dict"),
        ({"default": {"BACKEND": DB, "OPTIONS": {"DATABASE": "nope"}}}, "distlocks.E003", "uses database 'nope'"),
    ],
)
def test_bad_settings_are_reported(settings, value, check_id, text):
    messages = ids(value, settings)
    assert len(messages) == 1
    assert messages[0][0] == check_id
    assert text in messages[0][1]


@pytest.mark.parametrize(
    "value",
    [
        {"default": {"BACKEND": "distlocks.backends.nope.Backend"}},
        {"default": {"BACKEND": DB, "TTL": -1}},
    ],
)
def test_bad_settings_raise_improperly_configured_on_use(settings, value):
    settings.DISTLOCKS = value
    with pytest.raises(ImproperlyConfigured, match="DISTLOCKS\\['default'\\]"):
        distlocks.lock("x")


def test_unknown_database_raises_on_use(settings):
    settings.DISTLOCKS = {"default": {"BACKEND": DB, "OPTIONS": {"DATABASE": "nope"}}}
    with pytest.raises(ImproperlyConfigured, match="names 'nope', which is not in DATABASES"):
        distlocks.lock("x").acquire()
