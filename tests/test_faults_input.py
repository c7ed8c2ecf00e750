"""Bad input: arguments without an identity, huge and odd arguments, and lock values in
Redis that taskdedup did not write.

Arguments (extending tests/test_fingerprint.py, which covers JSON-like values, the message
format and 10,000-deep lists/dicts): hypothesis builds nested arguments of every supported
type with at most one unsupported value hidden at a random place; the answer is a digest, or
a ``TypeError`` that names exactly that place. Huge (10 MB) strings and bytes get a digest
and a bounded key, and nothing of them reaches Redis (the time is not asserted). Refusals
through Celery and RQ enqueue nothing and store nothing.

Lock values (SPEC §5, "a value not written by taskdedup"): garbage, an empty string, a bad
state letter, a bad check, no owner, binary junk, a hash, a list, a set. The enqueue gate
answers with a clear ``DuplicateTaskError``; a real Celery worker and a real RQ worker that
meet such a value at claim skip the body, do not die, and keep processing other tasks.
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import math
import os
import re
import uuid
from collections import Counter
from collections.abc import Callable
from decimal import Decimal
from typing import Any

import pytest
import redis
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from taskdedup import DuplicateTaskError, Policy, fingerprint
from taskdedup.core import Deduplicator, Verdict
from taskdedup.identity import MAX_DEPTH
from taskdedup.rq import DedupJob, DedupQueue, skipped_info
from taskdedup.stores import RedisStore
from taskdedup.testing import wait_for
from tests import fault_jobs
from tests.fault_jobs import ends, report
from tests.workers import RqWorker

HEX32 = re.compile(r"[0-9a-f]{32}")


# -- nested arguments with one bad value at a known path -------------------------------------

good_leaves = (
    st.none() | st.booleans() | st.integers() | st.text(max_size=6)
    | st.floats(allow_nan=False) | st.binary(max_size=6)  # non-UTF-8 bytes included
    | st.decimals(allow_nan=False, allow_infinity=False)
    | st.datetimes(timezones=st.none() | st.just(dt.UTC)) | st.dates() | st.uuids()
    | st.text(alphabet=st.characters(min_codepoint=0xD800, max_codepoint=0xDFFF), max_size=3)
)


@dataclasses.dataclass
class Unsupported:
    """What hides the bad value: the value and the words the message must contain."""

    make: Callable[[], Any]
    words: str


BAD = [
    Unsupported(object, "unsupported type object"),
    Unsupported(lambda: lambda: None, "unsupported type function"),
    Unsupported(lambda: float("nan"), "float NaN"),
    Unsupported(lambda: Decimal("NaN"), "NaN"),
    Unsupported(lambda: 1j, "unsupported type complex"),
    Unsupported(lambda: iter(()), "unsupported type"),
]

names = st.from_regex(r"[a-z]{1,5}", fullmatch=True)
trees = st.recursive(
    good_leaves,
    lambda inner: st.lists(inner, max_size=4) | st.lists(inner, max_size=4).map(tuple)
    | st.dictionaries(names, inner, max_size=4),
    max_leaves=25,
)


def leaf_paths(value: Any, path: str) -> list[str]:
    """The path of every leaf and every empty container, in the library's notation."""
    if isinstance(value, (list, tuple)) and value:
        return [p for i, v in enumerate(value) for p in leaf_paths(v, f"{path}[{i}]")]
    if isinstance(value, dict) and value:
        return [p for k, v in value.items() for p in leaf_paths(v, f"{path}[{k!r}]")]
    return [path]


def put(value: Any, path: str, root: str, bad: Any) -> Any:
    """``value`` with the leaf at ``path`` (below ``root``) replaced by ``bad``."""
    if path == root:
        return bad
    step = re.match(r"\[(\d+|'[a-z]+')\]", path[len(root):])
    assert step is not None
    token = step.group(1)
    below = root + step.group(0)
    if isinstance(value, dict):
        key = token.strip("'")
        return {**value, key: put(value[key], path, below, bad)}
    index = int(token)
    items = list(value)
    items[index] = put(items[index], path, below, bad)
    return type(value)(items)


