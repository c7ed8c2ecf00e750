"""The locks apart from the broker as users meet it: a RabbitMQ broker, the locks in Valkey.

plain ``apply_async``, taskdedup, celery-once and celery-singleton publish to a RabbitMQ
started for the run (``rabbitmq-server`` from the system's package, on free loopback ports,
its files in a temporary directory), each library's locks in the benchmark's Valkey; the
variants run interleaved and each ratio is taken within its run. Every gated publish pays one
round trip to Valkey on top of the AMQP publish (which waits for no reply): what differs is
how much of it each library hides and its Python overhead. Skipped, with a note, where
RabbitMQ is not installed.
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Iterator
from typing import Any

from celery import Celery

from taskdedup.celery import DedupTask

from . import apps
from .harness import Row, purge
from .micro import Context
from .rabbitmq import RabbitMQ, find_rabbitmq
from .realistic import publish_rows

__all__ = ["SECTION", "RabbitMQ", "apart_publish", "find_rabbitmq"]

SECTION = "celery publish (RabbitMQ broker, locks in Valkey)"
PLAIN = "plain Celery apply_async"
GATED = "taskdedup DedupTask"
QUEUE = "bench-apart"
_LOCKS = {
    PLAIN: (),
    GATED: ("taskdedup:bench.apart.*",),
    "celery-once QueueOnce": ("qo_bench.apart.*",),
    "celery-singleton Singleton": ("SINGLETONLOCK_bench.apart.*",),
}


def _charge(user_id: int, amount_cents: int, currency: str, order_id: str, run: str) -> None:
    """Never runs: no worker consumes the queue."""


def _app(broker: str, locks: str) -> tuple[Celery, dict[str, Any]]:
    """One app on RabbitMQ with the four tasks, every library's locks in ``locks``."""
    app = Celery("bench-apart", set_as_current=False)
    app.conf.update(
        broker_url=broker, taskdedup_url=locks, singleton_backend_url=locks,
        ONCE={"backend": "celery_once.backends.Redis",
              "settings": {"url": locks, "default_timeout": 600}},
        singleton_lock_expiry=600, task_ignore_result=True, task_default_queue=QUEUE,
        broker_connection_retry_on_startup=True,
    )
    tasks: dict[str, Any] = {
        PLAIN: app.task(name="bench.apart.plain", shared=False)(_charge),
        GATED: app.task(name="bench.apart.dedup", base=DedupTask, dedup=apps.POLICY,
                        shared=False)(_charge),
    }
    if apps.HAVE_ONCE:
        tasks["celery-once QueueOnce"] = app.task(
            name="bench.apart.once", base=apps.QueueOnce, shared=False,
            once={"graceful": True, "timeout": 600})(_charge)
    if apps.HAVE_SINGLETON:
        tasks["celery-singleton Singleton"] = app.task(
            name="bench.apart.singleton", base=apps.Singleton, shared=False)(_charge)
    return app, tasks


@contextlib.contextmanager
def _broker(ctx: Context) -> Iterator[str | None]:
    """A RabbitMQ URL (``TASKDEDUP_BENCH_AMQP`` or a node started here), or None."""
    given = os.environ.get("TASKDEDUP_BENCH_AMQP")
    if given:
        yield given
        return
    binary = find_rabbitmq()
    if binary is None:
        yield None
        return
    with RabbitMQ(binary) as node:
        yield node.url


def apart_publish(ctx: Context) -> list[Row]:
    """Publish throughput (distinct arguments) on RabbitMQ with the locks in Valkey."""
    with _broker(ctx) as url:
        if url is None:
            ctx.log(f"  {SECTION}: skipped, RabbitMQ is not installed (rabbitmq-server not "
                    "found; apt-get install rabbitmq-server, or TASKDEDUP_BENCH_AMQP=amqp://...)")
            return [Row(SECTION, PLAIN, "publishes/s", [], note="skipped: RabbitMQ is not "
                        "installed")]
        return _measure(ctx, url)


def _measure(ctx: Context, url: str) -> list[Row]:
    client = ctx.client
    app, tasks = _app(url, ctx.url)
    rows: list[Row] = []
    try:
        with app.connection_for_write() as conn:
            channel = conn.default_channel

            def purge_queue() -> None:
                with contextlib.suppress(Exception):
                    channel.queue_purge(QUEUE)

            def queued() -> int:
                time.sleep(0.2)  # AMQP publishes are not confirmed: let the broker catch up
                return int(channel.queue_declare(QUEUE, passive=True).message_count)

            def reset(label: str) -> None:
                purge_queue()
                purge(client, *_LOCKS[label])

            rows = publish_rows(ctx, SECTION, tasks, reset, queued,
                                extra={"broker": "RabbitMQ"})
            with contextlib.suppress(Exception):
                channel.queue_delete(QUEUE)
    finally:
        app.close()
    return rows
