"""Round trips on the hot paths, counted against a real server (SPEC §10), and the benchmark
suite itself (``python -m benchmarks --quick``), run once so it cannot rot.

Counts come from two sides that must agree: a counting redis-py connection that sees only
this thread's commands (``benchmarks.harness.RoundTripCounter``), and the server's
``INFO commandstats`` deltas. Nothing here asserts a time.
"""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys
import uuid
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import redis
from celery import Celery
from rq import Queue

from benchmarks.harness import RoundTripCounter, command_calls
from taskdedup import Policy
from taskdedup.celery import DedupTask
from taskdedup.core import Deduplicator
from taskdedup.rq import DedupQueue
from taskdedup.stores.base import LockState
from taskdedup.stores.redis import SCRIPTS, RedisStore
from tests import rq_jobs

ROOT = Path(__file__).resolve().parent.parent
SHA = {name: hashlib.sha1(source.encode()).hexdigest() for name, source in SCRIPTS.items()}


def _delta(before: Counter[str], after: Counter[str]) -> Counter[str]:
    delta = after - before
    delta.pop("info", None)
    return delta


@pytest.fixture
def scripts_cached(redis_client: redis.Redis) -> None:
    """Steady state: the server has taskdedup's scripts (a cold server answers the first
    EVALSHA with NOSCRIPT and costs one EVAL more, once)."""
    for source in SCRIPTS.values():
        redis_client.script_load(source)


@pytest.fixture
def celery_app(redis_url: str) -> Iterator[tuple[Celery, Any, Any]]:
    queue = f"rt-{uuid.uuid4().hex[:8]}"
    app = Celery("rt-count", broker=redis_url, set_as_current=False)
    app.conf.update(
        taskdedup_url=redis_url, taskdedup_stats=False, task_default_queue=queue,
        task_ignore_result=True, broker_connection_retry_on_startup=True,
    )

    @app.task(name="rt.plain", shared=False)
    def plain(user_id: int, amount: int) -> None:
        """The same task without taskdedup."""

    @app.task(name="rt.gated", base=DedupTask, dedup=Policy(ttl=60), shared=False)
    def gated(user_id: int, amount: int) -> None:
        """The task behind the gate."""

    yield app, plain, gated
    app.close()


def test_gated_celery_publish_adds_exactly_one_reserve_evalsha(
    redis_client: redis.Redis, celery_app: tuple[Celery, Any, Any], scripts_cached: None,
) -> None:
    _, plain, gated = celery_app
    plain.apply_async((0, 1))  # connections, queue declaration
    gated.apply_async((0, 1))

    before = command_calls(redis_client)
    with RoundTripCounter() as plain_sent:
        plain.apply_async((1, 50))
    middle = command_calls(redis_client)
    with RoundTripCounter() as gated_sent:
        gated.apply_async((2, 50))
    after = command_calls(redis_client)

    # Client side: the gate is one EVALSHA of reserve.lua on top of Celery's own publish.
    assert gated_sent.commands - plain_sent.commands == Counter({"EVALSHA": 1})
    assert plain_sent.commands - gated_sent.commands == Counter()
    assert gated_sent.round_trips == plain_sent.round_trips + 1
    assert gated_sent.shas == [SHA["reserve"]]
    # Server side: Celery's publish is one LPUSH; the gated one adds one EVALSHA, no EVAL.
    plain_server, gated_server = _delta(before, middle), _delta(middle, after)
    assert plain_server["lpush"] == 1 and plain_server["evalsha"] == 0
    assert gated_server["lpush"] == 1
    assert gated_server["evalsha"] == 1 and gated_server["eval"] == 0


@pytest.mark.parametrize("swaps", [True, False], ids=["shipped", "scripts"])
def test_claim_and_complete_are_two_round_trips(
    redis_url: str, redis_client: redis.Redis, scripts_cached: None, swaps: bool,
) -> None:
    """A worker's claim and completion: two commands, two round trips — a swap each (SET
    IFEQ) on a server that has it (Valkey 8.1+), else a script each — and nothing else."""
    store = RedisStore(redis.Redis.from_url(redis_url), compare_and_set=swaps)
    dedup = Deduplicator(store)
    policy = Policy(ttl=60)
    warm = dedup.lock_key("rt.task", "0" * 32)
    dedup.start("rt.task", policy, warm, "warm-owner")  # connection and heartbeat thread
    dedup.finish("rt.task", policy, warm, "warm-owner", success=True)
    key, owner = dedup.lock_key("rt.task", "1" * 32), str(uuid.uuid4())
    store.reserve(key, owner, 60_000)  # what the publish did

    before = command_calls(redis_client)
    with RoundTripCounter() as sent:
        started = dedup.start("rt.task", policy, key, owner)
        dedup.finish("rt.task", policy, key, owner, success=True)
    after = command_calls(redis_client)
    store.close()

    assert started.verdict.value == "accepted"
    assert sent.round_trips == 2
    server = _delta(before, after)
    if store.compare_and_set:
        assert swaps
        assert sent.commands == Counter({"SET": 2})
        assert server["set"] == 2 and server["evalsha"] == 0 and server["eval"] == 0
        assert server["get"] == 0  # no script: no GET or SET inside one
    else:
        assert sent.commands == Counter({"EVALSHA": 2})
        assert sent.shas == [SHA["claim"], SHA["complete"]]
        assert server["evalsha"] == 2 and server["eval"] == 0
    info = RedisStore(redis_client).get(key)
    assert info is not None and info.state is LockState.DONE and info.owner == owner


