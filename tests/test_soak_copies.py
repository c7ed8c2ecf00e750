"""A soak of kombu's copies with kills (issue #19 "Done means"; SPEC §5): not in the default run.

Hundreds of calls with countdowns beyond the broker's ``visibility_timeout`` (4 s), on two
Celery workers (prefork, 2 processes each; ``tests.model_app``: acks late, STARTED tracked),
while a worker is SIGKILLed at random moments — the whole worker (main process and children,
then restarted) or one pool process (``reject_on_worker_lost`` requeues its message). kombu
restores every message a worker holds past the visibility timeout, so each call exists in
several copies at its ETA, and a killed worker's held copies come back later still.

Counted per call, from what the bodies record (``soak:<key>``: ``start``, ``end`` and
``completed`` — after taskdedup's own completion — each with task id, process group, pid):

* **double runs**: a body completed more than once. A body killed half-way runs again under
  the same id once its lease lapsed (at-least-once, not a duplicate): completed bodies are
  counted, not starts; a body that ended but was killed before its lock's completion may
  run again too, and is counted apart;
* **lost calls**: a call whose result is not SUCCESS with its value at the end. One whose
  message no worker ever received, found in no queue and no unacked hash, its lock still
  queued by its id, was popped by a worker SIGKILLed before kombu recorded it unacked (the
  fetch window of SPEC §17, which kombu's Redis transport leaves open): counted apart, and
  the run ends XFAIL naming them rather than passed;
* a start without an end from a process that was never killed (a body that vanished).

Run it (a few minutes for 300 calls)::

    TASKDEDUP_SOAK_COPIES=300 pytest tests/test_soak_copies.py -s

``TASKDEDUP_SOAK_SEED`` replays a run's calls and kills (the seed is printed first);
``TASKDEDUP_SOAK_RATE`` sets the calls sent per second (2).
"""

from __future__ import annotations

import os
import random
import signal
import subprocess
import time
import uuid
from collections import Counter
from collections.abc import Iterator
from typing import Any

import pytest
import redis

from taskdedup.testing import wait_for
from tests.conftest import ModelWorker

CALLS = int(os.environ.get("TASKDEDUP_SOAK_COPIES", "0"))

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not CALLS, reason="the copies soak runs with TASKDEDUP_SOAK_COPIES=<calls>"),
    pytest.mark.timeout(900 + 2 * CALLS),
]

RATE = float(os.environ.get("TASKDEDUP_SOAK_RATE", "2"))  # calls sent per second
KILL_EVERY = (3.0, 9.0)  # seconds between two kills
DOWN_FOR = (0.0, 3.0)  # seconds a whole worker stays down
COUNTDOWN = (4.5, 12.0)  # beyond the 4 s visibility timeout: restored 1-3 times before due
BODY = (0.2, 1.5)  # seconds a body takes


@pytest.fixture(scope="module")
def soak_workers(redis_url: str) -> Iterator[list[ModelWorker]]:
    queue = f"soak-{uuid.uuid4().hex[:6]}"
    workers = [ModelWorker(redis_url, queue=queue, concurrency=2) for _ in range(2)]
    try:
        for worker in workers:
            worker.start()
        yield workers
    finally:
        for worker in workers:
            worker.kill()


@pytest.fixture(scope="module")
def sapp(rc: redis.Redis, redis_url: str, soak_workers: list[ModelWorker]) -> Any:
    from tests import model_app

    model_app.app.conf.update(broker_url=redis_url, result_backend=redis_url,
                              task_default_queue=soak_workers[0].queue)
    model_app.app.__dict__.pop("_taskdedup", None)
    return model_app


def children(pid: int) -> list[int]:
    """The pool processes of a worker's main process."""
    out = subprocess.run(["ps", "-o", "pid=", "--ppid", str(pid)], capture_output=True,
                         text=True, check=False).stdout
    return [int(x) for x in out.split()]


