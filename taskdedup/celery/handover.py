"""A claim the main process of a prefork worker made, handed to the pool process that runs
its body.

On a prefork worker the main process records each message unacked in kombu's transaction
(:mod:`taskdedup.celery.ahead` carries the claim in it), and the body runs later in a pool
process. A claim that rode that transaction has taken the lock before the pool process
knows of the message, so the pool process must be told, and only by its own worker: a
message header can be forged, and a pool process that skipped its claim on a forged word
would run a body unguarded.

So the two processes share a table (made before the pool forks, at ``worker_init``): the
main process *offers* a slot (the task id, a digest of the lock key, a random generation) and
passes ``[slot, generation]`` with the request; the pool process *takes* it — the slot is
marked taken only if it still holds that generation for that id and key. The main process
renews the lock's lease while the slot is offered (the message may wait in its prefetch
buffer), and *closes* the slot when the request ends, is revoked, or the consumer stops: a
slot still offered then is withdrawn, and its lock released (its body never ran with it), or,
as the consumer stops and the message goes back to the broker, turned back to ``queued``.
Take and close run under one lock shared by the processes, so exactly one of them wins: a
pool process that finds the slot withdrawn claims as usual, and a main process that
finds it taken leaves the lock to the pool process.

Where anything is missing (no table: the pool did not fork from this main process; a table
full; a shared lock not released within :data:`LOCK_TIMEOUT`, which marks the table broken),
nothing is offered and the pool process claims as before.
"""

from __future__ import annotations

import hashlib
import mmap
import multiprocessing
import os
import struct
import weakref
from collections.abc import Callable
from typing import Any, Final

from ..events import logger

__all__ = ["FIELD", "LOCK_TIMEOUT", "SLOTS", "end", "end_all", "hand", "open_table", "pop_field",
           "ready", "room", "take"]

FIELD: Final = "taskdedup_handover"
"""The request field (``[slot, generation]``) by which the main process hands a claim over."""
SLOTS: Final = 4096
"""Claims a worker can have offered at once (its prefetched and running gated messages)."""
LOCK_TIMEOUT: Final = 1.0
"""Seconds a process waits for the table's lock before it calls the table broken."""

_FREE, _OFFERED, _TAKEN = 0, 1, 2  # a withdrawn offer is freed at once
_ID_BYTES: Final = 102
_SLOT: Final = struct.Struct(f"<QB16sB{_ID_BYTES}s")  # generation, state, key digest, id: 128
_HEADER: Final = 128  # byte 0: broken (the lock was not released in time)

_table: list[mmap.mmap | None] = [None]
_lock: list[Any] = [None]
_owner: list[int | None] = [None]  # the process that made the table (the main process)
_free: list[int] = []  # slots the main process may offer
# task id -> (slot and generation, task name, lock key, Deduplicator, Policy, the request,
# weakly): the main process's offers, until it sees them taken (or withdraws them)
_offers: dict[str, tuple[list[int], str, str, Any, Any, Callable[[], Any]]] = {}


def open_table() -> None:
    """Make the table (the worker's main process, before its pool forks). Idempotent."""
    if _table[0] is None:
        _table[0] = mmap.mmap(-1, _HEADER + SLOTS * _SLOT.size)  # anonymous: shared
        _lock[0] = multiprocessing.get_context("fork").Lock()
        _owner[0] = os.getpid()
        _free[:] = range(SLOTS - 1, -1, -1)


def ready() -> bool:
    """Whether this process made a table that works (only the main process offers)."""
    table = _table[0]
    return table is not None and _owner[0] == os.getpid() and not table[0]


def room() -> bool:
    """Whether a claim made now could be offered (a free slot in a working table)."""
    return bool(_free) and ready()


def hand(request: Any, fields: dict[str, Any], name: str, key: str, dedup: Any,
         policy: Any) -> bool:
    """The main process's claim of ``request``'s call took ``key``: offer it to the pool
    process that will run the body, through the request's ``fields``, and renew its lease
    while it is offered and the request lives. False when it cannot be offered (the caller
    releases the lock). The offers seen taken since the last call are closed first, and
    those whose request is gone untaken are withdrawn and their locks released."""
    _reap()
    task_id = request.id
    handed = _offer(task_id, key)
    if handed is None:
        return False
    ref = weakref.ref(request)
    fields[FIELD] = handed
    _offers[task_id] = (handed, name, key, dedup, policy, ref)
    beat = dedup.heartbeat()
    beat.add(name, key, task_id, policy.lease_ms)
    beat.hand_over(key, task_id, lambda: ref() is None or not _offered(handed))
    return True


def _reap() -> None:
    """Close the offers a pool process took, and end those whose request Celery let go
    while still offered (a body that never reached its claim)."""
    for task_id, (handed, *_, ref) in list(_offers.items()):
        if _state(handed) != _OFFERED or ref() is None:
            end(task_id)


