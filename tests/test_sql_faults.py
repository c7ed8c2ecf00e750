"""The proof of the durable tier: workers SIGKILLed at every point of a charge, on PostgreSQL.

Every body charges one order: one ledger row, in one transaction. The first run of each order
pauses at a point the test chose at random and is SIGKILLed there:

* ``before`` the transaction: nothing was written;
* ``inside`` it, after the ledger row, before the commit: PostgreSQL rolls it back when the
  connection dies;
* ``after`` the commit, before the task returned: the row is there, but the broker never heard
  of success, so the task runs again — the case at-least-once delivery cannot avoid.

Half the orders run with :func:`taskdedup.sql.effects` (``durable``), half as a plain
transaction, side by side in the same workers. With ``effects`` every order has exactly one
ledger row and the redelivered run of an order killed after its commit returns the result the
first run stored; without it every order killed after its commit is charged twice.

Celery: acks_late on a Redis broker whose ``visibility_timeout`` is 4 s; the whole worker
(main process and pool threads) is SIGKILLed with its bodies at their points, and a new worker
gets the messages back. RQ: the work-horse running the body is SIGKILLed (as the OOM killer
does); the worker's main process fails the job and ``Retry(max=1)`` runs it again with its id.
And whole RQ workers (main process and horse, as when a machine dies): RQ's abandoned-job
handling (``StartedJobRegistry.cleanup``, run here with a cutoff in the future instead of
waiting for the worker's heartbeat to lapse) fails the job and ``Retry(max=1)`` brings it back
to a new worker.
"""

from __future__ import annotations

import json
import os
import random
import signal
import time
import uuid
from collections import Counter
from collections.abc import Iterator
from typing import Any

import pytest
import redis
import sqlalchemy as sa
from rq.job import Retry
from rq.registry import StartedJobRegistry

from taskdedup.rq import DedupJob, DedupQueue
from taskdedup.testing import wait_for
from tests import sql_apps, sql_jobs
from tests.fault_jobs import report
from tests.sqldb import LEDGER, fresh_engine, rows
from tests.workers import RqWorker

pytestmark = pytest.mark.slow

POINTS = ("before", "inside", "after")
VISIBILITY = 4.0
CELERY_ROUNDS = 4
CELERY_PER_ROUND = 25  # orders per mode per round: 50 bodies killed by each worker kill
RQ_ORDERS = 100  # per mode
RQ_WORKERS = 4
RQ_WHOLE_ROUNDS = 2  # RQ_WORKERS workers killed whole per round, one body each


@pytest.fixture(scope="module")
def pg(tmp_path_factory: pytest.TempPathFactory) -> Iterator[sa.Engine]:
    engine = fresh_engine("postgresql", tmp_path_factory.mktemp("sqlfaults"))
    os.environ["TASKDEDUP_TEST_SQL_URL"] = engine.url.render_as_string(hide_password=False)
    yield engine
    engine.dispose()


def plan(orders: list[str], seed: int) -> dict[str, str]:
    """A kill point for the first run of every order, at random (the seed is reported)."""
    rng = random.Random(seed)
    return {order: rng.choice(POINTS) for order in orders}


def arm(rc: redis.Redis, points: dict[str, str]) -> None:
    with rc.pipeline() as pipe:
        for order, point in points.items():
            pipe.set(f"sql:kill:{order}", point, ex=600)
        pipe.execute()


def broker_state(rc: redis.Redis, queue: str, orders: list[str]) -> str:
    """What kombu holds when redelivery stalls: where the messages are, who holds the mutex."""
    waiting = [o for o in orders if not returned(rc, o)]
    return (f"{len(waiting)} not returned (e.g. {waiting[:3]}), queue {rc.llen(queue)}, "
            f"unacked {rc.zcard('unacked_index')}, "
            f"unacked_mutex ttl {rc.ttl('unacked_mutex')} s")


def returned(rc: redis.Redis, order: str) -> list[Any]:
    return [json.loads(x) for x in rc.lrange(f"sql:ret:{order}", 0, -1)]


