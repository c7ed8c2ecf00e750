"""The worker's two transitions as one native command where the server compares and sets.

A worker's claim (its own QUEUED lock → RUNNING) and its completion (RUNNING → DONE or the
FINISHED tombstone) are, in the common case, a swap of one exact value for another: the
value before is known to the caller. A server whose ``SET`` takes ``IFEQ`` (Valkey 8.1+)
does that swap itself, atomically, in one command, with none of a script's cost on the
server (a Lua call, its closures, its ``GET`` and ``SET``: ~20 µs per script against ~2 µs).
With ``GET`` the reply is the value found, whether or not the swap was made, so the caller
knows at once whether it was.

Only the expected case is decided here: the reply is exactly the value the swap expected,
so the swap was made. Anything else (no lock, another owner's, a copy's, an argument check
the caller did not expect, the other owner form, an error) goes to the transition's script,
which applies the whole state machine (``lua/claim.lua``, ``lua/complete.lua``): the rules
live in one place, and an uncommon case costs one more round trip. Nothing was written by a
swap that was not made.

Whether a server does this is probed, not inferred from its version: :func:`probe` asks it
once (Redis < 8.4 refuses ``IFEQ``; a server that answers a failed swap with nil, not the
value found, would make every swap look failed, and is not used either).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

from ._compat import as_sent

__all__ = ["Command", "claim_command", "complete_command", "held_check", "probe"]

Command = tuple[Any, ...]


def claim_command(key: str, owner: str, lease_ms: int, *, reserved: bool = True,
                  check: str = "") -> tuple[Command, bytes | None]:
    """The claim as one ``SET`` and the reply that says it was made.

    ``reserved``: the caller's own QUEUED lock is expected (every mode that reserves at
    enqueue), swapped for RUNNING; else (``while_executing``) no lock is, and ``NX`` takes
    it. ``owner`` as the store writes it (compact or text); ``check``: the argument digest
    the reservation holds (an explicit key's), "" for none (unused without a reservation)."""
    if reserved:
        queued = f"Q|{check}|{owner}"
        expect = queued.encode()
        return (("SET", as_sent(key), as_sent(f"R|{check}|{owner}"), b"IFEQ",
                 as_sent(queued, expect), b"PX", b"%d" % lease_ms, b"GET"), expect)
    # as the script takes an absent lock: no check (nothing reserved one)
    return ("SET", as_sent(key), as_sent("R||" + owner), b"NX", b"PX", b"%d" % lease_ms,
            b"GET"), None


def held_check(found: object, owner: str) -> str | None:
    """The argument check of ``found`` (the value a claim's swap found) when it is this
    owner's QUEUED or RUNNING lock holding one (an explicit key's), else None: the store
    remembers it, so the completion swaps at once."""
    if not isinstance(found, bytes) or len(found) < 35 or found[:1] not in (b"Q", b"R"):
        return None
    check, tail = found[2:34], found[34:]
    if found[1:2] != b"|" or tail != b"|" + owner.encode():
        return None
    text = check.decode("ascii", "replace")
    return text if all(c in "0123456789abcdef" for c in text) else None


def complete_command(key: str, owner: str, ttl_ms: int, finished_ms: int, check: str = ""
                     ) -> tuple[Command, bytes] | None:
    """The completion as one ``SET`` and the reply that says it was made: RUNNING → DONE
    for ``ttl_ms`` (``until_expired``), or → the FINISHED tombstone for ``finished_ms``;
    None where the completion deletes the lock (neither given: the script does that).
    ``check`` as in :func:`claim_command` (kept in the value, as the script keeps it)."""
    if ttl_ms > 0:
        value, px = f"D|{check}|{owner}", ttl_ms
    elif finished_ms > 0:
        value, px = f"F|{check}|{owner}", finished_ms
    else:
        return None
    running = f"R|{check}|{owner}"
    expect = running.encode()
    return ("SET", as_sent(key), as_sent(value), b"IFEQ", as_sent(running, expect), b"PX",
            b"%d" % px, b"GET"), expect


def probe(exchange: Callable[[list[Command]], list[Any]], prefix: str = "taskdedup") -> bool:
    """Whether the server behind ``exchange`` (commands pipelined on one connection,
    replies undecoded, errors as values) swaps with ``SET … IFEQ … GET`` and answers the
    value found whether or not it swapped. One round trip, on a key of its own under
    ``prefix`` (where the locks' ACL reaches) that it deletes; any error (an old server, an
    ACL without that key) answers False."""
    key = f"{prefix}:probe:{os.urandom(8).hex()}"
    replies = exchange([
        ("SET", key, "a", "PX", 10_000),
        ("SET", key, "b", "IFEQ", "x", "GET", "PX", 10_000),  # not swapped: answers "a"
        ("SET", key, "c", "IFEQ", "a", "GET", "PX", 10_000),  # swapped: answers "a"
        ("GET", key),
        ("DEL", key),
    ])
    return replies[1:4] == [b"a", b"a", b"c"]