SEEN: Counter[str] = Counter()


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    args=st.lists(trees, max_size=3),
    kwargs=st.dictionaries(names, trees, max_size=3),
    bad=st.none() | st.sampled_from(BAD),
    where=st.integers(min_value=0),
)
def check_nested_arguments(
    args: list[Any], kwargs: dict[str, Any], bad: Unsupported | None, where: int
) -> None:
    paths = ([p for i, a in enumerate(args) for p in leaf_paths(a, f"args[{i}]")]
             + [p for k, v in kwargs.items() for p in leaf_paths(v, f"kwargs[{k!r}]")])
    if bad is None or not paths:
        digest = fingerprint("t", args, kwargs)
        assert HEX32.fullmatch(digest)
        assert fingerprint("t", args, kwargs) == digest  # deterministic
        SEEN["digest"] += 1
        return
    path = paths[where % len(paths)]
    if path.startswith("args["):
        index = int(path[5:path.index("]")])
        args[index] = put(args[index], path, f"args[{index}]", bad.make())
    else:
        name = path[8:path.index("]")].strip("'")
        kwargs[name] = put(kwargs[name], path, f"kwargs[{name!r}]", bad.make())
    with pytest.raises(TypeError) as caught:
        fingerprint("t", args, kwargs)
    message = str(caught.value)
    assert message.startswith(f"cannot fingerprint {path}: "), (path, message)
    assert bad.words in message
    SEEN["refused at the exact path"] += 1
    SEEN[f"depth {path.count('[') - 1}"] += 1


def test_nested_arguments_give_a_digest_or_a_type_error_naming_the_bad_value() -> None:
    SEEN.clear()
    check_nested_arguments()
    assert SEEN["refused at the exact path"] > 0 and SEEN["digest"] > 0
    report("nested_arguments", examples=SEEN["digest"] + SEEN["refused at the exact path"],
           digests=SEEN["digest"], refused_naming_the_path=SEEN["refused at the exact path"],
           deepest_bad_value=max((int(k.split()[1]) for k in SEEN if k.startswith("depth")),
                                 default=0))


def test_nan_is_refused_with_its_path_as_a_key_in_a_set_and_deep_in_a_tuple() -> None:
    cases = {
        "kwargs['x'][<float key>]": {"x": {math.nan: 1}},
        "kwargs['x']{set}": {"x": {1, math.nan}},
        "kwargs['x'][0]['a'][1][1]": {"x": ({"a": [1, (2, math.nan)]},)},
    }
    for path, kwargs in cases.items():
        with pytest.raises(TypeError, match=re.escape(f"cannot fingerprint {path}: float NaN")):
            fingerprint("t", (), kwargs)


def test_non_utf8_bytes_and_lone_surrogates_have_distinct_digests() -> None:
    values = [b"\xff\xfe", b"\xff\xff", "\udcff\udcfe", "\udcff\udcff", "\xff\xfe", b"\x00"]
    digests = [fingerprint("t", (v,)) for v in values]
    assert all(HEX32.fullmatch(d) for d in digests)
    assert len(set(digests)) == len(values)


def test_huge_arguments_get_a_digest_and_never_reach_redis(rc: redis.Redis) -> None:
    """10 MB of str and of bytes: a digest; the lock key is bounded and the stored value
    holds no argument. (How long hashing 10 MB takes is not asserted.)"""
    huge_text = "x" * 10_000_000
    huge_bytes = os.urandom(10_000_000)
    dedup = Deduplicator(RedisStore(rc))
    policy = Policy(ttl=60)
    for value in (huge_text, huge_bytes, [huge_text, {"b": huge_bytes}]):
        identity = dedup.identity("huge", policy, (value,))
        assert len(identity.key) < 100
        owner = uuid.uuid4().hex
        assert dedup.gate("huge", policy, identity, owner).verdict is Verdict.ACCEPTED
        stored = rc.get(identity.key)
        assert stored == f"Q||{owner}".encode()
        assert dedup.gate("huge", policy, identity, "other").verdict is Verdict.DUPLICATE
        rc.delete(identity.key)


def deep_mixed(depth: int) -> Any:
    """list, dict and tuple nested alternately, deeper than Python's recursion limit."""
    value: Any = "leaf"
    for level in range(depth):
        value = [value] if level % 3 == 0 else {"k": value} if level % 3 == 1 else (value,)
    return value


