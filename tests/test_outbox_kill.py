"""The outbox's proof (SPEC §14): producers, relays and workers SIGKILLed at random moments
while orders flow, on SQLite and on PostgreSQL, with Celery and RQ consumers charging each
order with ``effects()`` in their own transaction on the same database.

* Producers (:mod:`tests.outbox_producer`, subprocesses): one transaction per order inserts
  the order row and ``outbox.add``s its charge (even orders a Celery task, odd ones an RQ job),
  then commits — or rolls back, decided by the seed and the order's number alone, so the test
  knows the rolled-back orders whatever moment a producer died at. Killed and restarted, a
  producer resumes after its last committed order.
* Relays: ``taskdedup outbox relay`` (grace 1 s), two of them, killed and restarted.
* Consumers: a real Celery prefork worker on taskdedup's reliable fetch (SPEC §17: kombu's
  own fetch loses the messages of a worker SIGKILLed between its BRPOP and its unacked write —
  the soak lost two committed orders that way, seed 155420444 on PostgreSQL — which no outbox
  can see: their rows were published and deleted; acks_late, fetch lease 10 s: a killed
  worker's messages come back) killed whole and restarted; real RQ workers whose
  work-horses are SIGKILLed mid-job (as the OOM killer does: the worker fails the job and
  ``Retry`` runs it again under its id). Each body stays in its transaction a random while
  (``TASKDEDUP_TEST_BODY_HOLD``) so kills land inside it.

At the end (the producers done, the relays drained): every committed order has exactly one
ledger row, no rolled-back order has any, no outbox row is left, and every charge returned.
The seed is printed; ``TASKDEDUP_SOAK_SEED`` replays it. The default run is one fixed seed and
a modest number of orders per database; ``TASKDEDUP_SOAK_OUTBOX=<orders>`` runs the soak
(a random seed, that many orders per database)::

    TASKDEDUP_SOAK_OUTBOX=400 pytest tests/test_outbox_kill.py -s -k soak
"""

from __future__ import annotations

import os
import random
import re
import signal
import sys
import threading
import time
import uuid
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
import redis
import sqlalchemy as sa

from taskdedup.sql import init
from taskdedup.sql.schema import OUTBOX
from taskdedup.testing import wait_for
from tests import sql_apps
from tests.fault_jobs import report
from tests.outbox_producer import ORDERS, producing_key, ref, rolls_back
from tests.sqldb import EFFECTS, LEDGER, fresh_engine, rows
from tests.workers import RqWorker, WorkerProcess

pytestmark = pytest.mark.slow

SEED = 20261126
ORDERS_DEFAULT = 100  # per database: 200 orders in the default run
SOAK_ORDERS = int(os.environ.get("TASKDEDUP_SOAK_OUTBOX") or 0)
PRODUCERS = 2
RELAYS = 2
RQ_WORKERS = 2
VISIBILITY = 4.0
HOLD = 0.2  # seconds a body may stay in its transaction
PACE = 0.15  # mean seconds between a producer's orders: kills land while orders flow
KILL_EVERY = (0.1, 0.6)  # seconds between two kills, at random
KILLS = ["producer"] * 3 + ["relay"] * 2 + ["celery"] + ["rq-horse"] * 3
"""What one run SIGKILLs, in an order the seed shuffles (each restarted at once, but the RQ
horses: their worker fails the job and retries it)."""


class Producer(WorkerProcess):
    """``python -m tests.outbox_producer``: done when it exits 0."""

    kind = "outbox-producer"

    def __init__(self, redis_url: str, args: list[str], env: dict[str, str]) -> None:
        super().__init__(redis_url, env)
        self.args = args

    def command(self) -> list[str]:
        return [sys.executable, "-m", "tests.outbox_producer", *self.args]

    def ready(self) -> bool:
        return True

    def _started(self) -> bool:
        assert self.process is not None
        if self.process.poll() == 0:
            return True  # had little left to do
        return super()._started()

    def finished(self) -> bool:
        assert self.process is not None
        code = self.process.poll()
        if code not in (None, 0, -signal.SIGKILL):
            raise AssertionError(f"producer failed ({code}):\n{self.output()[-4000:]}")
        return code == 0


RELAY_MAIN = ("import logging, sys; logging.basicConfig(level=logging.INFO); "
              "from taskdedup.cli import main; sys.argv[0] = 'taskdedup'; main()")