class Killer:
    """SIGKILLs a random worker (whole, then restarted; or one pool process) and remembers
    every process group and pid it killed."""

    def __init__(self, rng: random.Random, workers: list[ModelWorker]) -> None:
        self.rng = rng
        self.workers = workers
        self.groups: set[int] = set()
        self.pids: set[int] = set()
        self.whole = 0
        self.child = 0
        self.down: dict[int, float] = {}  # worker index -> when to restart it

    def kill(self) -> None:
        up = [i for i in range(len(self.workers)) if i not in self.down]
        if not up:
            return
        i = self.rng.choice(up)
        worker = self.workers[i]
        assert worker.process is not None
        pool = children(worker.process.pid)
        if pool and self.rng.random() < 0.3:
            pid = self.rng.choice(pool)
            self.pids.add(pid)
            os.kill(pid, signal.SIGKILL)
            self.child += 1
            return
        self.groups.add(worker.process.pid)  # the worker leads its own process group
        worker.kill()
        self.whole += 1
        self.down[i] = time.monotonic() + self.rng.uniform(*DOWN_FOR)

    def restart_due(self, everyone: bool = False) -> None:
        for i, at in list(self.down.items()):
            if everyone or time.monotonic() >= at:
                self.workers[i].start(timeout=120)
                del self.down[i]

    def killed(self, group: int, pid: int) -> bool:
        return group in self.groups or pid in self.pids


def restore(app: Any) -> None:
    """kombu's own restore of messages held past the visibility timeout (older kombu runs it
    only every ~100 s)."""
    with app.connection_for_write() as conn:
        conn.default_channel.qos.restore_visible(num=1000, interval=1)


