"""Which lock each pool process of a prefork worker holds, readable by the main process.

When a pool process dies (SIGKILL, the OOM killer), the worker's main process sends
``task_failure`` (``WorkerLostError``) for the task id it was running, and taskdedup releases
that id's lock. But the copies of one message share its id (SPEC §5): the dead process may
have held only a copy being put off while the lock is another copy's, on this worker or on
another one, and a release by id would then let a new call run beside that copy.

So the main process releases only on evidence: a table in shared memory, made before the
pool forks (``worker_init``), holds one slot per pool process (billiard's process index).
A pool process writes its pid and the task id in its slot once its claim has taken the lock,
and clears it when it completes or releases it. The main process then releases a lost
process's lock only when a slot of a process no longer alive names that id; when a live
process's slot names it, or none does (the dead process held a copy, or nothing), the lock
stays, and a lock the dead process did hold lapses within its lease (its heartbeat died with
it). Writing after the claim errs on the safe side: a process killed between its claim and
its write leaves a lock that lapses, never a release of another copy's lock.

Detail relied on (:func:`taskdedup.celery._compat.pool_process_index`): billiard sets
``index`` on each pool process. Without it, or without the table (a worker started without
``worker_init``), nothing is recorded and :func:`lost_held` answers None, as for an id longer
than a slot: the caller keeps its rule from before (another copy active on this worker).
"""

from __future__ import annotations

import mmap
import os
import struct
from typing import Final

from ..pids import pid
from . import _compat

__all__ = ["SLOTS", "clear", "hold", "lost_held", "open_table"]

SLOTS: Final = 1024
"""Pool processes a table has room for (indexes beyond it are not recorded)."""
_ID_BYTES: Final = 119
_SLOT: Final = struct.Struct(f"<qB{_ID_BYTES}s")  # pid, id length, id: 128 bytes

_HEADER: Final = 128  # byte 0: set when a pool process could not find its slot
_table: list[mmap.mmap | None] = [None]
_index: list[int | None] = []  # this process's slot, looked up once per process
_mine: list[str | None] = [None]  # the id this process last wrote in its slot


def _forked() -> None:
    _index.clear()
    _mine[0] = None


os.register_at_fork(after_in_child=_forked)


def open_table() -> None:
    """Make the table (the worker's main process, before its pool forks). Idempotent."""
    if _table[0] is None:
        _table[0] = mmap.mmap(-1, _HEADER + SLOTS * _SLOT.size)  # anonymous: shared


def _slot() -> int | None:
    if not _index:
        index = _compat.pool_process_index()
        _index.append(index if index is not None and 0 <= index < SLOTS else None)
    return _index[0]


def hold(task_id: str) -> None:
    """This pool process's claim of ``task_id`` took the lock: say so in its slot."""
    table = _table[0]
    if table is None:
        return
    index = _slot()
    if index is None:  # the main process cannot tell from this table: it says so
        table[0] = 1
        return
    raw = task_id.encode()
    if len(raw) <= _ID_BYTES:
        _SLOT.pack_into(table, _HEADER + index * _SLOT.size, pid(), len(raw), raw)
        _mine[0] = task_id


def clear(task_id: str) -> None:
    """This pool process completed or released ``task_id``'s lock: empty its slot (once: a
    second call for the same id, or one for an id it does not hold, costs a comparison)."""
    if _mine[0] != task_id:
        return
    _mine[0] = None
    table, index = _table[0], _slot()
    if table is not None and index is not None:
        _SLOT.pack_into(table, _HEADER + index * _SLOT.size, 0, 0, b"")


def lost_held(task_id: str) -> bool | None:
    """For the main process, when a pool process running ``task_id`` was lost: True when a
    process no longer alive holds its lock (its slot is then emptied), False when a live
    pool process holds it or none recorded it, None when nothing can tell (no table, an
    id too long for a slot)."""
    table = _table[0]
    raw = task_id.encode()
    if table is None or table[0] or len(raw) > _ID_BYTES:
        return None
    held_by_dead = False
    for index in range(SLOTS):
        offset = _HEADER + index * _SLOT.size
        holder, length, name = _SLOT.unpack_from(table, offset)
        if not holder or name[:length] != raw:
            continue
        if _alive(holder):
            return False
        _SLOT.pack_into(table, offset, 0, 0, b"")
        held_by_dead = True
    return held_by_dead


def _alive(process_id: int) -> bool:
    try:
        os.kill(process_id, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # pragma: no cover - someone else's process: alive
        return True
    try:  # reaped or not, a zombie runs nothing
        with open(f"/proc/{process_id}/stat", "rb") as stat:
            return stat.read().rsplit(b")", 1)[1].split()[0] != b"Z"
    except (OSError, IndexError):
        return True