def test_deep_mixed_nesting_is_refused_at_enqueue_by_celery_and_rq_storing_nothing(
    redis_url: str, rc: redis.Redis
) -> None:
    from tests import fault_celery_app as capp

    queue = f"faults-input-{uuid.uuid4().hex[:6]}"
    capp.configure(redis_url, queue=queue)
    deep = deep_mixed(50_000)
    q = DedupQueue(queue, connection=rc, dedup=Policy(ttl=60))
    before = set(rc.scan_iter(match="taskdedup:tests.fault_*"))
    with pytest.raises(TypeError, match=f"nested deeper than {MAX_DEPTH} levels"):
        capp.work.apply_async((deep,), queue=queue)
    with pytest.raises(TypeError, match=f"nested deeper than {MAX_DEPTH} levels"):
        q.enqueue(fault_jobs.work, deep)
    assert rc.llen(queue) == 0 and q.count == 0
    assert set(rc.scan_iter(match="taskdedup:tests.fault_*")) <= before  # no new lock
    # up to the limit is fine
    ok = deep_mixed(MAX_DEPTH - 2)
    assert HEX32.fullmatch(fingerprint("t", (ok,)))


# -- lock values taskdedup did not write -------------------------------------------------------

MALFORMED: dict[str, Callable[[redis.Redis, str], Any]] = {
    "garbage": lambda c, k: c.set(k, "hello world"),
    "empty": lambda c, k: c.set(k, ""),
    "bad-state": lambda c, k: c.set(k, "X||task-1"),
    "bad-check": lambda c, k: c.set(k, "Q|nothex|task-1"),
    "no-owner": lambda c, k: c.set(k, "R||"),
    "binary": lambda c, k: c.set(k, b"\xff\xfe\x00\x01junk"),
    "hash": lambda c, k: (c.delete(k), c.hset(k, "state", "Q")),
    "list": lambda c, k: (c.delete(k), c.rpush(k, "Q||task-1")),
    "set": lambda c, k: (c.delete(k), c.sadd(k, "R||task-1")),
}


def test_malformed_locks_refuse_enqueue_with_a_clear_duplicate_error(
    redis_url: str, rc: redis.Redis
) -> None:
    from tests import fault_celery_app as capp

    queue = f"faults-input-{uuid.uuid4().hex[:6]}"
    capp.configure(redis_url, queue=queue)
    from taskdedup.celery import get_deduplicator

    cdedup = get_deduplicator(capp.app)
    q = DedupQueue(queue, connection=rc, dedup=Policy(ttl=60))
    policy = q.dedup_policy
    assert policy is not None
    for kind, write in MALFORMED.items():
        label = f"{kind}-{uuid.uuid4().hex[:8]}"
        ckey = cdedup.identity(capp.work.name, capp.work._dedup_policy, (label,), {},
                               func=capp.work._func()).key
        rkey = q.dedup.identity("tests.fault_jobs.work", policy, (label,), {},
                                func=fault_jobs.work).key
        for key in (ckey, rkey):
            write(rc, key)
        with pytest.raises(DuplicateTaskError, match="holds a value taskdedup did not write"):
            capp.work.apply_async((label,), queue=queue)
        with pytest.raises(DuplicateTaskError, match="holds a value taskdedup did not write"):
            q.enqueue(fault_jobs.work, label)
        for key in (ckey, rkey):  # never touched
            assert rc.exists(key)
            rc.delete(key)
    assert rc.llen(queue) == 0 and q.count == 0


def test_rq_enqueue_against_a_queued_lock_with_a_non_utf8_owner_is_a_clear_answer(
    rc: redis.Redis,
) -> None:
    q = DedupQueue(f"faults-input-{uuid.uuid4().hex[:6]}", connection=rc, dedup=Policy(ttl=60))
    q.heal_grace = 0.05
    policy = q.dedup_policy
    assert policy is not None
    label = uuid.uuid4().hex[:8]
    key = q.dedup.identity("tests.fault_jobs.work", policy, (label,), {},
                           func=fault_jobs.work).key
    rc.set(key, b"Q||\xff\xfeowner", ex=60)
    try:
        try:
            q.enqueue(fault_jobs.work, label)
        except DuplicateTaskError:
            pass  # a clear refusal is fine; a heal (the job is enqueued) is fine too
    finally:
        rc.delete(key)
        q.empty()


