"""The table of what each pool process holds (:mod:`taskdedup.celery.holders`), with real
forked processes: what the main process of a prefork worker reads when it loses one."""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Iterator

import pytest

from taskdedup.celery import _compat, holders


@pytest.fixture
def table(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    monkeypatch.setattr(holders, "_table", [None])
    monkeypatch.setattr(holders, "_index", [])
    holders.open_table()
    yield


def _child(index: int, task_id: str, *, stay: bool, cleared: bool = False) -> int:
    """A forked 'pool process' of ``index`` that holds ``task_id`` (and clears it when
    ``cleared``), then exits at once or stays alive until killed."""
    read, write = os.pipe()
    child = os.fork()
    if child == 0:  # pragma: no cover - the child
        try:
            _compat.pool_process_index = lambda: index  # type: ignore[assignment]
            holders.hold(task_id)
            if cleared:
                holders.clear(task_id)
            os.write(write, b"x")
            if stay:
                time.sleep(60)
        finally:
            os._exit(0)
    os.close(write)
    assert os.read(read, 1) == b"x"
    os.close(read)
    if not stay:
        os.waitpid(child, 0)
    return child


def test_a_dead_process_that_held_the_id_is_named_and_its_slot_emptied(table: None) -> None:
    _child(3, "task-a", stay=False)
    assert holders.lost_held("task-a") is True
    assert holders.lost_held("task-a") is False  # emptied: said once


def test_a_live_holder_or_no_holder_keeps_the_lock(table: None) -> None:
    live = _child(5, "task-b", stay=True)
    try:
        _child(6, "task-b-copy", stay=False, cleared=True)  # held, then completed
        assert holders.lost_held("task-b") is False  # a live pool process holds it
        assert holders.lost_held("task-b-copy") is False  # completed before it died
        assert holders.lost_held("never-held") is False
    finally:
        os.kill(live, signal.SIGKILL)
        os.waitpid(live, 0)
    assert holders.lost_held("task-b") is True  # now its holder is gone


def test_nothing_to_tell_without_a_table_a_slot_or_room_for_the_id(
    table: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    assert holders.lost_held("x" * 200) is None  # longer than a slot holds
    _child(-1, "no-slot", stay=False)  # a process without a pool index says so
    assert holders.lost_held("task-c") is None
    monkeypatch.setattr(holders, "_table", [None])
    assert holders.lost_held("task-c") is None