def test_gated_rq_enqueue_is_one_round_trip_on_the_queues_redis(
    redis_client: redis.Redis, scripts_cached: None,
) -> None:
    """Locks in the queue's own Redis (the default): the reservation, RQ's job write and its
    push run in one EVALSHA of enqueue.lua — one round trip, where a plain enqueue takes two
    — and the server runs the same RQ commands as for a plain enqueue. A duplicate is that
    one round trip too (the original job's hash rides in the answer)."""
    name = f"rt-{uuid.uuid4().hex[:8]}"
    plain = Queue(name, connection=redis_client)
    gated = DedupQueue(name, connection=redis_client, dedup=Policy(ttl=60))
    plain.enqueue(rq_jobs.record, "warm", 0)
    gated.enqueue(rq_jobs.record, "warm", 1)

    before = command_calls(redis_client)
    with RoundTripCounter() as plain_sent:
        plain.enqueue(rq_jobs.record, "rt", 1)
    middle = command_calls(redis_client)
    with RoundTripCounter() as gated_sent:
        job = gated.enqueue(rq_jobs.record, "rt", 2)
    after = command_calls(redis_client)
    with RoundTripCounter() as duplicate_sent:
        again = gated.enqueue(rq_jobs.record, "rt", 2)
    plain.empty()

    assert plain_sent.round_trips == 2
    assert gated_sent.round_trips == 1
    assert gated_sent.commands == Counter({"EVALSHA": 1})
    assert gated_sent.shas == [SHA["enqueue"]]
    plain_server, gated_server = _delta(before, middle), _delta(middle, after)
    assert plain_server["evalsha"] == 0
    assert gated_server["evalsha"] == 1 and gated_server["eval"] == 0
    for command in ("sadd", "hset", "rpush"):
        assert gated_server[command] == plain_server[command] > 0, command
    assert job is not None and again is not None and again.id == job.id
    assert again.func_name == job.func_name and again.args == ("rt", 2)
    assert duplicate_sent.round_trips == 1 and duplicate_sent.shas == [SHA["enqueue"]]


def test_gated_rq_enqueue_with_another_lock_store_adds_exactly_one_evalsha(
    redis_url: str, redis_client: redis.Redis, scripts_cached: None,
) -> None:
    """Locks on another client (``dedup_store=``/``TASKDEDUP_URL``): one reserve EVALSHA on
    top of RQ's own enqueue, nothing else."""
    name = f"rt-{uuid.uuid4().hex[:8]}"
    plain = Queue(name, connection=redis_client)
    gated = DedupQueue(name, connection=redis_client, dedup=Policy(ttl=60),
                       dedup_store=RedisStore(redis.Redis.from_url(redis_url)))
    plain.enqueue(rq_jobs.record, "warm", 0)
    gated.enqueue(rq_jobs.record, "warm", 1)

    with RoundTripCounter() as plain_sent:
        plain.enqueue(rq_jobs.record, "rt", 1)
    with RoundTripCounter() as gated_sent:
        gated.enqueue(rq_jobs.record, "rt", 2)
    plain.empty()

    assert gated_sent.commands - plain_sent.commands == Counter({"EVALSHA": 1})
    assert plain_sent.commands - gated_sent.commands == Counter()
    assert gated_sent.round_trips == plain_sent.round_trips + 1
    assert gated_sent.shas == [SHA["reserve"]]


