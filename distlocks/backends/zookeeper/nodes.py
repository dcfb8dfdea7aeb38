"""Names of ZooKeeper lock nodes: the escaped lock parent, and our children in queue order."""

from __future__ import annotations

import re
import uuid
from urllib.parse import quote, unquote

PREFIX = "lock-"

# Our nodes' names: PREFIX, a random id, and the sequence number ZooKeeper appends.
_OURS = re.compile(re.escape(PREFIX) + r"[0-9a-f]{32}-[0-9]{10}")


def escape(key: str) -> str:
    """The lock parent's node name for ``key``: any key is one valid node name."""
    escaped = quote(key, safe="")
    if escaped in (".", ".."):
        escaped = escaped.replace(".", "%2E")  # ZooKeeper refuses them as names; quote() never writes %2E
    return escaped


def unescape(escaped: str) -> str:
    """The key whose lock parent is named ``escaped``."""
    return unquote(escaped)


def new_mark() -> str:
    """A name for our next node (PREFIX and a random id): ZooKeeper appends the sequence number."""
    return f"{PREFIX}{uuid.uuid4().hex}-"


def sequence(child: str) -> str:
    """The sequence number ZooKeeper appended to a child's name (10 digits)."""
    return child[-10:]


def queue(children: list[str]) -> list[str]:
    """Our nodes among a lock's children, in queue order: a stranger's child neither blocks nor holds."""
    return sorted((child for child in children if _OURS.fullmatch(child)), key=sequence)
