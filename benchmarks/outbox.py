"""The outbox's cost (SPEC §14): a producer's transaction with ``outbox.add`` against the same
transaction followed by a plain ``.delay()``, and the relay's throughput, in one run.

``python -m benchmarks outbox [--quick] [--runs N] [--json PATH]``

* **Producer** (SQLite file; PostgreSQL 18 with its durable defaults): every operation is one
  transaction inserting an order row. ``commit, then .delay()`` publishes the gated task after
  the commit (what ``delay_on_commit`` does: the call is lost if the process dies in between);
  ``outbox.add + commit`` writes the call's row in the transaction, and the committing process
  publishes it and deletes its row after the commit (one gated round trip, one ``DELETE``).
  ``commit only`` (no publish) is the database's share. Interleaved runs, the ratio taken
  within each run, the median reported. Celery (the realistic app: default configuration,
  the locks in the broker's Redis) and RQ (a ``DedupQueue``).
* **Relay** (PostgreSQL): ``rows`` committed rows waiting (past the grace), drained by 1 or 2
  relay processes (``Relay`` over ``SqlRows``: ``FOR UPDATE SKIP LOCKED``, one ``DELETE`` per
  batch), rows/s from the start signal to the last process done. The bar: ≥ 2,000 rows/s with
  2 relays at the default batch.
"""

from __future__ import annotations

import multiprocessing
import os
import tempfile
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import redis
import sqlalchemy as sa
from rich.console import Console

from taskdedup import Policy, stats
from taskdedup.outbox import DEFAULT_BATCH, Publisher, Relay, pack
from taskdedup.rq import DedupQueue
from taskdedup.sql import init, outbox
from taskdedup.sql.outbox import SqlRows, insert_row
from taskdedup.sql.schema import OUTBOX
from taskdedup.sql.server import PostgresServer
from taskdedup.testing import RedisServer

from . import apps
from .harness import Row, interleaved, median
from .jobs import ENV_URL
from .report import print_table, section_args, write_section_json

__all__ = ["main"]

BAR_RELAY = 2000.0  # rows/s, 2 relays, PostgreSQL
COMMIT = "commit only (no publish)"
DELAY = "commit, then .delay()"
ADD = "outbox.add + commit"
ENQUEUE = "commit, then .enqueue()"

METADATA = sa.MetaData()
ORDERS = sa.Table(
    "bench_orders", METADATA,
    sa.Column("ref", sa.Text, primary_key=True),
    sa.Column("cents", sa.Integer, nullable=False),
)


@dataclass(frozen=True)
class Sizes:
    runs: int = 5
    ops: int = 300          # producer transactions per variant per run
    relay_rows: int = 6000  # rows per relay measurement
    relay_runs: int = 3

    @classmethod
    def quick(cls) -> Sizes:
        return cls(runs=1, ops=10, relay_rows=100, relay_runs=1)


def _task() -> Any:
    return apps.realistic["taskdedup"]


# -- the producer -------------------------------------------------------------------------------


def _producer_rate(engine: sa.Engine, mode: str, n: int, queue: DedupQueue | None) -> float:
    """Transactions per second of ``mode`` (one order each)."""
    tag = uuid.uuid4().hex[:12]
    task = _task()
    started = time.perf_counter()
    for i in range(n):
        ref = f"{tag}-{i}"
        args = (7, 500, "EUR", ref, "bench")
        with engine.begin() as conn:
            conn.execute(ORDERS.insert(), {"ref": ref, "cents": 500})
            if mode == ADD:
                if queue is None:
                    outbox.add(conn, task.s(*args))
                else:
                    outbox.add(conn, queue, "benchmarks.jobs.rq_charge", *args)
        if mode == DELAY:
            task.delay(*args)
        elif mode == ENQUEUE and queue is not None:
            queue.enqueue("benchmarks.jobs.rq_charge", *args)
    return n / (time.perf_counter() - started)


