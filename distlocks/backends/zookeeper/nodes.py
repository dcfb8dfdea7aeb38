"""Names of ZooKeeper lock nodes: the escaped lock parent, and our children in queue order."""

from __future__ import annotations

import re
import uuid
from typing import Any
from urllib.parse import quote, unquote

PREFIX = "lock-"

# Our nodes' names: PREFIX, a random id, and the sequence number ZooKeeper appends.
_OURS = re.compile(re.escape(PREFIX) + r"[0-9a-f]{32}-[0-9]{10}")


# A read-write lock's nodes: "read-", "write-", or "downgrade-" (a read by the write holder), then as ours.
_RW = re.compile(r"(read|write|downgrade)-[0-9a-f]{32}-[0-9]{10}")


def new_rw_mark(kind: str) -> str:
    """A name for our next node of a read-write lock: ``kind`` is read, write or downgrade."""
    return f"{kind}-{uuid.uuid4().hex}-"


def rw_queue(children: list[str]) -> list[str]:
    """A read-write lock's nodes among its children, in queue order."""
    return sorted((child for child in children if _RW.fullmatch(child)), key=sequence)


def rw_blockers(children: list[str], mine: str) -> list[str]:
    """The nodes that keep ``mine`` (one of ``children``, in queue order) waiting, the one to watch last.

    A reader waits for the writers queued before it; a writer for every node
    before it and for the readers that took the lock from its writer (the
    "downgrade-" nodes), wherever they are queued. A downgrade waits for none.
    """
    kind = mine.partition("-")[0]
    if kind == "downgrade":
        return []
    before = children[: children.index(mine)]
    if kind == "read":
        return [child for child in before if child.startswith("write-")]
    return before + [child for child in children[children.index(mine) :] if child.startswith("downgrade-")]


def node_data(owner: object, count: int, token: str = "") -> bytes:
    """A node's data, for operators: "owner|count", with "|t<token>" when its token is not its creation zxid.

    "|t" alone: the token is the zxid of the write that put it there (the
    node's ``mzxid`` until the count is written again, with the token).
    """
    return f"{owner}|{count}{'|' + token if token else ''}".encode()


def parse_data(data: bytes, stat: Any) -> tuple[str, int, int]:
    """The owner, hold count and token that a node's data (``node_data``) and ``stat`` show."""
    text = data.decode(errors="replace")
    token = int(stat.czxid)
    head, _, last = text.rpartition("|")
    if head and last.startswith("t") and last[1:].isdigit():
        token, text = int(last[1:]), head
    elif head and last == "t":
        token, text = int(stat.mzxid), head
    holder, _, count = text.rpartition("|")
    return holder, int(count) if count.isdigit() else 1, token


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