def account(rc: redis.Redis, engine: sa.Engine, points: dict[str, str],
            durable: set[str]) -> dict[str, Any]:
    """Per order: ledger rows, runs, what the last run returned; figures per mode."""
    ledger = Counter(row.order_id for row in rows(engine, LEDGER))
    figures: dict[str, Any] = {}
    for mode, orders in (("effects", [o for o in points if o in durable]),
                         ("plain", [o for o in points if o not in durable])):
        by_point = Counter(points[o] for o in orders)
        figures[mode] = {
            "orders": len(orders), "bodies_killed": len(orders),
            "killed_before_transaction": by_point["before"],
            "killed_inside_transaction": by_point["inside"],
            "killed_after_commit": by_point["after"],
            "runs": sum(int(rc.get(f"sql:attempt:{o}") or 0) for o in orders),
            "ledger_rows": sum(ledger[o] for o in orders),
            "orders_missing": sum(1 for o in orders if ledger[o] == 0),
            "orders_charged_twice_or_more": sum(1 for o in orders if ledger[o] > 1),
            "redelivered_runs_returning_the_stored_result": sum(
                1 for o in orders if points[o] == "after" and o in durable
                and returned(rc, o) == [{"charged": 100, "attempt": 1}]
                and int(rc.get(f"sql:attempt:{o}") or 0) == 2),
        }
    return figures


def check(figures: dict[str, Any]) -> None:
    fx, plain = figures["effects"], figures["plain"]
    assert fx["orders_missing"] == 0 and fx["orders_charged_twice_or_more"] == 0
    assert fx["ledger_rows"] == fx["orders"]
    assert fx["redelivered_runs_returning_the_stored_result"] == fx["killed_after_commit"]
    assert fx["runs"] == 2 * fx["orders"]  # every killed body ran again, exactly once
    # the plain run is the control: the same kills charge every order killed after its commit
    # twice (and lose none)
    assert plain["orders_missing"] == 0
    assert plain["orders_charged_twice_or_more"] == plain["killed_after_commit"] > 0


def test_celery_workers_sigkilled_at_every_point_charge_each_order_once(
    redis_url: str, rc: redis.Redis, pg: sa.Engine
) -> None:
    queue = f"sqlfaults-{uuid.uuid4().hex[:6]}"
    sql_apps.configure(redis_url, queue)
    seed = int(time.time())
    env = {"TASKDEDUP_TEST_VISIBILITY": str(VISIBILITY),
           "TASKDEDUP_TEST_SQL_URL": os.environ["TASKDEDUP_TEST_SQL_URL"]}

    def start() -> Any:
        return sql_apps.SqlCeleryWorker(redis_url, queue=queue, pool="threads",
                                        concurrency=2 * CELERY_PER_ROUND, env=env).start()

    points: dict[str, str] = {}
    durable: set[str] = set()
    worker = start()
    try:
        for round_ in range(CELERY_ROUNDS):
            orders = [f"C{round_}-{n}-{uuid.uuid4().hex[:6]}"
                      for n in range(2 * CELERY_PER_ROUND)]
            chosen = plan(orders, seed + round_)
            arm(rc, chosen)
            points.update(chosen)
            for n, order in enumerate(orders):
                is_durable = n % 2 == 0
                durable.update([order] if is_durable else [])
                sql_apps.charge.apply_async((order, 100, is_durable))
            paused = set(orders)
            wait_for(lambda paused=paused: paused <= {
                x.decode().split(":")[0] for x in rc.lrange("sql:at", 0, -1)},
                timeout=60, what="every body at its kill point")
            worker.kill()
            # kombu restores a dead worker's unacknowledged messages once they are past the
            # visibility timeout; start the next worker when they are (see test_faults_kill)
            wait_for(lambda: not rc.zrangebyscore("unacked_index",
                                                  time.time() - VISIBILITY - 0.5, "+inf"),
                     timeout=30, what="the killed worker's messages past visibility_timeout")
            worker = start()
            try:
                wait_for(lambda orders=orders: all(returned(rc, o) for o in orders),
                         timeout=90, what="every killed charge redelivered and returned")
            except TimeoutError as exc:
                raise TimeoutError(f"{exc}; {broker_state(rc, queue, orders)}") from None
    finally:
        worker.stop()
    figures = account(rc, pg, points, durable)
    report("sql_sigkill_celery", seed=seed, worker_sigkills=CELERY_ROUNDS,
           redelivery=f"acks_late, Redis visibility_timeout={VISIBILITY:g}s", **figures)
    check(figures)


