"""The pytest plugin (entry point ``pytest11``), run as users run it: test files in a fresh
directory, collected by pytest with the plugin loaded from the installed entry point.

Also ``taskdedup.disabled()``, the eager-mode recipe of docs/how-to/testing.md, run as it
stands in the page, and ``taskdedup.testing.stop_worker``.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
from datetime import timedelta
from importlib.metadata import entry_points
from pathlib import Path

import pytest

import taskdedup
from taskdedup.testing import FakeClock, stop_worker

pytest_plugins = ["pytester"]

DOC = Path(__file__).resolve().parent.parent / "docs" / "how-to" / "testing.md"


def test_the_plugin_is_registered_under_pytest11() -> None:
    found = {ep.name: ep.value for ep in entry_points(group="pytest11")}
    assert found.get("taskdedup") == "taskdedup.pytest_plugin"


def test_the_fixtures_are_listed(pytester: pytest.Pytester) -> None:
    result = pytester.runpytest("--fixtures", "-p", "no:cacheprovider")
    for name in ("taskdedup_clock", "taskdedup_memory_store", "taskdedup_redis_server",
                 "taskdedup_redis_url", "taskdedup_disabled", "taskdedup_in_memory"):
        result.stdout.fnmatch_lines([f"{name}*"])


def test_the_clock_moves_a_memory_stores_ttls(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(
        """
        from datetime import timedelta

        import pytest

        from taskdedup import MemoryStore
        from taskdedup.testing import FakeClock

        KEY = "taskdedup:app.charge:" + "0" * 32

        def test_expiry(taskdedup_memory_store, taskdedup_clock):
            assert isinstance(taskdedup_clock, FakeClock)
            assert isinstance(taskdedup_memory_store, MemoryStore)
            store = taskdedup_memory_store
            store.reserve(KEY, "task-1", ttl_ms=1000)
            taskdedup_clock.advance(0.999)
            assert store.get(KEY).owner == "task-1"
            assert store.get(KEY).ttl_ms == 1
            taskdedup_clock.advance(timedelta(milliseconds=1))
            assert store.get(KEY) is None

        def test_a_fresh_store_and_clock_per_test(taskdedup_memory_store, taskdedup_clock):
            assert taskdedup_memory_store.get(KEY) is None
            assert taskdedup_clock() == 1000.0

        def test_the_clock_never_goes_back(taskdedup_clock):
            with pytest.raises(ValueError, match="only moves forward"):
                taskdedup_clock.advance(-1)
        """
    )
    result = pytester.runpytest("-p", "no:cacheprovider")
    result.assert_outcomes(passed=3)


def test_a_real_server_started_once_for_the_session(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(
        """
        import redis

        from taskdedup import RedisStore
        from taskdedup.testing import RedisServer

        KEY = "taskdedup:app.charge:" + "1" * 32
        seen = []

        def test_one(taskdedup_redis_server, taskdedup_redis_url):
            assert isinstance(taskdedup_redis_server, RedisServer)
            assert taskdedup_redis_url == taskdedup_redis_server.url
            assert taskdedup_redis_url.startswith("redis://127.0.0.1:")
            client = redis.Redis.from_url(taskdedup_redis_url)
            client.flushdb()
            RedisStore(client).reserve(KEY, "task-1", 60_000)
            seen.append(taskdedup_redis_server.process.pid)

        def test_two_shares_the_server(taskdedup_redis_server, taskdedup_redis_url):
            client = redis.Redis.from_url(taskdedup_redis_url)
            assert RedisStore(client).get(KEY).owner == "task-1"
            assert seen == [taskdedup_redis_server.process.pid]
        """
    )
    result = pytester.runpytest("-p", "no:cacheprovider")
    result.assert_outcomes(passed=2)


def test_no_server_is_started_unless_asked(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(
        """
        import taskdedup.testing

        def test_plain(monkeypatch):
            def refuse(self, *args, **kwargs):
                raise AssertionError("a server was started")
            monkeypatch.setattr(taskdedup.testing.RedisServer, "start", refuse)

        def test_memory_only(taskdedup_memory_store):
            assert taskdedup_memory_store.get("taskdedup:x:" + "0" * 32) is None
        """
    )
    result = pytester.runpytest("-p", "no:cacheprovider", "--setup-show")
    result.assert_outcomes(passed=2)
    assert "taskdedup_redis_server" not in result.stdout.str()


def test_a_given_url_starts_no_server(pytester: pytest.Pytester, redis_url: str) -> None:
    pytester.makepyfile(
        """
        import redis

        def test_given(taskdedup_redis_url, request):
            assert taskdedup_redis_url == request.config.getoption("--taskdedup-redis-url")
            assert redis.Redis.from_url(taskdedup_redis_url).ping()
        """
    )
    result = pytester.runpytest("-p", "no:cacheprovider", "--setup-show",
                                f"--taskdedup-redis-url={redis_url}")
    result.assert_outcomes(passed=1)
    assert "taskdedup_redis_server" not in result.stdout.str()


def test_the_disabled_fixture_turns_gating_off_for_one_test(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(
        """
        import taskdedup

        def test_off(taskdedup_disabled):
            assert taskdedup.is_disabled()

        def test_on_again():
            assert not taskdedup.is_disabled()
        """
    )
    result = pytester.runpytest("-p", "no:cacheprovider")
    result.assert_outcomes(passed=2)


def _recipes() -> dict[str, str]:
    text = DOC.read_text()
    blocks = re.findall(r"```python\n(# (test_\w+\.py)\n.*?)```", text, re.DOTALL)
    return {name: source for source, name in blocks}


RECIPES = ["test_eager_recipe.py", "test_module_app_recipe.py", "test_rq_recipe.py"]


@pytest.mark.parametrize("name", RECIPES)
def test_the_recipes_of_the_testing_page_pass(pytester: pytest.Pytester, name: str) -> None:
    recipes = _recipes()
    assert sorted(recipes) == RECIPES
    pytester.path.joinpath(name).write_text(recipes[name])
    result = pytester.runpytest("-p", "no:cacheprovider", name)
    result.assert_outcomes(passed=3)


def test_a_module_level_app_leaks_between_tests_without_the_reset(
    pytester: pytest.Pytester,
) -> None:
    # the stumble the fixture fixes: the same recipe, setting the store by hand
    source = _recipes()["test_module_app_recipe.py"].replace(
        "taskdedup_in_memory(app)  #",
        "app.conf.update(taskdedup_store=taskdedup_memory_store, taskdedup_stats=False)  #",
    ).replace("def locks_in_memory(taskdedup_in_memory):",
              "def locks_in_memory(taskdedup_memory_store):")
    pytester.path.joinpath("test_by_hand.py").write_text(source)
    result = pytester.runpytest("-p", "no:cacheprovider", "test_by_hand.py")
    result.assert_outcomes(passed=1, failed=2)


# -- taskdedup.disabled() ------------------------------------------------------------------------


@pytest.fixture
def switch_on(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("TASKDEDUP_DISABLED", raising=False)
    taskdedup.enable()


@pytest.mark.usefixtures("switch_on")
def test_disabled_turns_gating_off_and_back_on() -> None:
    assert "disabled" in taskdedup.__all__
    assert not taskdedup.is_disabled()
    with taskdedup.disabled():
        assert taskdedup.is_disabled()
    assert not taskdedup.is_disabled()


@pytest.mark.usefixtures("switch_on")
def test_disabled_restores_the_state_when_the_block_raises() -> None:
    with pytest.raises(KeyError), taskdedup.disabled():
        raise KeyError("boom")
    assert not taskdedup.is_disabled()


@pytest.mark.usefixtures("switch_on")
def test_disabled_keeps_a_switch_that_was_already_off() -> None:
    taskdedup.disable()
    try:
        with pytest.raises(RuntimeError), taskdedup.disabled():
            with taskdedup.disabled():
                pass
            assert taskdedup.is_disabled()  # the inner block restored "off", not "on"
            raise RuntimeError
        assert taskdedup.is_disabled()
    finally:
        taskdedup.enable()


def test_the_fake_clock_takes_numbers_and_timedeltas() -> None:
    clock = FakeClock(start=5.0)
    assert clock() == 5.0
    assert clock.advance(1.5) == 6.5
    assert clock.advance(timedelta(seconds=2)) == 8.5
    with pytest.raises(ValueError):
        clock.advance(float("nan"))


def test_stop_worker_says_where_a_worker_that_does_not_stop_hung() -> None:
    """A process that ignores SIGTERM is sent SIGABRT after the timeout: its stacks are on
    its stderr (PYTHONFAULTHANDLER) and the caller gets TimeoutExpired; one that stops
    gives its exit code."""
    code = ("import signal, sys, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
            "print('up', flush=True)\ndef parked_here(): time.sleep(60)\nparked_here()")
    hung = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, env={**os.environ, "PYTHONFAULTHANDLER": "1"})
    assert hung.stdout is not None and hung.stdout.readline() == b"up\n"
    with pytest.raises(subprocess.TimeoutExpired):
        stop_worker(hung, timeout=1)
    assert hung.returncode == -signal.SIGABRT
    assert b"parked_here" in hung.stderr.read()  # type: ignore[union-attr]
    calm = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    assert stop_worker(calm, timeout=10) == -signal.SIGTERM
