"""Module fixtures for the tests that run two real workers on one queue (the second call,
coalesce, debounce and limits tests, Celery and RQ).

At a test module's top: ``workers, capp = celery_pair(FlowWorker, QUEUE)`` or
``workers = rq_pair(QUEUE)``; pytest finds the fixtures by the names they are bound to.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import redis

from tests.workers import CeleryWorker, RqWorker

__all__ = ["celery_pair", "rq_pair"]


def celery_pair(
    worker: type[CeleryWorker], queue: str
) -> tuple[Callable[..., Any], Callable[..., Any]]:
    """``workers``: two prefork workers of ``worker`` (two processes each) on ``queue``,
    SIGKILLed at the module's end; ``capp``: the worker's app module (``worker.app_module``,
    which has ``configure(redis_url, queue)``), configured for them."""

    @pytest.fixture(scope="module")
    def workers(redis_url: str) -> Iterator[list[CeleryWorker]]:
        started: list[CeleryWorker] = []
        try:
            for _ in range(2):
                started.append(worker(redis_url, queue=queue, concurrency=2).start())
            yield started
        finally:
            for each in started:
                each.kill()

    @pytest.fixture(scope="module")
    def capp(redis_url: str, workers: list[CeleryWorker]) -> Any:
        app = importlib.import_module(worker.app_module)
        app.configure(redis_url, queue)
        return app

    return workers, capp


def rq_pair(queue: str) -> Callable[..., Any]:
    """``workers``: two RQ ``DedupWorker``s with the scheduler on ``queue``, stopped (warm)
    at the module's end."""

    @pytest.fixture(scope="module")
    def workers(redis_url: str, rc: redis.Redis) -> Iterator[list[RqWorker]]:
        started: list[RqWorker] = []
        try:
            for _ in range(2):
                started.append(RqWorker(redis_url, [queue], scheduler=True).start())
            yield started
        finally:
            for each in started:
                each.stop()

    return workers