PUBLISHED = re.compile(r"outbox relay published (\d+) row")


class RelayProcess(WorkerProcess):
    """``taskdedup outbox relay`` for both kinds (the test's Celery app, its RQ Redis)."""

    kind = "outbox-relay"

    def __init__(self, redis_url: str, url: str, env: dict[str, str]) -> None:
        super().__init__(redis_url, env)
        self.url = url

    def command(self) -> list[str]:
        # the CLI itself, with its INFO log on (what it published, counted by the test)
        return [sys.executable, "-c", RELAY_MAIN, "outbox", "relay", "--url", self.url,
                "-A", "tests.sql_apps", "--rq-url", self.redis_url, "--grace", "1",
                "--poll", "0.2", "--batch", "20"]

    def published(self) -> int:
        return sum(int(m) for m in PUBLISHED.findall(self.output()))

    def ready(self) -> bool:
        return "taskdedup outbox relay on" in self.output()[self.log_start:]


def parent_of(pid: int) -> int | None:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return int(stat.rsplit(")", 1)[1].split()[1])


def in_window(engine: sa.Engine, rc: redis.Redis, prefix: str,
              producers: list[Producer]) -> list[Producer] | bool:
    """The producers placing orders when a committed row awaits its publish (True when they
    have all finished: nothing to wait for)."""
    if all(p.finished() for p in producers):
        return True
    placing = [p for p in producers if p.process is not None and p.process.poll() is None
               and rc.get(producing_key(prefix, int(p.args[2]))) == str(p.process.pid).encode()]
    if not placing:
        return []
    with engine.connect() as conn:
        waiting = conn.execute(sa.select(sa.func.count()).select_from(OUTBOX)).scalar_one()
    return placing if waiting else []


def together(calls: list[Any]) -> None:
    """Run ``calls`` (starts, stops: each waits for its own process) at the same time."""
    errors: list[BaseException] = []

    def run(call: Any) -> None:
        try:
            call()
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(c,), daemon=True) for c in calls]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    if errors:
        raise errors[0]


def running_horse(rc: redis.Redis, prefix: str, orders: int, mains: set[int]) -> list[int]:
    """The pids of the RQ work-horses running a charge now (their parent one of the test's
    RQ workers: never another process that reused a pid)."""
    pids = []
    for n in range(1, orders, 2):
        order = ref(prefix, n)
        pid = rc.get(f"sql:pid:{order}")
        if pid and not rc.exists(f"sql:ret:{order}") and parent_of(int(pid)) in mains:
            pids.append(int(pid))
    return pids


def kill_a_horse(rc: redis.Redis, prefix: str, orders: int, mains: set[int],
                 rng: random.Random) -> bool:
    """SIGKILL the work-horse of one RQ charge running now; False when none is (or the one
    chosen has just ended)."""
    horses = running_horse(rc, prefix, orders, mains)
    if not horses:
        return False
    try:
        os.kill(rng.choice(horses), signal.SIGKILL)
    except ProcessLookupError:  # it finished between the look and the kill
        return False
    return True


def database(dialect: str, directory: Path) -> sa.Engine:
    """Empty orders, ledger, effects and outbox tables (SQLite in WAL mode: the producers,
    relays and bodies write to it at once)."""
    engine = fresh_engine(dialect, directory)
    with engine.begin() as conn:
        ORDERS.drop(conn, checkfirst=True)
        ORDERS.create(conn)
        OUTBOX.drop(conn, checkfirst=True)
    init(engine)
    if dialect == "sqlite":
        with engine.connect() as conn:
            conn.exec_driver_sql("PRAGMA journal_mode=WAL")
    return engine