def end(task_id: str | None, *, release: bool = True, requeued: bool = False) -> None:
    """The request of ``task_id`` ended, was revoked, or will not run here (main process):
    close its offer; a claim no pool process took is released (``release``), else left to
    the caller, who releases it. ``requeued``: the message goes back to the broker (the
    consumer stops), so the lock goes back to ``queued`` by its id, as it was before the
    claim (SPEC §5: the requeued message runs at once; a duplicate meanwhile is still one).
    Never raises."""
    entry = _offers.pop(task_id, None) if task_id else None
    if entry is None:
        return
    handed, name, key, dedup, policy, _ = entry
    try:
        withdrawn = _close(handed)
        if withdrawn and requeued and policy.mode.gates_enqueue:
            dedup.stop_heartbeat(key, task_id)
            dedup.store.reserve(key, task_id, policy.ttl_ms)  # its own running -> queued
        elif withdrawn and release:
            dedup.release(name, key, task_id, reason="stopped")  # its renewals stop too
        else:  # taken (the pool process renews and settles it), released by the caller, or
            # a broken table that cannot tell: the lease lapses unless a body renews it
            dedup.heartbeat().remove(key, task_id)
    except Exception as exc:  # the lock lapses within its lease
        logger.warning("taskdedup: the claim carried for %s[%s] could not be given back (%s): "
                       "it lapses within its lease", name, task_id, exc)


def end_all() -> None:
    """Close every offer (the main process's consumer stops: what was not taken will not run
    here; its message goes back to the broker, its lock back to ``queued``)."""
    for task_id in list(_offers):
        end(task_id, requeued=True)


def pop_field(request: Any) -> Any:
    """The offer a pool process's request carries, taken off it (so that a retry or a
    replaced task does not carry it on): ``[slot, generation]``, or None."""
    handed = request.__dict__.pop(FIELD, None)
    headers = getattr(request, "headers", None)
    if isinstance(headers, dict):
        headers.pop(FIELD, None)
    return handed


def _digest(key: str) -> bytes:
    return hashlib.blake2b(key.encode(), digest_size=16).digest()


def _locked() -> bool:
    lock, table = _lock[0], _table[0]
    if lock is None or table is None or table[0]:
        return False
    if lock.acquire(timeout=LOCK_TIMEOUT):
        return True
    table[0] = 1
    logger.error("taskdedup: the table by which a prefork worker hands claims to its pool "
                 "processes stayed locked for %.0f s (a pool process killed while it held "
                 "the lock): claims are no longer handed over; each pool process claims its "
                 "own", LOCK_TIMEOUT)
    return False


def _offer(task_id: str, key: str) -> list[int] | None:
    """Offer the claim of ``task_id`` on ``key`` (main process): the ``[slot, generation]``
    to pass with the request, or None (no table, full, broken: hand nothing over)."""
    raw = task_id.encode()
    table = _table[0]
    if not ready() or table is None or len(raw) > _ID_BYTES or not _free:
        return None
    slot = _free.pop()
    generation = int.from_bytes(os.urandom(8), "little") or 1
    if not _locked():
        return None  # the slot stays out of the free list: the table is broken anyway
    try:
        _SLOT.pack_into(table, _HEADER + slot * _SLOT.size, generation, _OFFERED, _digest(key),
                        len(raw), raw)
    finally:
        _lock[0].release()
    return [slot, generation]


def take(handed: Any, task_id: str, key: str) -> bool:
    """Take the claim handed over as ``handed`` (a pool process, about to run ``task_id``
    guarded by ``key``): True when the slot still offers it, now marked taken — the lock is
    this process's, claimed for it; False otherwise (claim as usual)."""
    table = _table[0]
    if (table is None or not isinstance(handed, (list, tuple)) or len(handed) != 2
            or not all(type(part) is int for part in handed)):
        return False
    slot, generation = handed
    if not 0 <= slot < SLOTS or not _locked():
        return False
    try:
        offset = _HEADER + slot * _SLOT.size
        held, state, digest, length, raw = _SLOT.unpack_from(table, offset)
        if (held != generation or state != _OFFERED or digest != _digest(key)
                or raw[:length] != task_id.encode()):
            return False
        _SLOT.pack_into(table, offset, held, _TAKEN, digest, length, raw)
        return True
    finally:
        _lock[0].release()


def _close(handed: list[int]) -> bool | None:
    """End the offer ``handed`` (main process: its request ended, was revoked, or the
    consumer stops). True when it was still offered (now withdrawn: no pool process will take
    it, and the caller releases the lock), False when a pool process took it, None when the
    table cannot tell (broken: the lock lapses with its lease unless a pool process took it).
    """
    table = _table[0]
    slot, generation = handed
    if table is None or _owner[0] != os.getpid() or not _locked():
        return None
    try:
        offset = _HEADER + slot * _SLOT.size
        held, state, *_ = _SLOT.unpack_from(table, offset)
        if held != generation:
            return None
        _SLOT.pack_into(table, offset, 0, _FREE, b"", 0, b"")
    finally:
        _lock[0].release()
    _free.append(slot)
    return bool(state == _OFFERED)


def _state(handed: list[int]) -> int:
    """The state of offer ``handed``, read without the lock (the main process's own
    bookkeeping: a stale answer is corrected under the lock by :func:`_close`); free when the
    slot holds another generation."""
    table = _table[0]
    if table is None:
        return _FREE
    slot, generation = handed
    held, state, *_ = _SLOT.unpack_from(table, _HEADER + slot * _SLOT.size)
    return int(state) if held == generation else _FREE


def _offered(handed: list[int]) -> bool:
    """Whether ``handed`` is still offered (no pool process took it yet), for the main
    process's lease renewals (a stale answer renews once more)."""
    return _state(handed) == _OFFERED
