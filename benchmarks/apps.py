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

from taskdedup import Policy
from taskdedup.celery import DedupTask

from .jobs import ENV_URL, effect

__all__ = [
    "HAVE_ONCE",
    "HAVE_SINGLETON",
    "MISSING",
    "POLICY",
    "app",
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
    fused_app.conf.update(broker_url=url)  # locks in the broker: no taskdedup_url (see taskdedup.celery.config.fuses)
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


@app.task(name="bench.plain")
def charge_plain(user_id: int, amount_cents: int, currency: str, order_id: str, run: str) -> None:
    effect(run)


@app.task(name="bench.dedup", base=DedupTask, dedup=POLICY)
def charge_dedup(user_id: int, amount_cents: int, currency: str, order_id: str, run: str) -> None:
    effect(run)


@fused_app.task(name="bench.fused", base=DedupTask, dedup=POLICY)
def charge_fused(
    user_id: int, amount_cents: int, currency: str, order_id: str, run: str
) -> None:
    effect(run)


MISSING: dict[str, str] = {}
"""Competitors that could not be imported: name → the error (the bench extra is optional)."""

charge_once: Any = None
charge_singleton: Any = None
HAVE_ONCE = HAVE_SINGLETON = False

try:
    from celery_once import QueueOnce
except Exception as exc:  # not installed, or broken with this Celery
    MISSING["celery-once"] = f"{type(exc).__name__}: {exc}"
else:
    @app.task(name="bench.once", base=QueueOnce, once={"graceful": True, "timeout": 600})
    def _charge_once(
        user_id: int, amount_cents: int, currency: str, order_id: str, run: str
    ) -> None:
        effect(run)

    charge_once, HAVE_ONCE = _charge_once, True

try:
    from celery_singleton import Singleton
except Exception as exc:
    MISSING["celery-singleton"] = f"{type(exc).__name__}: {exc}"
else:
    @app.task(name="bench.singleton", base=Singleton)
    def _charge_singleton(
        user_id: int, amount_cents: int, currency: str, order_id: str, run: str
    ) -> None:
        effect(run)

    charge_singleton, HAVE_SINGLETON = _charge_singleton, True


# -- the realistic app: plain and gated tasks together, default configuration ------------------


@realistic_app.task(name="bench.realistic.plain")
def _realistic_plain(
    user_id: int, amount_cents: int, currency: str, order_id: str, run: str
) -> None:
    effect(run)


@realistic_app.task(name="bench.realistic.dedup", base=DedupTask, dedup=POLICY)
def _realistic_dedup(
    user_id: int, amount_cents: int, currency: str, order_id: str, run: str
) -> None:
    effect(run)


realistic.update(plain=_realistic_plain, taskdedup=_realistic_dedup)
if HAVE_ONCE:
    @realistic_app.task(name="bench.realistic.once", base=QueueOnce,
                        once={"graceful": True, "timeout": 600})
    def _realistic_once(
        user_id: int, amount_cents: int, currency: str, order_id: str, run: str
    ) -> None:
        effect(run)

    realistic["celery-once"] = _realistic_once
if HAVE_SINGLETON:
    @realistic_app.task(name="bench.realistic.singleton", base=Singleton)
    def _realistic_singleton(
        user_id: int, amount_cents: int, currency: str, order_id: str, run: str
    ) -> None:
        effect(run)

    realistic["celery-singleton"] = _realistic_singleton


if os.environ.get(ENV_URL):  # a worker subprocess
    configure(os.environ[ENV_URL])