def test_rq_enqueue_against_a_running_lock_of_a_foreign_owner_is_a_clear_answer(
    rc: redis.Redis,
) -> None:
    q = DedupQueue(f"faults-input-{uuid.uuid4().hex[:6]}", connection=rc, dedup=Policy(ttl=60))
    policy = q.dedup_policy
    assert policy is not None
    label = uuid.uuid4().hex[:8]
    key = q.dedup.identity("tests.fault_jobs.work", policy, (label,), {},
                           func=fault_jobs.work).key
    rc.set(key, "R||celery task/42", ex=60)
    try:
        try:
            job = q.enqueue(fault_jobs.work, label)
            assert job is None or job.id == "celery task/42"
        except DuplicateTaskError:
            pass
    finally:
        rc.delete(key)
        q.empty()


@pytest.mark.slow
def test_malformed_locks_met_by_real_workers_skip_the_body_and_the_workers_keep_working(
    redis_url: str, rc: redis.Redis
) -> None:
    """Tasks are enqueued while no worker runs; their locks are then overwritten by another
    program; the workers start, meet the values at claim, skip those bodies (SPEC §5:
    an unknown holder is a duplicate) without dying, and run the normal tasks after them."""
    from tests import fault_celery_app as capp

    queue = f"faults-input-{uuid.uuid4().hex[:6]}"
    capp.configure(redis_url, queue=queue)
    from taskdedup.celery import get_deduplicator

    cdedup = get_deduplicator(capp.app)
    q = DedupQueue(queue, connection=rc, dedup=Policy(ttl=60, lease=5))
    policy = q.dedup_policy
    assert policy is not None
    kinds = [*MALFORMED, "non-utf8-owner"]
    writers = {**MALFORMED, "non-utf8-owner": lambda c, k: c.set(k, b"R||\xff\xfeowner")}
    celery_ids: dict[str, str] = {}
    rq_jobs: dict[str, Any] = {}
    labels: dict[str, str] = {}
    for kind in kinds:
        label = labels[kind] = f"{kind}-{uuid.uuid4().hex[:8]}"
        celery_ids[kind] = capp.work.apply_async((label,), queue=queue).id
        rq_jobs[kind] = q.enqueue(fault_jobs.work, label)
        ckey = cdedup.identity(capp.work.name, capp.work._dedup_policy, (label,), {},
                               func=capp.work._func()).key
        rkey = q.dedup.identity("tests.fault_jobs.work", policy, (label,), {},
                                func=fault_jobs.work).key
        for key in (ckey, rkey):
            writers[kind](rc, key)
    normal = [f"normal-{uuid.uuid4().hex[:8]}" for _ in range(3)]
    normal_celery = [capp.work.apply_async((x,), queue=queue).id for x in normal]
    normal_rq = [q.enqueue(fault_jobs.work, x) for x in normal]

    cworker = capp.FaultCeleryWorker(redis_url, queue=queue, concurrency=1)
    rworker = RqWorker(redis_url, [queue], scheduler=False)
    try:
        cworker.start()
        rworker.start()
        wait_for(lambda: all(rc.get(f"state:{i}") for i in [*celery_ids.values(),
                                                               *normal_celery]),
                 timeout=60, what="celery worker went through every task")
        wait_for(lambda: all(j.get_status() == "finished" for j in [*rq_jobs.values(),
                                                                    *normal_rq]),
                 timeout=60, what="rq worker went through every job")
        assert cworker.process is not None and cworker.process.poll() is None
        assert rworker.process is not None and rworker.process.poll() is None
        for kind in kinds:  # skipped: the body never ran, not a failure
            assert rc.get(f"state:{celery_ids[kind]}") == b"SKIPPED", kind
            info = skipped_info(DedupJob.fetch(rq_jobs[kind].id, connection=rc))
            assert info is not None, kind
            assert not ends(rc, labels[kind]), kind
        for x in normal:  # and the workers kept working: Celery and RQ ran each once
            assert len(ends(rc, x)) == 2
        crashed_lines = [line for line in cworker.output().splitlines()
                         + rworker.output().splitlines() if "Traceback" in line]
    finally:
        cworker.stop()
        rworker.stop()
        q.empty()
    report("malformed_locks_at_claim", kinds=len(kinds), celery_skipped=len(kinds),
           rq_skipped=len(kinds), workers_died=0, normal_tasks_after=2 * len(normal),
           tracebacks_in_worker_logs=len(crashed_lines))
