"""Unit tests of taskdedup.celery with an in-process Celery app and no worker.

Publish paths use the in-memory broker (messages are captured with ``before_task_publish``);
execution paths use ``task_always_eager``. Every task is declared with ``shared=False`` so
that no declaration here leaks into another app of the test session.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from datetime import UTC, datetime, timedelta
from typing import Any

import celery.app.task
import pytest
import redis
from celery import Celery, chain
from kombu.exceptions import EncodeError, OperationalError

import taskdedup
from taskdedup import (
    Approximate,
    ConfigurationError,
    DuplicateTaskError,
    Event,
    MemoryStore,
    Policy,
    RedisStore,
    register_canonical,
)
from taskdedup.celery import HEADER, DedupTask, get_deduplicator
from taskdedup.stores.base import LockState


def make_app(*, eager: bool = False, store: Any = None, **conf: Any) -> Celery:
    app = Celery("unit", broker="memory://", backend="cache+memory://")
    app.conf.update(
        taskdedup_store=MemoryStore() if store is None else store,
        task_always_eager=eager,
        **conf,
    )
    app.finalize()  # tasks declared from now on are created at once (no lazy proxy)
    return app


def dtask(app: Celery, **options: Any) -> Callable[[Callable[..., Any]], Any]:
    """``@app.task(base=DedupTask, shared=False, **options)``."""
    return app.task(base=DedupTask, shared=False, **options)  # type: ignore[no-any-return]


def key_of(task: Any, *args: Any, **kwargs: Any) -> str:
    dedup = get_deduplicator(task.app)
    return dedup.identity(task.name, task._dedup_policy, args, kwargs, func=task._func()).key


def store_of(app: Celery) -> Any:
    return get_deduplicator(app).store


@pytest.fixture(autouse=True)
def _gating_enabled(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    monkeypatch.delenv("TASKDEDUP_DISABLED", raising=False)
    monkeypatch.delenv("TASKDEDUP_URL", raising=False)
    taskdedup.enable()
    yield
    taskdedup.enable()


@pytest.fixture
def app() -> Celery:
    return make_app()


@pytest.fixture
def eager_app() -> Celery:
    return make_app(eager=True)


# -- declaration ---------------------------------------------------------------------------


def test_include_naming_a_missing_parameter_raises_at_declaration(app: Celery) -> None:
    with pytest.raises(ConfigurationError) as info:

        @dtask(app, dedup=Policy(include=["nope"]))
        def charge(user_id: int, amount: int) -> None: ...

    message = str(info.value)
    assert "'nope'" in message
    assert "user_id" in message and "amount" in message


def test_exclude_naming_a_missing_parameter_raises_at_declaration(app: Celery) -> None:
    with pytest.raises(ConfigurationError, match=r"Policy\.exclude names 'nope'"):

        @dtask(app, dedup={"exclude": ["nope"]})
        def charge(user_id: int) -> None: ...


def test_invalid_dict_policy_raises_at_declaration(app: Celery) -> None:
    with pytest.raises(ConfigurationError, match=r"Policy\.mode='bogus'"):

        @dtask(app, dedup={"mode": "bogus"})
        def charge(user_id: int) -> None: ...


def test_invalid_policy_on_a_lazy_app_raises_when_the_app_is_finalized() -> None:
    app = Celery("lazy", broker="memory://", backend="cache+memory://")
    app.conf.taskdedup_store = MemoryStore()

    @dtask(app, dedup={"mode": "bogus"})  # not finalized: Celery returns a lazy proxy
    def charge(user_id: int) -> None: ...

    with pytest.raises(ConfigurationError, match=r"Policy\.mode='bogus'"):
        app.finalize()


def test_no_dedup_option_means_the_default_policy(app: Celery) -> None:
    @dtask(app)
    def charge(user_id: int) -> None: ...

    assert charge._dedup_policy == Policy()


def test_dedup_true_means_the_default_policy(app: Celery) -> None:
    @dtask(app, dedup=True)
    def charge(user_id: int) -> None: ...

    assert charge._dedup_policy == Policy()


def test_dict_policy_is_coerced(app: Celery) -> None:
    @dtask(app, dedup={"mode": "until_executed", "ttl": 30})
    def charge(user_id: int) -> None: ...

    assert charge._dedup_policy == Policy(mode="until_executed", ttl=30)


def test_policy_is_inherited_from_a_configured_base(app: Celery) -> None:
    class Base(DedupTask):
        dedup = Policy(ttl=5, scope="eu")

    @app.task(base=Base, shared=False)
    def charge(user_id: int) -> None: ...

    assert charge._dedup_policy == Policy(ttl=5, scope="eu")


def test_dedup_false_is_inherited_from_a_base(app: Celery) -> None:
    class NoDedup(DedupTask):
        dedup = False

    @app.task(base=NoDedup, shared=False)
    def charge(user_id: int) -> None: ...

    assert charge._dedup_policy is None


def test_inherited_include_is_checked_against_the_task_at_declaration(app: Celery) -> None:
    class Base(DedupTask):
        dedup = Policy(include=["user_id"])

    with pytest.raises(ConfigurationError, match="'user_id'"):

        @app.task(base=Base, shared=False)
        def send(email: str) -> None: ...


def test_dedup_false_at_declaration_turns_gating_off(
    app: Celery, published: list[dict[str, Any]]
) -> None:
    @dtask(app, dedup=False)
    def charge(user_id: int) -> None: ...

    assert charge._dedup_policy is None
    r1, r2 = charge.delay(42), charge.delay(42)
    assert r1.id != r2.id
    assert [h[HEADER] for h in published] == [{"task": charge.name, "off": 1}] * 2
    assert list(store_of(app).scan("taskdedup:")) == []


# -- publish path --------------------------------------------------------------------------


def test_gated_publish_carries_the_lock_key_and_reserves_it(
    app: Celery, published: list[dict[str, Any]]
) -> None:
    @dtask(app, dedup=Policy(ttl=60))
    def charge(user_id: int, amount: int) -> None: ...

    result = charge.delay(42, amount=5)
    key = key_of(charge, 42, 5)
    assert len(published) == 1
    assert published[0][HEADER] == {"task": charge.name, "key": key}
    assert published[0]["id"] == result.id
    info = store_of(app).get(key)
    assert info is not None
    assert (info.state, info.owner) == (LockState.QUEUED, result.id)


def test_an_explicit_keys_publish_carries_its_argument_check_for_the_workers_claim(
    app: Celery, published: list[dict[str, Any]]
) -> None:
    """``dedup_key=``: the reservation holds the arguments' digest, and the header carries it
    (``"check"``), so the worker's claim expects that value; a call without one carries none.
    A republish (a retry) keeps it."""
    @dtask(app, dedup=Policy(ttl=60))
    def charge(user_id: int, amount: int) -> None: ...

    result = charge.apply_async((42, 5), dedup_key="ORD-1")
    header = published[0][HEADER]
    info = store_of(app).get(header["key"])
    assert info is not None and info.owner == result.id
    assert len(info.check) == 32 and header["check"] == info.check
    charge.delay(43, amount=5)
    assert "check" not in published[1][HEADER]
    charge.apply_async((42, 5), task_id=result.id, headers={HEADER: header})  # a republish
    assert published[2][HEADER]["check"] == info.check


def test_duplicate_publish_returns_the_original_and_sends_nothing(
    app: Celery, published: list[dict[str, Any]]
) -> None:
    @dtask(app)
    def charge(user_id: int, amount: int) -> None: ...

    first = charge.delay(42, 5)
    again = charge.apply_async((42,), {"amount": 5})
    assert again.id == first.id
    assert len(published) == 1
    assert get_deduplicator(app).counters.get(Event.DUPLICATE, charge.name) == 1


def test_per_call_dedup_false_sends_the_off_header_and_is_not_gated(
    app: Celery, published: list[dict[str, Any]]
) -> None:
    @dtask(app)
    def charge(user_id: int) -> None: ...

    first = charge.delay(42)
    bypass = charge.apply_async((42,), dedup=False)
    assert bypass.id != first.id
    assert len(published) == 2
    assert published[1][HEADER] == {"task": charge.name, "off": 1}
    info = store_of(app).get(key_of(charge, 42))
    assert info is not None and info.owner == first.id  # untouched by the bypass


def test_per_call_dedup_key_replaces_the_arguments(
    app: Celery, published: list[dict[str, Any]]
) -> None:
    @dtask(app)
    def charge(user_id: int, amount: int) -> None: ...

    first = charge.apply_async((42, 5), dedup_key="ORD-789")
    again = charge.apply_async((42, 5), dedup_key="ORD-789")
    other = charge.apply_async((42, 5), dedup_key="ORD-790")
    assert again.id == first.id
    assert other.id != first.id
    assert published[0][HEADER]["key"] != key_of(charge, 42, 5)


@pytest.mark.parametrize(
    "timing",
    [
        {"countdown": 30},
        {"eta": "aware"},
        {"eta": "naive"},
    ],
    ids=["countdown", "eta-aware", "eta-naive-utc"],
)
def test_reservation_covers_the_delay_plus_ttl(app: Celery, timing: dict[str, Any]) -> None:
    @dtask(app, dedup=Policy(ttl=10))
    def charge(user_id: int) -> None: ...

    if timing.get("eta") == "aware":
        timing = {"eta": datetime.now(UTC) + timedelta(seconds=30)}
    elif timing.get("eta") == "naive":
        timing = {"eta": datetime.now(UTC).replace(tzinfo=None) + timedelta(seconds=30)}
    charge.apply_async((42,), **timing)
    info = store_of(app).get(key_of(charge, 42))
    assert info is not None
    assert 39_000 <= info.ttl_ms <= 40_000


def test_reservation_without_delay_is_ttl(app: Celery) -> None:
    @dtask(app, dedup=Policy(ttl=10))
    def charge(user_id: int) -> None: ...

    charge.delay(42)
    info = store_of(app).get(key_of(charge, 42))
    assert info is not None
    assert 9_000 <= info.ttl_ms <= 10_000


@pytest.mark.parametrize("expires", [5, "datetime"], ids=["seconds", "datetime"])
def test_expires_caps_the_reservation(app: Celery, expires: Any) -> None:
    @dtask(app, dedup=Policy(ttl=10))
    def charge(user_id: int) -> None: ...

    if expires == "datetime":
        expires = datetime.now(UTC) + timedelta(seconds=5)
    charge.apply_async((42,), expires=expires)
    info = store_of(app).get(key_of(charge, 42))
    assert info is not None
    assert 4_000 < info.ttl_ms <= 6_000


def test_publish_failure_releases_the_reservation_and_reaches_the_caller(
    app: Celery, monkeypatch: pytest.MonkeyPatch, published: list[dict[str, Any]]
) -> None:
    @dtask(app)
    def charge(user_id: int) -> None: ...

    real_apply_async = celery.app.task.Task.apply_async
    failures = iter([OperationalError("broker down")])

    def flaky(self: Any, *args: Any, **kwargs: Any) -> Any:
        failure = next(failures, None)
        if failure is not None:
            raise failure
        return real_apply_async(self, *args, **kwargs)

    monkeypatch.setattr(celery.app.task.Task, "apply_async", flaky)
    key = key_of(charge, 42)
    with pytest.raises(OperationalError, match="broker down"):
        charge.delay(42)
    assert store_of(app).get(key) is None
    counters = get_deduplicator(app).counters
    assert counters.get(Event.RELEASED, charge.name) == 1
    assert published == []

    result = charge.delay(42)  # the same call now goes through: nothing was suppressed
    assert len(published) == 1
    info = store_of(app).get(key)
    assert info is not None and info.owner == result.id


class Cents:
    """A type with a canonical form (so it has an identity) that JSON cannot serialize."""

    def __init__(self, value: int) -> None:
        self.value = value


register_canonical(Cents, lambda c: c.value)


def test_serialization_failure_releases_the_reservation(app: Celery) -> None:
    @dtask(app)
    def charge(amount: Any) -> None: ...

    with pytest.raises(EncodeError):
        charge.delay(Cents(500))
    assert list(store_of(app).scan("taskdedup:")) == []
    assert get_deduplicator(app).counters.get(Event.RELEASED, charge.name) == 1


def test_duplicate_with_a_link_raises_instead_of_dropping_the_callback(
    app: Celery, published: list[dict[str, Any]]
) -> None:
    @dtask(app)
    def charge(user_id: int) -> int:
        return user_id

    @app.task(shared=False)
    def notify(result: int) -> None: ...

    first = charge.delay(42)
    with pytest.raises(DuplicateTaskError) as info:
        charge.apply_async((42,), link=notify.s())
    assert "link" in str(info.value)
    assert info.value.existing_id == first.id
    assert info.value.key == key_of(charge, 42)
    assert len(published) == 1


def test_duplicate_head_of_a_chain_raises_instead_of_dropping_the_chain(
    app: Celery, published: list[dict[str, Any]]
) -> None:
    @dtask(app)
    def charge(user_id: int) -> int:
        return user_id

    @app.task(shared=False)
    def notify(result: int) -> None: ...

    first = charge.delay(42)
    with pytest.raises(DuplicateTaskError, match="chain") as info:
        chain(charge.s(42), notify.s()).apply_async()
    assert info.value.existing_id == first.id
    assert len(published) == 1


def test_on_duplicate_drop_returns_none_and_logs_at_debug_only(
    app: Celery, caplog: pytest.LogCaptureFixture, published: list[dict[str, Any]]
) -> None:
    @dtask(app, dedup=Policy(on_duplicate="drop"))
    def charge(user_id: int) -> None: ...

    first = charge.delay(42)
    with caplog.at_level(logging.INFO, logger="taskdedup"):
        assert charge.delay(42) is None
    assert [r for r in caplog.records if r.name == "taskdedup"] == []  # counted, not at INFO
    with caplog.at_level(logging.DEBUG, logger="taskdedup"):
        assert charge.delay(42) is None
    records = [r for r in caplog.records if r.name == "taskdedup" and r.levelno == logging.DEBUG]
    assert any("dropped duplicate" in r.getMessage() and first.id in r.getMessage()
               for r in records)
    assert len(published) == 1


def test_on_duplicate_raise_raises_with_key_and_existing_id(app: Celery) -> None:
    @dtask(app, dedup=Policy(on_duplicate="raise"))
    def charge(user_id: int) -> None: ...

    first = charge.delay(42)
    with pytest.raises(DuplicateTaskError) as info:
        charge.delay(42)
    assert info.value.existing_id == first.id
    assert info.value.key == key_of(charge, 42)


def test_duplicate_of_an_unknown_holder_raises_duplicate_task_error(app: Celery) -> None:
    @dtask(app)
    def charge(user_id: int) -> None: ...

    store_of(app).set_raw(key_of(charge, 42), "not-a-taskdedup-value", ttl_ms=60_000)
    with pytest.raises(DuplicateTaskError):
        charge.delay(42)


def test_disable_turns_gating_off(app: Celery, published: list[dict[str, Any]]) -> None:
    @dtask(app)
    def charge(user_id: int) -> None: ...

    taskdedup.disable()
    try:
        r1, r2 = charge.delay(42), charge.delay(42)
    finally:
        taskdedup.enable()
    assert r1.id != r2.id
    assert [h[HEADER] for h in published] == [{"task": charge.name, "off": 1}] * 2
    assert list(store_of(app).scan("taskdedup:")) == []
    charge.delay(42)
    assert published[-1][HEADER] == {"task": charge.name, "key": key_of(charge, 42)}


def test_env_var_turns_gating_off(
    app: Celery, monkeypatch: pytest.MonkeyPatch, published: list[dict[str, Any]]
) -> None:
    @dtask(app)
    def charge(user_id: int) -> None: ...

    monkeypatch.setenv("TASKDEDUP_DISABLED", "1")
    charge.delay(42)
    charge.delay(42)
    assert len(published) == 2
    assert list(store_of(app).scan("taskdedup:")) == []


# -- eager execution -----------------------------------------------------------------------


def test_eager_duplicate_returns_the_original_id_and_runs_once(eager_app: Celery) -> None:
    runs: list[int] = []

    @dtask(eager_app)
    def charge(user_id: int) -> int:
        runs.append(user_id)
        return user_id

    first = charge.delay(42)
    again = charge.delay(42)
    assert first.get() == 42
    assert again.id == first.id
    assert runs == [42]
    info = store_of(eager_app).get(key_of(charge, 42))
    assert info is not None
    assert (info.state, info.owner) == (LockState.DONE, first.id)


def test_eager_until_executed_releases_after_success(eager_app: Celery) -> None:
    runs: list[int] = []

    @dtask(eager_app, dedup=Policy(mode="until_executed"))
    def charge(user_id: int) -> None:
        runs.append(user_id)

    first, second = charge.delay(42), charge.delay(42)
    assert first.id != second.id
    assert runs == [42, 42]
    lock = store_of(eager_app).get(key_of(charge, 42))  # free: at most the second's tombstone
    assert lock is None or (lock.state, lock.owner) == (LockState.FINISHED, second.id)


def test_eager_failure_releases_the_lock(eager_app: Celery) -> None:
    runs: list[int] = []

    @dtask(eager_app)
    def charge(user_id: int) -> None:
        runs.append(user_id)
        raise RuntimeError("card declined")

    first = charge.delay(42)
    assert first.state == "FAILURE"
    assert store_of(eager_app).get(key_of(charge, 42)) is None
    assert get_deduplicator(eager_app).counters.get(Event.RELEASED, charge.name) == 1
    second = charge.delay(42)
    assert second.id != first.id
    assert runs == [42, 42]


def test_eager_per_call_dedup_false_runs_every_time_without_a_lock(eager_app: Celery) -> None:
    runs: list[int] = []

    @dtask(eager_app)
    def charge(user_id: int) -> None:
        runs.append(user_id)

    charge.apply_async((42,), dedup=False)
    charge.apply_async((42,), dedup=False)
    assert runs == [42, 42]
    assert store_of(eager_app).get(key_of(charge, 42)) is None
    assert get_deduplicator(eager_app).counters.snapshot() == {}


def test_per_call_policy_may_not_change_what_the_worker_applies(eager_app: Celery) -> None:
    """mode/ttl/lease/identity are applied by the worker from the declaration, so a per-call
    override of them is refused instead of being half-applied."""
    runs: list[int] = []

    @dtask(eager_app, dedup=Policy(ttl=100))
    def charge(user_id: int) -> None:
        runs.append(user_id)

    with pytest.raises(ConfigurationError, match="per-call dedup= may only change"):
        charge.apply_async((42,), dedup=Policy(mode="until_executed", ttl=100))
    with pytest.raises(ConfigurationError, match="per-call dedup= may only change"):
        charge.apply_async((42,), dedup={"ttl": 5})
    with pytest.raises(ConfigurationError, match="per-call dedup= may only change"):
        charge.apply_async((42,), dedup=Policy(ttl=100, window=Approximate(1000, 0.01)))

    @dtask(eager_app, dedup=False)
    def undeclared(user_id: int) -> None: ...

    with pytest.raises(ConfigurationError, match="per-call dedup= may only change"):
        undeclared.apply_async((42,), dedup=Policy(mode="until_executed"))
    assert runs == []
    assert store_of(eager_app).get(key_of(charge, 42)) is None


def test_per_call_on_duplicate_override_applies_to_that_call(eager_app: Celery) -> None:
    @dtask(eager_app, dedup=Policy(ttl=100))
    def charge(user_id: int) -> None: ...

    first = charge.apply_async((42,))
    assert charge.apply_async((42,)).id == first.id  # declared: return
    with pytest.raises(DuplicateTaskError) as info:
        charge.apply_async((42,), dedup={"on_duplicate": "raise"})
    assert info.value.existing_id == first.id
    assert charge.apply_async((42,), dedup=Policy(ttl=100, on_duplicate="drop")) is None


# -- store resolution ----------------------------------------------------------------------


def test_no_store_with_a_non_redis_broker_is_a_configuration_error() -> None:
    app = Celery("amqp-app", broker="amqp://guest:guest@127.0.0.1:5672//")
    with pytest.raises(ConfigurationError) as info:
        get_deduplicator(app)
    message = str(info.value)
    assert "taskdedup_url" in message
    assert "TASKDEDUP_URL" in message
    assert "amqp://" in message
    assert "_taskdedup" not in app.__dict__


def test_store_from_taskdedup_url(redis_url: str) -> None:
    app = Celery("u", broker="amqp://127.0.0.1//")
    app.conf.taskdedup_url = redis_url
    store = get_deduplicator(app).store
    assert isinstance(store, RedisStore)
    port = int(redis_url.rsplit(":", 1)[1].split("/")[0])
    assert store.client.connection_pool.connection_kwargs["port"] == port


def test_taskdedup_url_wins_over_the_env_var(
    redis_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("TASKDEDUP_URL", "redis://127.0.0.1:1/3")
    app = Celery("u", broker="amqp://127.0.0.1//")
    app.conf.taskdedup_url = redis_url
    store = get_deduplicator(app).store
    assert isinstance(store, RedisStore)
    assert store.client.connection_pool.connection_kwargs["port"] != 1


def test_store_from_the_env_var_is_used_for_gating(
    redis_url: str, redis_client: redis.Redis, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("TASKDEDUP_URL", redis_url)
    app = Celery("env-app", broker="memory://", backend="cache+memory://")
    app.finalize()
    assert isinstance(get_deduplicator(app).store, RedisStore)

    @dtask(app)
    def charge(user_id: int) -> None: ...

    result = charge.delay(42)
    assert redis_client.get(key_of(charge, 42)) == f"Q||{result.id}".encode()
    assert charge.delay(42).id == result.id


def test_store_falls_back_to_a_redis_broker(redis_url: str) -> None:
    app = Celery("redis-broker", broker=redis_url)
    store = get_deduplicator(app).store
    assert isinstance(store, RedisStore)
    assert store.client.connection_pool.connection_kwargs["port"] == int(
        redis_url.rsplit(":", 1)[1].split("/")[0]
    )


def test_taskdedup_store_may_be_a_redis_client(redis_url: str) -> None:
    client = redis.Redis.from_url(redis_url)
    app = Celery("client-app", broker="memory://")
    app.conf.taskdedup_store = client
    store = get_deduplicator(app).store
    assert isinstance(store, RedisStore)
    assert store.client is client
    client.close()


def test_taskdedup_store_may_be_a_store() -> None:
    store = MemoryStore()
    app = Celery("store-app", broker="memory://")
    app.conf.taskdedup_store = store
    assert get_deduplicator(app).store is store


@pytest.mark.parametrize("bad", ["redis://localhost:6379/0", object(), 42],
                         ids=["url", "object", "int"])  # ids stable across xdist workers
def test_taskdedup_store_of_a_wrong_type_is_a_configuration_error(bad: Any) -> None:
    app = Celery("bad-store", broker="memory://")
    app.conf.taskdedup_store = bad
    with pytest.raises(ConfigurationError, match="taskdedup_store must be a taskdedup Store"):
        get_deduplicator(app)


def test_deduplicator_is_built_once_per_app() -> None:
    app = make_app()
    dedup = get_deduplicator(app)
    assert get_deduplicator(app) is dedup
    assert app.__dict__["_taskdedup"] is dedup


def test_taskdedup_prefix_changes_the_key_prefix(published: list[dict[str, Any]]) -> None:
    app = make_app(taskdedup_prefix="billing")

    @dtask(app)
    def charge(user_id: int) -> None: ...

    charge.delay(42)
    key = published[0][HEADER]["key"]
    assert key.startswith(f"billing:{charge.name}:")
    assert store_of(app).get(key) is not None


def test_a_countdown_beyond_the_visibility_timeout_warns_once_per_task(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """SPEC §5 / #19 A1: kombu restores a held ETA message every visibility_timeout; the
    sender is told once (taskdedup runs one copy, but each costs a delivery)."""
    app = make_app(eager=True, broker_url="redis://127.0.0.1:9/0",
                   broker_transport_options={"visibility_timeout": 10})

    @dtask(app)
    def remind(user_id: int) -> None: ...

    with caplog.at_level(logging.WARNING, logger="taskdedup"):
        remind.apply_async((1,), countdown=5)  # within: nothing said
        assert not [r for r in caplog.records if "visibility_timeout" in r.getMessage()]
        remind.apply_async((2,), countdown=30)
        remind.apply_async((3,), countdown=3600)
    said = [r.getMessage() for r in caplog.records if "visibility_timeout" in r.getMessage()]
    assert len(said) == 1 and remind.name in said[0] and "30s" in said[0], said


def test_a_countdown_of_centuries_reserves_no_longer_than_redis_can_store(
    eager_app: Celery,
) -> None:
    """SPEC §8: durations are capped at what Redis can store; a huge countdown made the
    reservation's PX overflow (every later call then failed as "store unavailable")."""
    from taskdedup.celery.task import _reservation_ttl_ms
    from taskdedup.policy import MAX_DURATION_MS

    assert _reservation_ttl_ms(Policy(), {"countdown": 1e15}) == MAX_DURATION_MS
