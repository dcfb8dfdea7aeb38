"""Every bad argument of the contract fails at once, naming the argument."""

from __future__ import annotations

import pytest
from django.core.exceptions import ImproperlyConfigured

import distlocks


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"name": ""}, "name must not be empty"),
        ({"name": 42}, "name must be a str, not int"),
        ({"name": None}, "name must be a str, not NoneType"),
        ({"name": b"x"}, "name must be a str, not bytes"),
        ({"name": "x" * 256}, "name is 256 characters long; the 'default' backend takes at most 255"),
        ({"name": "sur\udc80"}, "name must be text that UTF-8 can encode: 'sur"),
        ({"ttl": 0}, "ttl must be a finite number of seconds greater than 0"),
        ({"ttl": -1}, "ttl must be a finite number of seconds greater than 0"),
        ({"ttl": float("nan")}, "ttl must be a finite number"),
        ({"ttl": float("inf")}, "ttl must be a finite number"),
        ({"ttl": "10"}, "ttl must be a number of seconds, not str"),
        ({"ttl": True}, "ttl must be a number of seconds, not bool"),
        ({"wait": -0.1}, "wait must be 0 or more seconds"),
        ({"wait": float("nan")}, "wait must be 0 or more seconds"),
        ({"wait": "5"}, "wait must be a number of seconds or None, not str"),
        ({"renew": "yes"}, "renew must be True or False"),
        ({"using": 3}, "using must be the str alias"),
    ],
)
def test_bad_argument(kwargs, message):
    kwargs = {"name": "report", **kwargs}
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        distlocks.lock(**kwargs)


def test_bad_wait_on_acquire():
    with pytest.raises(ValueError, match="wait must be 0 or more seconds"):
        distlocks.lock("report").acquire(wait=-1)


@pytest.mark.parametrize("token", ["12", 1.0, True, None])
def test_resume_refuses_a_token_that_is_no_int(token):
    # The backends compare it on the server now: a str would reach the database as a type error.
    with pytest.raises(ValueError, match="token must be the int that detach"):
        distlocks.lock("report").resume(token)


def test_unknown_alias():
    with pytest.raises(ImproperlyConfigured, match="DISTLOCKS has no alias 'nope'"):
        distlocks.lock("report", using="nope")


def test_key_prefix_counts_against_the_length(settings):
    settings.DISTLOCKS = {"default": {"BACKEND": "distlocks.backends.db.DatabaseBackend", "KEY_PREFIX": "shop"}}
    assert distlocks.lock("x" * 250).key == "shop:" + "x" * 250
    with pytest.raises(ValueError, match="takes at most 250"):
        distlocks.lock("x" * 251)


def test_infinite_wait_means_forever():
    assert distlocks.lock("report", wait=float("inf")).wait is None


@pytest.mark.parametrize("alias", ["mariadb_native", "postgresql_native", "redis", "zookeeper", "locmem"])
def test_a_name_utf8_cannot_encode_fails_at_once_on_every_backend(alias):
    # It used to pass here and raise the codec's UnicodeEncodeError at the acquire,
    # naming a position in the backend's own key ("position 16" for a 4-character name on MariaDB).
    for make in (
        lambda: distlocks.lock("sur\udc80", using=alias),
        lambda: distlocks.semaphore("sur\udc80", 2, using=alias),
        lambda: distlocks.read_write_lock("sur\udc80", using=alias),
        lambda: distlocks.multi_lock(["ok", "sur\udc80"], using=alias),
    ):
        with pytest.raises(ValueError, match="must be text that UTF-8 can encode: .* at index 3"):
            make()
