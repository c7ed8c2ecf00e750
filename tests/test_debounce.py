"""Debounce with real Celery prefork workers (two workers of two processes each; SPEC §15,
issue #22 part 3): a burst runs once, ``wait`` after its last call, with that call's
arguments; with ``max_wait`` at least every ``max_wait`` during a long burst and once after
it; the success window does not stop the next burst; every caller's handle ends (the
superseded ones SUCCESS with a marker). The warm restart: tests/test_debounce_restart.py."""

from __future__ import annotations

import time
import uuid
from typing import Any

import pytest
import redis

from taskdedup.flow import superseded_of
from taskdedup.stats import read_stats
from taskdedup.testing import wait_for
from tests.effects import recorded
from tests.pairs import celery_pair
from tests.workers import CeleryWorker

pytestmark = pytest.mark.slow

QUEUE = "it-debounce"


class FlowWorker(CeleryWorker):
    app_module = "tests.flow_app"


workers, capp = celery_pair(FlowWorker, QUEUE)


def label() -> str:
    return uuid.uuid4().hex[:12]


def superseded(rc: redis.Redis, task: str) -> int:
    """``skipped:superseded`` of ``task`` as the workers flushed it (every ~5 s)."""
    found = read_stats(rc, task=f"tests.flow_app.{task}")
    return sum(s.get("skipped:superseded") for s in found.values())


def test_a_burst_runs_once_after_wait_with_the_last_arguments(
    capp: Any, rc: redis.Redis, workers: list[CeleryWorker]
) -> None:
    """Five calls 0.2 s apart (wait=1.5): one run, not before 1.5 s after the last call, with
    the last call's argument; the four others end SUCCESS with the superseded marker (every
    handle final), counted as superseded."""
    name = label()
    before = superseded(rc, "debounced")
    handles = []
    for n in range(5):
        if n:
            time.sleep(0.2)
        last_sent = time.monotonic()
        handles.append(capp.debounced.delay(name, n))
    assert handles[-1].get(timeout=30) == 4
    assert time.monotonic() - last_sent >= 1.5
    for handle in handles[:-1]:
        assert superseded_of(handle.get(timeout=30)) is not None
        assert handle.state == "SUCCESS"
    assert recorded(rc, name) == ["start4", "end4"]
    wait_for(lambda: superseded(rc, "debounced") >= before + 4, timeout=20, interval=0.5,
             what="the superseded calls counted")


def test_the_success_window_does_not_stop_the_next_burst(
    capp: Any, rc: redis.Redis, workers: list[CeleryWorker]
) -> None:
    """until_expired with ttl=300: the identity is done after the first burst's run; the
    second burst runs all the same (once per burst)."""
    name = label()
    capp.debounced.delay(name, 0)
    assert capp.debounced.delay(name, 1).get(timeout=30) == 1
    capp.debounced.delay(name, 2)
    assert capp.debounced.delay(name, 3).get(timeout=30) == 3
    assert recorded(rc, name) == ["start1", "end1", "start3", "end3"]


def test_a_long_burst_runs_at_least_every_max_wait_and_after_its_end(
    capp: Any, rc: redis.Redis, workers: list[CeleryWorker]
) -> None:
    """wait=1, max_wait=2.5, a call every 0.3 s for 6 s: the first run starts within
    max_wait (+ delivery slack) of the first call, with the latest argument of that time;
    runs keep coming during the burst and once after it with the very last argument;
    never two at once."""
    name = label()
    first_sent = time.monotonic()
    first_run: float | None = None
    handles = []
    n = 0
    while time.monotonic() - first_sent < 6.0:
        handles.append(capp.debounced_max.delay(name, n))
        n += 1
        if first_run is None and recorded(rc, name):
            first_run = time.monotonic()
        time.sleep(0.3)
    assert first_run is not None and first_run - first_sent <= 2.5 + 1.5
    assert handles[-1].get(timeout=30) == n - 1
    for handle in handles:  # every handle final
        handle.get(timeout=30)
    runs = [r for r in recorded(rc, name) if r.startswith("start")]
    assert "overlap" not in recorded(rc, name)
    assert len(runs) >= 3, runs  # at ~2.5 s, ~5 s, and after the end
    assert len(runs) <= 5, runs
    assert runs[-1] == f"start{n - 1}"
    numbers = [int(r.removeprefix("start")) for r in runs]
    assert numbers == sorted(numbers)
