"""The Celery app and the tasks the benchmarks publish and run: one per library (plain,
taskdedup, celery-once, celery-singleton), same five arguments (``user_id, amount_cents,
currency, order_id, run``), same body (:func:`benchmarks.jobs.effect`).

Imported by the benchmark process and by the worker subprocesses (``celery -A
benchmarks.apps worker``), which find the server in ``TASKDEDUP_BENCH_URL``.
"""

from __future__ import annotations

import os
from typing import Any

from celery import Celery

from taskdedup import Debounce, Policy
from taskdedup.celery import DedupTask

from .jobs import ENV_URL, effect

__all__ = [
    "HAVE_ONCE",
    "HAVE_SINGLETON",
    "MISSING",
    "POLICY",
    "app",
    "charge_coalesce",
    "charge_debounce",
    "charge_dedup",
    "charge_fused",
    "charge_plain",
    "configure",
    "fused_app",
    "realistic",
    "realistic_app",
]

PUBLISH_QUEUE = "bench-publish"
"""Where the publish benchmarks send (no worker consumes it; purged between runs)."""
POLICY = Policy(ttl=600)

_SETTINGS: dict[str, Any] = {
    "broker_connection_retry_on_startup": True,
    "worker_hijack_root_logger": False,
    "worker_send_task_events": False,
    "task_ignore_result": True,
    "task_default_queue": PUBLISH_QUEUE,
}
app = Celery("bench")
app.conf.update(
    _SETTINGS,
    ONCE={"backend": "celery_once.backends.Redis", "settings": {"default_timeout": 600}},
    singleton_lock_expiry=600,
    # a worker started with TASKDEDUP_BENCH_FETCH=reliable consumes through the reliable fetch
    taskdedup_reliable_fetch=os.environ.get("TASKDEDUP_BENCH_FETCH") == "reliable",
)
fused_app = Celery("bench-fused")
"""The same settings with taskdedup's ``RedisTransport``: reserve and LPUSH in one script."""
fused_app.conf.update(_SETTINGS, broker_transport="taskdedup.celery:RedisTransport")


realistic_app = Celery("bench-realistic")
"""A realistic app: default configuration (only the broker URL, whose Redis also holds the
locks), plain tasks and gated ones in one app, and a plain task published first. The peers'
tasks live here too, with the one setting each needs (celery-once has no default backend)."""

realistic: dict[str, Any] = {}
"""Label → task of :data:`realistic_app` (``plain``, ``taskdedup``, and the peers present)."""


def configure(url: str) -> None:
    """Point the app (broker, taskdedup, celery-once, celery-singleton) at ``url``.

    Call before the first publish: each library connects lazily and caches its client.
    """
    os.environ[ENV_URL] = url
    # the locks live in the broker: no taskdedup_url (see taskdedup.celery.config.fuses)
    fused_app.conf.update(broker_url=url)
    realistic_app.conf.update(
        broker_url=url,
        ONCE={"backend": "celery_once.backends.Redis",
              "settings": {"url": url, "default_timeout": 600}},
    )
    app.conf.update(
        broker_url=url,
        taskdedup_url=url,
        singleton_backend_url=url,
        ONCE={"backend": "celery_once.backends.Redis",
              "settings": {"url": url, "default_timeout": 600}},
    )


# -- Celery tasks: one per library, same signature, same body ----------------------------------


def _charge(user_id: int, amount_cents: int, currency: str, order_id: str, run: str) -> None:
    """The one body every benchmark task runs."""
    effect(run)


charge_plain: Any = app.task(name="bench.plain")(_charge)
charge_dedup: Any = app.task(name="bench.dedup", base=DedupTask, dedup=POLICY)(_charge)
charge_fused: Any = fused_app.task(name="bench.fused", base=DedupTask, dedup=POLICY)(_charge)
# SPEC §15: the gate's Lua call, then the push (two round trips), on the same broker.
charge_coalesce: Any = fused_app.task(
    name="bench.coalesce", base=DedupTask,
    dedup=Policy(ttl=600, on_duplicate="coalesce"))(_charge)
charge_debounce: Any = fused_app.task(
    name="bench.debounce", base=DedupTask, dedup=Policy(ttl=600, debounce=Debounce(60)))(_charge)

MISSING: dict[str, str] = {}
"""Competitors that could not be imported: name → the error (the bench extra is optional)."""

QueueOnce: Any = None
Singleton: Any = None
try:
    from celery_once import QueueOnce
except Exception as exc:  # not installed, or broken with this Celery
    MISSING["celery-once"] = f"{type(exc).__name__}: {exc}"
try:
    from celery_singleton import Singleton
except Exception as exc:
    MISSING["celery-singleton"] = f"{type(exc).__name__}: {exc}"
HAVE_ONCE, HAVE_SINGLETON = QueueOnce is not None, Singleton is not None


def _peers(target: Celery, prefix: str) -> dict[str, Any]:
    """The installed peers' tasks in ``target``, named ``{prefix}.once`` and ``.singleton``."""
    tasks: dict[str, Any] = {}
    if HAVE_ONCE:
        tasks["celery-once"] = target.task(name=f"{prefix}.once", base=QueueOnce,
                                           once={"graceful": True, "timeout": 600})(_charge)
    if HAVE_SINGLETON:
        tasks["celery-singleton"] = target.task(name=f"{prefix}.singleton",
                                                base=Singleton)(_charge)
    return tasks


_bench_peers = _peers(app, "bench")
charge_once: Any = _bench_peers.get("celery-once")
charge_singleton: Any = _bench_peers.get("celery-singleton")

# The realistic app: plain and gated tasks together, default configuration.
realistic.update(
    plain=realistic_app.task(name="bench.realistic.plain")(_charge),
    taskdedup=realistic_app.task(name="bench.realistic.dedup", base=DedupTask,
                                 dedup=POLICY)(_charge),
    **_peers(realistic_app, "bench.realistic"),
)


if os.environ.get(ENV_URL):  # a worker subprocess
    configure(os.environ[ENV_URL])
