"""A message's ``taskdedup`` header is input from outside (SPEC §8; issue #19 B3), with a
real Celery worker: a lock key is used only when it is a bounded ``str`` this very task could
have made under the prefix; anything else is ignored (WARNING) and the identity recomputed
from the arguments. A claim Redis refuses for what it is (NOPERM) fails the task clearly,
pointing at ``taskdedup doctor``, instead of re-publishing it every few seconds forever."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from typing import Any

import pytest
import redis

from taskdedup.celery import HEADER, skipped_info
from taskdedup.testing import wait_for
from tests.effects import recorded
from tests.workers import CeleryWorker

pytestmark = pytest.mark.slow

QUEUE = "it-untrusted"


@pytest.fixture(scope="module")
def worker(redis_url: str, rc: redis.Redis) -> Iterator[CeleryWorker]:
    w = CeleryWorker(redis_url, queue=QUEUE, concurrency=2).start()
    try:
        yield w
    finally:
        w.kill()


@pytest.fixture(scope="module")
def capp(redis_url: str, worker: CeleryWorker) -> Any:
    from tests import celery_app

    celery_app.configure(redis_url, QUEUE)
    return celery_app


def label() -> str:
    return uuid.uuid4().hex[:12]


def send(capp: Any, task: Any, args: tuple[Any, ...], key: Any) -> Any:
    """The message a forger (or a broken client) publishes: by name, with a header of its own."""
    return capp.app.send_task(task.name, args, headers={HEADER: {"task": task.name, "key": key}})


def test_a_header_naming_another_tasks_lock_cannot_hijack_it(
    capp: Any, rc: redis.Redis, worker: CeleryWorker
) -> None:
    """0.1 claimed the named key: the victim's genuine call then got the forger's id back and
    never ran. Now the forger's message runs under its own identity, and the victim's call
    runs."""
    name, victim_arg = label(), label()
    victim_key = capp.lock_key(capp.strict, victim_arg)
    forged = send(capp, capp.record, (name,), victim_key)
    assert forged.get(timeout=30) == f"{name}:0"
    assert not rc.exists(victim_key)
    own = capp.lock_key(capp.record, name)
    wait_for(lambda: rc.get(own) == f"D||{forged.id}".encode(), timeout=10,
             what="its own identity done")
    genuine = capp.strict.delay(victim_arg)
    assert genuine.id != forged.id
    assert genuine.get(timeout=30) == victim_arg
    assert recorded(rc, victim_arg) == ["1"]
    assert "carries a lock key in its 'taskdedup' header that this task would not make" in (
        worker.output())


@pytest.mark.parametrize("key", [12345, ["x"], "x" * 10_000_000, "elsewhere:tests.x:" + "0" * 32],
                         ids=["int", "list", "10MB", "outside-prefix"])
def test_a_malformed_header_key_is_ignored_and_the_running_original_still_guards(
    capp: Any, rc: redis.Redis, key: Any
) -> None:
    """0.1 made a lock of ``str(key)`` (or the 10 MB name): the body ran beside its running
    original. Now the identity is recomputed, so the copy is a skipped duplicate."""
    name = label()
    original = capp.gated.delay(name)
    wait_for(lambda: recorded(rc, name) == ["start"], timeout=30, what="the original runs")
    forged = send(capp, capp.gated, (name,), key)
    info = skipped_info(forged.get(timeout=30))
    assert info is not None and info["existing_id"] == original.id, forged.result
    rc.set(f"go:{name}", 1)
    assert original.get(timeout=30) == name
    assert recorded(rc, name) == ["start", "end"]
    if isinstance(key, str):
        assert not rc.exists(key)


@pytest.fixture
def acl_lock_url(redis_url: str, rc: redis.Redis) -> Iterator[str]:
    """A Redis user allowed only ``~taskdedup:*`` (the documented least-privilege rule)."""
    user, password = f"td-{uuid.uuid4().hex[:8]}", uuid.uuid4().hex
    rc.acl_setuser(user, enabled=True, passwords=[f"+{password}"], keys=["~taskdedup:*"],
                   commands=["+@all"], reset=True)
    host_port = redis_url.split("://", 1)[1].split("/", 1)[0]
    try:
        yield f"redis://{user}:{password}@{host_port}/0"
    finally:
        rc.acl_deluser(user)


def test_a_claim_redis_refuses_fails_the_task_clearly_instead_of_retrying_forever(
    capp: Any, rc: redis.Redis, redis_url: str, acl_lock_url: str
) -> None:
    """A worker whose key prefix is outside its ACL user's pattern: every claim is NOPERM.
    0.1 called it "store unavailable" and re-published the message every 5 s forever."""
    queue = f"{QUEUE}-acl"
    worker = CeleryWorker(redis_url, queue=queue, concurrency=1, env={
        "TASKDEDUP_TEST_LOCK_URL": acl_lock_url, "TASKDEDUP_PREFIX": "elsewhere"}).start()
    try:
        name = label()
        sent = capp.app.send_task(capp.record.name, (name,), queue=queue)
        with pytest.raises(Exception) as failure:
            sent.get(timeout=30)
        assert "taskdedup doctor" in str(failure.value), failure.value
        assert sent.state == "FAILURE"
        assert recorded(rc, name) == []  # never run unguarded
        assert "retrying in" not in worker.output()
        assert rc.llen(queue) == 0  # not re-published
    finally:
        worker.kill()
