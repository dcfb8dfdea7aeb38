"""The checks of arguments that every lock kind and backend share: a clear ValueError at once, naming the argument."""

from __future__ import annotations

import math
from typing import Any


def check_name_and_alias(name: Any, using: Any) -> None:
    """Refuse a lock name that is not a non-empty str, and an alias that is not a str (every lock kind's first check)."""
    if not isinstance(name, str):
        raise ValueError(f"name must be a str, not {type(name).__name__}")
    if not name:
        raise ValueError("name must not be empty")
    check_encodable(name, "name")
    if not isinstance(using, str):
        raise ValueError(f"using must be the str alias of a DISTLOCKS entry, not {type(using).__name__}")


def check_encodable(name: str, what: str) -> None:
    """Refuse a name that UTF-8 cannot encode (a lone surrogate): no server could store it.

    Without this, the database, native, Redis and ZooKeeper backends raised the
    codec's UnicodeEncodeError only at the acquire, naming a position in their own key.
    """
    try:
        name.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise ValueError(
            f"{what} must be text that UTF-8 can encode: {name!r} has the lone surrogate "
            f"{name[exc.start]!r} at index {exc.start}"
        ) from None


def check_positive_number(value: Any, what: str) -> float:
    """Return ``value`` as a float, or raise ValueError naming ``what``."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ValueError(f"{what} must be a number of seconds, not {type(value).__name__}")
    if not math.isfinite(value) or value <= 0:
        raise ValueError(f"{what} must be a finite number of seconds greater than 0, not {value!r}")
    return float(value)


def check_count(value: Any, what: str) -> int:
    """Return ``value``, an int of 0 or more, or raise ValueError naming ``what``."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{what} must be an int (0 or more), not {type(value).__name__}")
    if value < 0:
        raise ValueError(f"{what} must be 0 or more, not {value!r}")
    return value


def check_wait(wait: Any) -> float | None:
    """Return ``wait`` as seconds (None: forever), or raise ValueError."""
    if wait is None:
        return None
    if isinstance(wait, bool) or not isinstance(wait, int | float):
        raise ValueError(f"wait must be a number of seconds or None, not {type(wait).__name__}")
    if math.isnan(wait) or wait < 0:
        raise ValueError(f"wait must be 0 or more seconds (None waits forever), not {wait!r}")
    return None if math.isinf(wait) else float(wait)