def prove(dialect: str, directory: Path, redis_url: str, rc: redis.Redis, seed: int,
          orders: int) -> dict[str, Any]:
    """One run: the chaos while the producers place ``orders`` orders, then the drain and
    the accounting. Returns the figures (asserted by the caller)."""
    print(f"\noutbox kill proof: {dialect}, seed {seed}, {orders} orders")
    engine = database(dialect, directory)
    url = engine.url.render_as_string(hide_password=False)
    if dialect == "sqlite":
        url += "?timeout=60"
    tag = uuid.uuid4().hex[:6]
    prefix, celery_queue, rq_queue = f"O{tag}", f"obk-c-{tag}", f"obk-r-{tag}"
    sql_apps.configure(redis_url, celery_queue)
    env = {"TASKDEDUP_TEST_SQL_URL": url, "TASKDEDUP_TEST_QUEUE": celery_queue,
           "TASKDEDUP_TEST_VISIBILITY": str(VISIBILITY), "TASKDEDUP_TEST_BODY_HOLD": str(HOLD),
           "TASKDEDUP_TEST_PRODUCER_PACE": str(PACE), "TASKDEDUP_TEST_RELIABLE_FETCH": "1"}
    rng = random.Random(seed)
    kills: Counter[str] = Counter()
    started: list[WorkerProcess] = []

    began = time.monotonic()
    try:
        celery = sql_apps.SqlCeleryWorker(redis_url, queue=celery_queue, pool="prefork",
                                          concurrency=2, env=env)
        rq_workers = [RqWorker(redis_url, [rq_queue], scheduler=False, env=env,
                               worker_class="tests.sql_jobs.LedgerWorker")
                      for _ in range(RQ_WORKERS)]
        relays = [RelayProcess(redis_url, url, env) for _ in range(RELAYS)]
        producers = [Producer(redis_url, [url, prefix, str(i), str(PRODUCERS), str(orders),
                                          str(seed), rq_queue], env)
                     for i in range(PRODUCERS)]
        started.extend([celery, *rq_workers, *relays])
        together([p.start for p in started])  # the consumers and relays first
        started.extend(producers)
        together([p.start for p in producers])
        rq_mains = {w.process.pid for w in rq_workers if w.process is not None}
        print(f"outbox kill proof: processes up after {time.monotonic() - began:.1f}s")
        plan = KILLS * max(1, orders // 60)  # the soak: as many again per 60 orders
        rng.shuffle(plan)
        deadline = time.monotonic() + 90 + orders * PACE
        pause = threading.Event()
        restarting: dict[int, threading.Thread] = {}
        errors: list[BaseException] = []

        def kill_and_restart(process: WorkerProcess, what: str) -> None:
            """SIGKILL ``process`` and start it again in the background (the chaos goes on
            while it starts); a process still starting from its last kill is waited for."""
            previous = restarting.pop(id(process), None)
            if previous is not None:
                previous.join(timeout=60)
            process.kill()
            kills[what] += 1

            def again() -> None:
                try:
                    process.start()
                except BaseException as exc:  # reported by the test thread
                    errors.append(exc)

            restarting[id(process)] = thread = threading.Thread(target=again, daemon=True)
            thread.start()

        for victim in plan:
            assert time.monotonic() < deadline, "the chaos did not end"
            pause.wait(rng.uniform(*KILL_EVERY))  # a random moment (not a wait for a state)
            if victim == "producer" and not all(p.finished() for p in producers):
                # one placing orders (not still starting) while a committed row waits for its
                # publish: the kill most likely lands in a commit-to-publish window
                placing = wait_for(lambda: in_window(engine, rc, prefix, producers),
                                   timeout=20, interval=0.01, what="a producer placing orders")
                if placing is not True:
                    kill_and_restart(rng.choice(placing), "producer")
            elif victim == "relay":
                kill_and_restart(rng.choice(relays), "relay")
            elif victim == "celery":
                kill_and_restart(celery, "celery_worker")
            elif victim == "rq-horse":
                wait_for(lambda: kill_a_horse(rc, prefix, orders, rq_mains, rng), timeout=20,
                         interval=0.05, what="an RQ job running to kill its horse")
                kills["rq_work_horse"] += 1
        for thread in restarting.values():
            thread.join(timeout=60)
        assert not errors, errors
        print(f"outbox kill proof: kills done after {time.monotonic() - began:.1f}s")
        wait_for(lambda: all(p.finished() for p in producers), timeout=60 + orders * PACE,
                 what="the producers done")
        print(f"outbox kill proof: producers done after {time.monotonic() - began:.1f}s")
        # the drain: no more kills
        committed = {row.ref for row in rows(engine, ORDERS)}
        wait_for(lambda: not rows(engine, OUTBOX), timeout=60,
                 what="the relays drained the outbox")
        print(f"outbox kill proof: outbox drained after {time.monotonic() - began:.1f}s")

        def left() -> bool:
            missing = [o for o in committed if not rc.exists(f"sql:ret:{o}")]
            if missing and int(time.monotonic() * 2) % 4 == 0:
                print(f"  {time.monotonic() - began:.1f}s waiting for {sorted(missing)[:8]}")
            return not missing

        try:
            wait_for(left, timeout=120, interval=0.5,
                     what="every committed order charged and returned")
        except TimeoutError:
            missing = sorted(o for o in committed if not rc.exists(f"sql:ret:{o}"))
            raise AssertionError(
                f"seed {seed}: committed orders never charged: "
                f"{[(o, int(rc.get(f'sql:attempt:{o}') or 0)) for o in missing]} (order, runs); "
                f"celery queue {rc.llen(celery_queue)}, unacked {rc.hlen('unacked')}, "
                f"rq queue {rc.llen(f'rq:queue:{rq_queue}')} (the Celery worker consumes "
                "through the reliable fetch: a killed worker's messages wait in its "
                "processing lists until its fetch lease lapses)") from None
        print(f"outbox kill proof: drained after {time.monotonic() - began:.1f}s")
    finally:
        together([p.stop for p in started])
    print(f"outbox kill proof: stopped after {time.monotonic() - began:.1f}s")
    ledger = Counter(row.order_id for row in rows(engine, LEDGER))
    decided_rollback = {ref(prefix, n) for n in range(orders) if rolls_back(seed, n)}
    figures = {
        "dialect": dialect, "seed": seed, "orders": orders,
        "committed": len(committed), "rolled_back": len(decided_rollback),
        "sigkills": dict(kills),
        "celery_orders": sum(1 for o in committed if "-C" in o),
        "rq_orders": sum(1 for o in committed if "-R" in o),
        "runs": sum(int(rc.get(f"sql:attempt:{o}") or 0) for o in committed),
        "committed_without_effect": sorted(o for o in committed if ledger[o] == 0),
        "committed_charged_twice": sorted(o for o in committed if ledger[o] > 1),
        "rolled_back_committed": sorted(decided_rollback & committed),
        "effects_of_uncommitted": sorted(set(ledger) - committed),
        "committed_orders_missing": sorted(
            {ref(prefix, n) for n in range(orders)} - decided_rollback - committed),
        "rows_published_by_relays": sum(r.published() for r in relays),
        "outbox_rows_left": len(rows(engine, OUTBOX)),
        "effects_rows": len(rows(engine, EFFECTS)),
    }
    report(f"outbox_sigkill_{dialect}", **figures)
    engine.dispose()
    return figures


def check(figures: dict[str, Any]) -> None:
    seed = figures["seed"]
    for name in ("committed_without_effect", "committed_charged_twice", "rolled_back_committed",
                 "effects_of_uncommitted", "committed_orders_missing"):
        assert figures[name] == [], f"seed {seed}: {name}: {figures[name]}"
    assert figures["outbox_rows_left"] == 0, f"seed {seed}"
    assert figures["effects_rows"] == figures["committed"], f"seed {seed}"
    assert figures["committed"] + figures["rolled_back"] == figures["orders"]
    assert figures["runs"] >= figures["committed"]


@pytest.mark.parametrize("dialect", ["sqlite", "postgresql"])
def test_producers_relays_and_workers_sigkilled_charge_every_committed_order_once(
    dialect: str, tmp_path: Path, redis_url: str, rc: redis.Redis
) -> None:
    figures = prove(dialect, tmp_path, redis_url, rc, SEED, ORDERS_DEFAULT)
    check(figures)
    kills = figures["sigkills"]
    assert kills["relay"] == 2 and kills["celery_worker"] == 1 and kills["rq_work_horse"] == 3
    assert kills.get("producer", 0) >= 1, f"seed {SEED}: no producer was killed: {kills}"
    # a producer spends most of its time between a commit and its publish: its kills leave
    # rows that only a relay publishes
    assert figures["rows_published_by_relays"] >= 1, f"seed {SEED}: the relays had no work"


@pytest.mark.skipif(not SOAK_ORDERS,
                    reason="the outbox soak runs with TASKDEDUP_SOAK_OUTBOX=<orders>")
@pytest.mark.parametrize("dialect", ["sqlite", "postgresql"])
def test_soak_outbox_sigkills(
    dialect: str, tmp_path: Path, redis_url: str, rc: redis.Redis
) -> None:
    seed = int(os.environ.get("TASKDEDUP_SOAK_SEED") or random.randrange(1 << 30))
    check(prove(dialect, tmp_path, redis_url, rc, seed, SOAK_ORDERS))