def test_copies_and_kills_neither_run_a_call_twice_nor_lose_one(
    sapp: Any, rc: redis.Redis, soak_workers: list[ModelWorker]
) -> None:
    seed = int(os.environ.get("TASKDEDUP_SOAK_SEED", random.randrange(1 << 30)))
    print(f"\ncopies soak: seed {seed}, {CALLS} calls")
    rng = random.Random(seed)
    killer = Killer(rng, soak_workers)
    queue = soak_workers[0].queue
    calls: list[tuple[str, Any]] = []  # (key, handle)
    locks: dict[str, str] = {}  # key -> its lock's key
    started = time.monotonic()
    next_kill = started + rng.uniform(*KILL_EVERY)
    while len(calls) < CALLS:
        # pacing of the load, not a wait for a condition
        time.sleep(max(0.0, started + len(calls) / RATE - time.monotonic()))
        task = rng.choice((sapp.soak_window, sapp.soak_once))
        key = f"{task.name.rsplit('_', 1)[1]}-{uuid.uuid4().hex[:10]}"
        args = (key, rng.uniform(*BODY))
        locks[key] = lock_key(sapp, task, args)
        calls.append((key, task.apply_async(args, countdown=rng.uniform(*COUNTDOWN))))
        if time.monotonic() >= next_kill:
            killer.kill()
            next_kill = time.monotonic() + rng.uniform(*KILL_EVERY)
        killer.restart_due()
    killer.restart_due(everyone=True)
    sent_for = time.monotonic() - started

    shown = [time.monotonic()]

    def finished() -> bool:
        restore(sapp.app)
        done = sum(1 for _, handle in calls if handle.state == "SUCCESS")
        if time.monotonic() - shown[0] > 15:
            shown[0] = time.monotonic()
            print(f"copies soak: {done}/{CALLS} SUCCESS, {rc.llen(queue)} queued, "
                  f"{rc.hlen('unacked')} unacked, {time.monotonic() - started:.0f}s", flush=True)
        return done == CALLS

    try:
        wait_for(finished, timeout=300 + CALLS, interval=1.0, what="every call SUCCESS")
    except TimeoutError:
        pass  # counted as lost below
    since: list[float] = []

    def quiet() -> bool:  # every copy ended: nothing queued or held for two restores
        restore(sapp.app)
        if rc.llen(queue) or rc.hlen("unacked"):
            since.clear()
            return False
        since.append(time.monotonic())
        return since[-1] - since[0] >= 10

    wait_for(quiet, timeout=120, interval=0.5, what="every copy to end")

    double: dict[str, list[str]] = {}
    rerun_after_end: list[str] = []
    vanished: dict[str, list[str]] = {}
    lost: dict[str, str] = {}
    ends = Counter[str]()
    starts = 0
    for key, handle in calls:
        records = [x.decode().split() for x in rc.lrange(f"soak:{key}", 0, -1)]
        starts += sum(1 for r in records if r[0] == "start")
        completed = [r for r in records if r[0] == "completed"]
        ended = [r for r in records if r[0] == "end"]
        ends[key] = len(ended)
        if len(completed) > 1:
            double[key] = [" ".join(r) for r in records]
        # an end whose completion never came: killed between the two (may run again)
        done_pids = {(r[1], r[3]) for r in completed}
        for r in ended:
            if (r[1], r[3]) not in done_pids:
                if killer.killed(int(r[2]), int(r[3])):
                    rerun_after_end.append(key)
                else:
                    vanished.setdefault(key, []).append(" ".join(r))
        done = {(r[1], r[3]) for r in ended}
        for r in records:
            if r[0] == "start" and (r[1], r[3]) not in done and not killer.killed(
                    int(r[2]), int(r[3])):
                vanished.setdefault(key, []).append(" ".join(r))
        if any(r[1] != handle.id for r in records):
            double.setdefault(key, []).append(f"a body under another id than {handle.id}")
        if handle.state != "SUCCESS" or handle.result != key or not completed:
            lost[key] = f"{handle.state} {handle.result!r}, {len(completed)} completed"
    copies_ended = sum(
        1 for _, handle in calls for state in rc.lrange(f"model:done:{handle.id}", 0, -1)
        if state == b"IGNORED")
    print(f"copies soak: seed {seed}: {CALLS} calls sent in {sent_for:.0f}s, "
          f"{time.monotonic() - started:.0f}s in all; {killer.whole} whole-worker kills, "
          f"{killer.child} pool-process kills; {starts} body starts, {sum(ends.values())} "
          f"ends, {starts - CALLS} restarts of killed bodies; {copies_ended} copies put off "
          f"or ended without running; double runs {len(double)}, lost {len(lost)}, ended but "
          f"killed before completion {len(rerun_after_end)}, vanished {len(vanished)}")
    assert not double, f"seed {seed}: calls whose body completed twice: {double}"
    assert not vanished, f"seed {seed}: bodies that stopped without being killed: {vanished}"
    # A call whose message no worker ever received, found nowhere, its lock still queued by
    # its id: taken from the queue by a worker killed before kombu recorded it unacked
    # (BRPOP, then a second round trip: SPEC §17, not closed yet). Not taskdedup's loss, but a
    # loss: reported apart, and the run ends XFAIL rather than passed.
    logs = "".join(worker.output() for worker in soak_workers)
    handles = dict(calls)
    popped = sorted(key for key in lost if f"[{handles[key].id}] received" not in logs
                    and not rc.lrange(f"soak:{key}", 0, -1)
                    and rc.get(locks[key]) == f"Q||{handles[key].id}".encode())
    others = {key: reason for key, reason in lost.items() if key not in popped}
    print(f"copies soak: seed {seed}: lost in kombu's fetch window {len(popped)}, "
          f"otherwise lost {len(others)}")
    assert not others, f"seed {seed}: calls not SUCCESS with their value: {others}"
    if popped:
        pytest.xfail(f"seed {seed}: {len(popped)} call(s) lost in kombu's fetch window (SPEC "
                     f"§17: popped by a worker SIGKILLed before it recorded them unacked; "
                     f"never received, the lock still queued by the call's id): {popped}")


def lock_key(sapp: Any, task: Any, args: tuple[Any, ...]) -> str:
    from taskdedup.celery import get_deduplicator

    return str(get_deduplicator(sapp.app).identity(
        task.name, task._dedup_policy, args, {}, func=task._func()).key)