def test_benchmark_suite_runs_quick(redis_url: str, tmp_path: Path) -> None:
    """``python -m benchmarks --quick`` on the session's server: every section runs (real
    Celery and RQ workers, the memory servers), exits 0 and writes its JSON."""
    out = tmp_path / "bench.json"
    done = subprocess.run(
        [sys.executable, "-m", "benchmarks", "--quick", "--url", redis_url, "--json", str(out)],
        cwd=ROOT, capture_output=True, text=True, timeout=240,
    )
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    data = json.loads(out.read_text(encoding="utf-8"))
    sections = {row["section"].split(" (")[0] for row in data["rows"]}
    assert {
        "floor", "identity", "celery publish", "rq enqueue",
        "gated Celery publish, gate in its own round trip, per call",
        "gated Celery publish, reserve inside the push", "gated RQ enqueue", "celery worker",
        "celery fetch", "rq worker", "bulk", "memory",
    } <= sections
    assert data["bars"] and data["machine"]["nproc"]
    gated = [r for r in data["rows"] if r["section"] == "celery publish (distinct)"
             and r["name"] == "taskdedup DedupTask, gate in its own round trip"]
    assert gated and gated[0]["round_trips"] == 2.0
    # The headline: in a default-configured app whose first publish was a plain task, a gated
    # publish costs no more round trips than a plain one (the reservation rides in the push).
    realistic = {r["name"]: r for r in data["rows"]
                 if r["section"] == "celery publish (realistic app)"}
    assert realistic["plain task"]["round_trips"] == 1.0
    assert realistic["taskdedup DedupTask"]["round_trips"] == 1.0


def test_rq_enqueue_compares_coalesce_and_debounce_with_plain_in_one_run(
    redis_url: str, redis_client: redis.Redis
) -> None:
    """Issue #22: the RQ enqueue section has a coalesce and a debounce row beside the plain
    enqueue (ratios of the same run), each row's check of what it added holds (debounced
    calls are scheduled, every one of them; a duplicate of a queued coalesced call adds
    nothing), and their round trips: coalesce one (the fused enqueue), debounce two."""
    from benchmarks.harness import Sizes
    from benchmarks.micro import Context
    from benchmarks.publish import RQ_COALESCE, RQ_DEBOUNCE, rq_enqueue

    ctx = Context(redis_url, redis_client, Sizes.quick(), log=lambda line: None)
    rows = {(row.section, row.name): row for row in rq_enqueue(ctx)}
    for scenario in ("distinct", "duplicate"):
        for label in (RQ_COALESCE, RQ_DEBOUNCE):
            row = rows[(f"rq enqueue ({scenario})", label)]
            assert row.note == "" and row.ratios and row.baseline == "plain RQ Queue.enqueue"
    added = {label: rows[("rq enqueue (duplicate)", label)].extra["jobs_queued_last_run"]
             for label in (RQ_COALESCE, RQ_DEBOUNCE)}
    assert added == {RQ_COALESCE: 1, RQ_DEBOUNCE: Sizes.quick().enqueue + 1}
    assert rows[("rq enqueue (distinct)", RQ_COALESCE)].round_trips == 1.0
    assert rows[("rq enqueue (distinct)", RQ_DEBOUNCE)].round_trips == 2.0


def test_the_ab_harness_runs_two_trees_side_by_side(redis_url: str) -> None:
    """``python -m benchmarks ab OLD NEW`` (here the same tree twice, tiny batches): a
    worker per tree, and per tree the ratio, the CPU per task and the server's commands per
    task, gated above plain by the claim and the completion."""
    done = subprocess.run(
        [sys.executable, "-m", "benchmarks", "ab", str(ROOT), str(ROOT), "--rounds", "1",
         "--tasks", "30", "--url", redis_url],
        cwd=ROOT, capture_output=True, text=True, timeout=240,
    )
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    summaries = [line for line in done.stdout.splitlines() if "per task, plain → gated" in line]
    assert len(summaries) == 2, done.stdout
    # a SET each where the server swaps; else an EVALSHA each with its GET and SET inside
    added = 2 if RedisStore(redis.Redis.from_url(redis_url)).compare_and_set else 6
    for line in summaries:
        plain, gated = (float(x) for x in
                        line.split("server commands ")[1].split(" → "))
        assert plain == pytest.approx(10, abs=1), done.stdout
        assert gated == pytest.approx(plain + added, abs=0.5), done.stdout


def test_the_workers_guard_round_trips_count_swaps_and_scripts_together() -> None:
    """A worker process's other script (a stats flush, once in a batch) must not hide the
    swaps: the prefork row read 0.00 round trips when it did."""
    from benchmarks.workers import _guard_round_trips

    assert _guard_round_trips({"set": 2.0, "evalsha": 0.0005, "get": 0.001}) == \
        pytest.approx(2.0005)
    assert _guard_round_trips({"evalsha": 2.0, "get": 2.0}) == pytest.approx(2.0)
    assert _guard_round_trips({"del": 1.0, "incrby": 1.0}) == 0.0