def _producer(section: str, engine: sa.Engine, client: redis.Redis, sizes: Sizes,
              kind: str) -> list[Row]:
    queue = DedupQueue(f"bench-obx-{uuid.uuid4().hex[:8]}", connection=client,
                       dedup=Policy(ttl=600)) if kind == "rq" else None
    publish = ENQUEUE if queue is not None else DELAY
    modes = (COMMIT, publish, ADD)
    for mode in modes:  # connections, scripts, compiled statements
        _producer_rate(engine, mode, max(5, sizes.ops // 10), queue)
    samples, ratios = interleaved(
        {mode: (lambda run, m=mode: _producer_rate(engine, m, sizes.ops, queue))
         for mode in modes}, sizes.runs, baseline=publish)
    _purge(client, queue)
    rows = []
    for mode in modes:
        note = ""
        if mode == ADD:
            note = f"{median(ratios[mode]):.2f}x {publish}"
        rows.append(Row(section, f"{kind}: {mode}", "txn/s", samples[mode],
                        baseline=None if mode == publish else f"{kind}: {publish}",
                        ratios=ratios.get(mode), note=note, extra={"ops": sizes.ops}))
    with engine.begin() as conn:
        conn.execute(sa.delete(ORDERS))
    return rows


def _purge(client: redis.Redis, queue: DedupQueue | None) -> None:
    client.delete(apps.PUBLISH_QUEUE)
    if queue is not None:
        queue.delete(delete_jobs=True)


# -- the relay ----------------------------------------------------------------------------------


def _fill(engine: sa.Engine, rows: int, kind: str, queue_name: str, client: redis.Redis) -> None:
    """``rows`` committed rows, created a minute ago (past any grace)."""
    tag = uuid.uuid4().hex[:12]
    then = datetime.now(UTC) - timedelta(minutes=1)
    queue = DedupQueue(queue_name, connection=client, dedup=Policy(ttl=600))
    values = []
    for i in range(rows):
        if kind == "celery":
            envelope = pack(_task().s(7, 500, "EUR", f"{tag}-{i}", "bench"))
        else:
            envelope = pack(queue, "benchmarks.jobs.rq_charge", 7, 500, "EUR", f"{tag}-{i}",
                            "bench")
        values.append(insert_row(envelope, then)[1])
    with engine.begin() as conn:
        for start in range(0, rows, 1000):
            conn.execute(OUTBOX.insert(), values[start:start + 1000])


def _relay_process(url: str, redis_url: str, batch: int, ready: Any, go: Any,
                   done: Any) -> None:
    """One relay (a process of its own, as deployed): drain until nothing is left."""
    os.environ[ENV_URL] = redis_url
    apps.configure(redis_url)
    engine = sa.create_engine(url)
    relay = Relay(SqlRows(engine), Publisher(celery_app=apps.realistic_app,
                                             rq_connection=redis.Redis.from_url(redis_url)),
                  batch=batch, grace=0.0)
    ready.release()
    go.wait()
    taken = 0
    while True:
        n = relay.run_once()
        taken += n
        if n == 0:
            break
    done.put(taken)
    engine.dispose()


def _relay_rate(url: str, redis_url: str, engine: sa.Engine, client: redis.Redis, rows: int,
                relays: int, batch: int, kind: str) -> float:
    queue_name = f"bench-obx-r-{uuid.uuid4().hex[:8]}"
    _fill(engine, rows, kind, queue_name, client)
    ctx = multiprocessing.get_context("spawn")
    ready, go, done = ctx.Semaphore(0), ctx.Event(), ctx.Queue()
    processes = [ctx.Process(target=_relay_process, args=(url, redis_url, batch, ready, go,
                                                          done)) for _ in range(relays)]
    for p in processes:
        p.start()
    for _ in processes:
        ready.acquire(timeout=120)
    started = time.perf_counter()
    go.set()
    taken = sum(done.get(timeout=600) for _ in processes)
    elapsed = time.perf_counter() - started
    for p in processes:
        p.join(timeout=60)
    with engine.connect() as conn:
        left = conn.execute(sa.select(sa.func.count()).select_from(OUTBOX)).scalar_one()
    if left or taken < rows:
        raise RuntimeError(f"the relays left {left} of {rows} rows (took {taken})")
    client.delete(apps.PUBLISH_QUEUE)
    DedupQueue(queue_name, connection=client).delete(delete_jobs=True)
    return rows / elapsed


def _relay(section: str, url: str, redis_url: str, engine: sa.Engine, client: redis.Redis,
           sizes: Sizes, log: Callable[[str], None]) -> list[Row]:
    rows: list[Row] = []
    for kind, relays, batch in (("celery", 1, DEFAULT_BATCH), ("celery", 2, DEFAULT_BATCH),
                                ("celery", 2, 500), ("rq", 2, DEFAULT_BATCH)):
        log(f"relay: {kind}, {relays} relay(s), batch {batch} …")
        samples = [_relay_rate(url, redis_url, engine, client, sizes.relay_rows, relays, batch,
                               kind) for _ in range(sizes.relay_runs)]
        note = ""
        if relays == 2 and batch == DEFAULT_BATCH and kind == "celery":
            met = median(samples) >= BAR_RELAY
            note = f"bar ≥ {BAR_RELAY:,.0f} rows/s: {'met' if met else 'NOT met'}"
        rows.append(Row(section, f"{kind}: {relays} relay(s), batch {batch}", "rows/s",
                        samples, note=note, extra={"rows": sizes.relay_rows,
                                                   "relays": relays, "batch": batch}))
    return rows


# -- the run ------------------------------------------------------------------------------------


@contextmanager
def _engines(directory: Path) -> Iterator[tuple[dict[str, sa.Engine], str]]:
    server = PostgresServer(settings={}).start()  # PostgreSQL's durable defaults
    engines = {
        "SQLite file": sa.create_engine(f"sqlite:///{directory / 'bench.sqlite'}"),
        "PostgreSQL, durable commit": sa.create_engine(server.url, pool_size=8),
    }
    try:
        for engine in engines.values():
            with engine.begin() as conn:
                METADATA.drop_all(conn)
                METADATA.create_all(conn)
                OUTBOX.drop(conn, checkfirst=True)
            init(engine)
        yield engines, server.url
    finally:
        for engine in engines.values():
            engine.dispose()
        server.cleanup()


def outbox_rows(sizes: Sizes, log: Callable[[str], None]) -> list[Row]:
    """Every comparison of this section, in one run."""
    rows: list[Row] = []
    with tempfile.TemporaryDirectory(prefix="taskdedup-bench-obx-") as directory, \
            _engines(Path(directory)) as (engines, pg_url), RedisServer() as server:
        apps.configure(server.url)
        client = redis.Redis.from_url(server.url)
        for name, engine in engines.items():
            for kind in ("celery", "rq"):
                log(f"{name}: producer, {kind} …")
                rows += _producer(f"outbox producer, {name}", engine, client, sizes, kind)
        rows += _relay("outbox relay, PostgreSQL, durable commit", pg_url, server.url,
                       engines["PostgreSQL, durable commit"], client, sizes, log)
        stats.flush_all()
        client.close()
    return rows


def main(argv: list[str] | None = None) -> int:
    args = section_args("python -m benchmarks outbox", __doc__, argv)
    sizes = Sizes.quick() if args.quick else Sizes()
    if args.runs:
        sizes = Sizes(args.runs, sizes.ops, sizes.relay_rows, sizes.relay_runs)
    console = Console(width=200)
    started = time.perf_counter()
    rows = outbox_rows(sizes, lambda text: console.print(text, highlight=False))
    print_table(console, rows)
    console.print(f"{time.perf_counter() - started:.1f}s", highlight=False)
    write_section_json(console, args.json, sizes, rows)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