def test_rq_work_horses_sigkilled_at_every_point_charge_each_order_once(
    redis_url: str, rc: redis.Redis, pg: sa.Engine
) -> None:
    name = f"sqlfaults-rq-{uuid.uuid4().hex[:6]}"
    q = DedupQueue(name, connection=rc, dedup=sql_jobs.POLICY)
    seed = int(time.time())
    orders = [f"R{n}-{uuid.uuid4().hex[:6]}" for n in range(2 * RQ_ORDERS)]
    points = plan(orders, seed)
    durable = set(orders[::2])
    arm(rc, points)
    env = {"TASKDEDUP_TEST_SQL_URL": os.environ["TASKDEDUP_TEST_SQL_URL"]}
    workers = [RqWorker(redis_url, [name], scheduler=False, env=env,
                        worker_class="tests.sql_jobs.LedgerWorker").start()
               for _ in range(RQ_WORKERS)]
    killed = 0
    try:
        for order in orders:
            q.enqueue(sql_jobs.rq_charge, order, 100, order in durable, retry=Retry(max=1))
        deadline = time.monotonic() + 240  # 200 forked horses, each retried: minutes on CI
        while killed < len(orders):
            assert time.monotonic() < deadline, f"only {killed} bodies reached their points"
            popped = rc.blpop(["sql:at"], timeout=1)
            if popped is None:
                continue
            order, _, pid = popped[1].decode().split(":")
            if order in points:
                os.kill(int(pid), signal.SIGKILL)
                killed += 1
        wait_for(lambda: all(returned(rc, o) for o in orders), timeout=240,
                 what="every killed job retried and returned")
    finally:
        for w in workers:
            w.stop()
        q.empty()
    figures = account(rc, pg, points, durable)
    report("sql_sigkill_rq", seed=seed, work_horse_sigkills=killed,
           redelivery="Retry(max=1) after RQ's work-horse death handling", **figures)
    check(figures)


def test_rq_whole_workers_sigkilled_at_every_point_charge_each_order_once(
    redis_url: str, rc: redis.Redis, pg: sa.Engine
) -> None:
    name = f"sqlfaults-rqw-{uuid.uuid4().hex[:6]}"
    q = DedupQueue(name, connection=rc, dedup=sql_jobs.POLICY)
    env = {"TASKDEDUP_TEST_SQL_URL": os.environ["TASKDEDUP_TEST_SQL_URL"]}
    points: dict[str, str] = {}
    durable: set[str] = set()
    workers: list[RqWorker] = []
    try:
        for round_ in range(RQ_WHOLE_ROUNDS):
            orders = [f"W{round_}-{n}-{uuid.uuid4().hex[:6]}" for n in range(RQ_WORKERS)]
            # every point for each mode across the rounds (few bodies: not left to chance)
            chosen = {o: POINTS[(round_ + n // 2) % len(POINTS)] for n, o in enumerate(orders)}
            arm(rc, chosen)
            points.update(chosen)
            durable.update(orders[::2])
            round_workers = [RqWorker(redis_url, [name], scheduler=False, env=env,
                                      worker_class="tests.sql_jobs.LedgerWorker").start()
                             for _ in range(RQ_WORKERS)]
            workers += round_workers
            for order in orders:
                q.enqueue(sql_jobs.rq_charge, order, 100, order in durable, retry=Retry(max=1))
            at: dict[str, int] = {}

            def paused(orders: list[str] = orders, at: dict[str, int] = at) -> bool:
                for x in rc.lrange("sql:at", 0, -1):
                    order, _, pid = x.decode().split(":")
                    if order in orders:
                        at[order] = int(pid)
                return len(at) == len(orders)

            wait_for(paused, timeout=60, what="every body at its kill point")
            for w in round_workers:
                w.kill()  # the main process (its own group)...
            for pid in at.values():
                os.kill(pid, signal.SIGKILL)  # ...and the horse (setpgrp: a group of its own)
            registry = StartedJobRegistry(name, connection=rc, job_class=DedupJob)
            registry.cleanup(timestamp=time.time() + 3600)  # RQ's abandoned-job handling
            fresh = RqWorker(redis_url, [name], scheduler=False, env=env,
                             worker_class="tests.sql_jobs.LedgerWorker").start()
            workers.append(fresh)
            wait_for(lambda orders=orders: all(returned(rc, o) for o in orders), timeout=60,
                     what="abandoned jobs retried and returned")
            fresh.stop()
    finally:
        for w in workers:
            w.kill()
        q.empty()
    figures = account(rc, pg, points, durable)
    report("sql_sigkill_rq_whole_worker", worker_sigkills=RQ_WHOLE_ROUNDS * RQ_WORKERS,
           redelivery="StartedJobRegistry.cleanup + Retry(max=1)", **figures)
    check(figures)
