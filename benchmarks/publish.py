"""Enqueue throughput: Celery ``apply_async`` (plain, taskdedup, celery-once, celery-singleton)
and RQ ``enqueue`` (plain ``Queue`` vs ``DedupQueue``), with distinct and with all-duplicate
arguments, no worker running; plus where the time of a gated Celery publish goes.

The broker is the benchmark's Redis server, and so is every lock store. Between runs the
queue and the locks are purged. Each timed run is followed by a sanity check of what was
actually published (the queue length), so a "distinct" run really deduplicated nothing and
a "duplicate" run really published nothing but the original.
"""

from __future__ import annotations

import cProfile
import os
import pstats
import uuid
from collections import defaultdict
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from typing import Any

from rq import Queue
from rq.job import Job

from taskdedup import Debounce, Policy
from taskdedup.celery import batch, get_deduplicator
from taskdedup.core import Identity
from taskdedup.rq import DedupQueue

from . import apps, jobs
from .harness import RoundTripCounter, Row, interleaved, purge, rate, server_commands
from .micro import Context

__all__ = [
    "RUN_ARG", "capture_message", "celery_publish", "count_round_trips", "gated_breakdown",
    "rq_enqueue",
]

PLAIN = "plain Celery apply_async"
RQ_PLAIN = "plain RQ Queue.enqueue"
RQ_COALESCE = "taskdedup DedupQueue on_duplicate='coalesce' (fused enqueue)"
RQ_DEBOUNCE = "taskdedup DedupQueue debounce=Debounce(60) (generation, then the enqueue)"
"""SPEC §15 on RQ: every debounced call is scheduled (a countdown), so a duplicate costs an
enqueue too; it waits in the queue's scheduled registry, not in the queue."""
SEPARATE = "taskdedup DedupTask, gate in its own round trip"
"""Locks configured apart from the broker (``taskdedup_url``): the reservation is its own
round trip, sent before Celery builds the message and read just before the publish."""
FUSED = "taskdedup DedupTask, reserve inside the push (default)"
"""A ``redis://`` broker holding the locks: ``RedisTransport``, one script per publish."""
BATCHED = "taskdedup DedupTask, own round trip, loop in batch()"
COALESCE = "taskdedup on_duplicate='coalesce' (inside the push)"
DEBOUNCE = "taskdedup debounce=Debounce(60) (generation, then the push)"
"""SPEC §15: every call is published (with a countdown), so a duplicate costs a push too."""
RUN_ARG = "bench:publish|0"  # the fifth argument; no worker runs these
DUP_ARGS = (7, 5000, "EUR", "ORD-duplicate", RUN_ARG)


def _distinct(tag: str, n: int) -> list[tuple[Any, ...]]:
    return [(i, 5000, "EUR", f"ORD-{tag}-{i}", RUN_ARG) for i in range(n)]


def _celery_tasks() -> dict[str, tuple[Any, tuple[str, ...]]]:
    """Label → (task, key patterns of its locks)."""
    tasks: dict[str, tuple[Any, tuple[str, ...]]] = {
        PLAIN: (apps.charge_plain, ()),
        SEPARATE: (apps.charge_dedup, ("taskdedup:bench.*",)),
    }
    if apps.HAVE_ONCE:
        tasks["celery-once QueueOnce"] = (apps.charge_once, ("qo_bench.*",))
    if apps.HAVE_SINGLETON:
        tasks["celery-singleton Singleton"] = (apps.charge_singleton, ("SINGLETONLOCK_*",))
    tasks[FUSED] = (apps.charge_fused, ("taskdedup:bench.*",))
    tasks[BATCHED] = (apps.charge_dedup, ("taskdedup:bench.*",))
    tasks[COALESCE] = (apps.charge_coalesce, ("taskdedup:bench.*", "taskdedup:next:*"))
    tasks[DEBOUNCE] = (apps.charge_debounce, ("taskdedup:bench.*", "taskdedup:debounce:*"))
    return tasks


def _block(label: str) -> AbstractContextManager[Any]:
    """What the loop of calls runs in: ``batch()`` for the batched variant."""
    return batch() if label == BATCHED else nullcontext()


def capture_message(ctx: Context) -> None:
    """Publish one plain task and keep its message body (the floor's LPUSH payload)."""
    ctx.client.delete(apps.PUBLISH_QUEUE)
    apps.charge_plain.apply_async(_distinct("capture", 1)[0])
    body = ctx.client.lindex(apps.PUBLISH_QUEUE, 0)
    ctx.message = bytes(body) if body else b""
    ctx.client.delete(apps.PUBLISH_QUEUE)


def count_round_trips(
    ctx: Context, call: Callable[[int], Any], k: int, label: str = "",
) -> tuple[float, dict[str, float], dict[str, float]]:
    """Round trips per call (client side), server commands per call, client commands."""
    with server_commands(ctx.client, k) as server, RoundTripCounter() as counter:
        with _block(label):
            for i in range(k):
                call(i)
    client = {name: round(n / k, 3) for name, n in sorted(counter.commands.items())}
    return counter.round_trips / k, server, client


def celery_publish(ctx: Context) -> list[Row]:
    """Celery publish throughput, distinct then all-duplicate arguments."""
    client, n, k = ctx.client, ctx.sizes.publish, ctx.sizes.count_ops
    tasks = _celery_tasks()
    queue = apps.PUBLISH_QUEUE
    rows: list[Row] = []

    def reset(patterns: tuple[str, ...]) -> None:
        client.delete(queue)
        purge(client, *patterns)

    for task, patterns in tasks.values():  # connections, scripts, declarations
        reset(patterns)
        for args in _distinct(f"warm-{uuid.uuid4().hex}", 20):
            task.apply_async(args)
    for scenario in ("distinct", "duplicate"):
        published: dict[str, int] = {}

        def variant(label: str, task: Any, patterns: tuple[str, ...],
                    scenario: str = scenario, published: dict[str, int] = published,
                    ) -> Callable[[int], float]:
            def one(run: int) -> float:
                reset(patterns)
                if scenario == "distinct":
                    argv = _distinct(f"{run}-{uuid.uuid4().hex}", n)
                else:
                    task.apply_async(DUP_ARGS)  # the original takes the lock
                    argv = [DUP_ARGS] * n
                apply = task.apply_async

                def body(count: int) -> None:
                    with _block(label):
                        for args in argv:
                            apply(args)

                sample = rate(body, n)
                published[label] = int(client.llen(queue))
                return sample

            return one

        samples, ratios = interleaved(
            {label: variant(label, task, patterns) for label, (task, patterns) in tasks.items()},
            ctx.sizes.runs, baseline=PLAIN,
        )
        for label, (task, patterns) in tasks.items():
            reset(patterns)
            if scenario == "duplicate":
                task.apply_async(DUP_ARGS)
                argv = [DUP_ARGS] * k
            else:
                argv = _distinct(f"count-{uuid.uuid4().hex}", k)
            rts, server, sent = count_round_trips(
                ctx, lambda i, t=task, a=argv: t.apply_async(a[i]), k, label)
            every = label in (PLAIN, DEBOUNCE)  # a debounced call is always published
            expected = n if scenario == "distinct" or every else 1
            expected += 1 if scenario == "duplicate" and every else 0
            note = "" if published[label] == expected else (
                f"published {published[label]} messages, expected {expected}")
            rows.append(Row(
                f"celery publish ({scenario})", label, "publishes/s", samples[label],
                baseline=None if label == PLAIN else PLAIN, ratios=ratios.get(label),
                round_trips=rts, commands=server, note=note,
                extra={"client_commands": sent, "messages_published_last_run": published[label]},
            ))
        reset(tuple(p for _, patterns in tasks.values() for p in patterns))
    return rows


def rq_enqueue(ctx: Context) -> list[Row]:
    """RQ enqueue throughput: plain ``Queue`` vs ``DedupQueue`` (its default policy, coalesce and
    debounce: SPEC §15), distinct then duplicates."""
    client, n, k = ctx.client, ctx.sizes.enqueue, ctx.sizes.count_ops
    name = "bench-rq-enqueue"
    queues: dict[str, Queue] = {
        RQ_PLAIN: Queue(name, connection=client),
        "taskdedup DedupQueue.enqueue": DedupQueue(name, connection=client, dedup=apps.POLICY),
        RQ_COALESCE: DedupQueue(name, connection=client,
                                dedup=Policy(ttl=600, on_duplicate="coalesce")),
        RQ_DEBOUNCE: DedupQueue(name, connection=client,
                                dedup=Policy(ttl=600, debounce=Debounce(60))),
    }
    patterns = ("taskdedup:benchmarks.jobs.rq_charge:*", "taskdedup:next:*",
                "taskdedup:debounce:*")
    func = jobs.rq_charge
    rows: list[Row] = []
    scheduled = queues[RQ_PLAIN].scheduled_job_registry

    def reset() -> None:
        queues[RQ_PLAIN].empty()
        for job_id in scheduled.get_job_ids():  # the debounced calls, and their job hashes
            client.delete(Job.key_for(job_id))
        client.delete(scheduled.key)
        purge(client, *patterns)

    def count(label: str, queue: Queue) -> int:
        """The jobs the run added: queued, or scheduled for a debounced call."""
        return scheduled.count if label == RQ_DEBOUNCE else queue.count

    for queue in queues.values():
        reset()
        for args in _distinct(f"warm-{uuid.uuid4().hex}", 10):
            queue.enqueue(func, *args)
    for scenario in ("distinct", "duplicate"):
        published: dict[str, int] = {}

        def variant(label: str, queue: Queue, scenario: str = scenario,
                    published: dict[str, int] = published) -> Callable[[int], float]:
            def one(run: int) -> float:
                reset()
                if scenario == "distinct":
                    argv = _distinct(f"{run}-{uuid.uuid4().hex}", n)
                else:
                    queue.enqueue(func, *DUP_ARGS)
                    argv = [DUP_ARGS] * n
                enqueue = queue.enqueue

                def body(count: int) -> None:
                    for args in argv:
                        enqueue(func, *args)

                sample = rate(body, n)
                published[label] = count(label, queue)
                return sample

            return one

        samples, ratios = interleaved(
            {label: variant(label, queue) for label, queue in queues.items()},
            ctx.sizes.runs, baseline=RQ_PLAIN,
        )
        for label, queue in queues.items():
            reset()
            if scenario == "duplicate":
                queue.enqueue(func, *DUP_ARGS)
                argv = [DUP_ARGS] * k
            else:
                argv = _distinct(f"count-{uuid.uuid4().hex}", k)
            rts, server, sent = count_round_trips(
                ctx, lambda i, q=queue, a=argv: q.enqueue(func, *a[i]), k
            )
            every = label in (RQ_PLAIN, RQ_DEBOUNCE)  # a debounced call is always enqueued
            expected = n if scenario == "distinct" or every else 1
            expected += 1 if scenario == "duplicate" and every else 0
            note = "" if published[label] == expected else (
                f"queued {published[label]} jobs, expected {expected}")
            rows.append(Row(
                f"rq enqueue ({scenario})", label, "enqueues/s", samples[label],
                baseline=None if label == RQ_PLAIN else RQ_PLAIN, ratios=ratios.get(label),
                round_trips=rts, commands=server, note=note,
                extra={"client_commands": sent, "jobs_queued_last_run": published[label]},
            ))
    reset()
    return rows


# -- where a gated publish spends its time ------------------------------------------------------


def _parts(ctx: Context, section: str, key_of: Callable[[Any], str],
           gate: Callable[[str, str], Any] | None, plain: Callable[[Any], Any],
           gated: Callable[[Any], Any], reset: Callable[[], None]) -> list[Row]:
    """Time per call of each part of a gated enqueue, interleaved: identity (``key_of``),
    the reserve round trip (``gate``; None where the reservation rides in the framework's
    own round trip), the framework's own enqueue (``plain``), the whole gated call
    (``gated``); and what is left, the integration's wrapper."""
    n = max(2, ctx.sizes.publish // 2)

    def timed(prepare: Callable[[int], Callable[[], None]]) -> Callable[[int], float]:
        def one(run: int) -> float:
            reset()
            body = prepare(run)
            return 1e6 / rate(lambda count: body(), n)

        return one

    def identity_part(run: int) -> Callable[[], None]:
        argv = _distinct(f"id-{run}-{uuid.uuid4().hex}", n)

        def body() -> None:
            for args in argv:
                key_of(args)

        return body

    def gate_part(run: int) -> Callable[[], None]:
        keys = [key_of(args) for args in _distinct(f"gate-{run}-{uuid.uuid4().hex}", n)]
        owners = [str(uuid.uuid4()) for _ in keys]

        def body() -> None:
            for key, owner in zip(keys, owners, strict=True):
                gate(key, owner)

        return body

    def call_part(call: Callable[[Any], Any]) -> Callable[[int], Callable[[], None]]:
        def prepare(run: int) -> Callable[[], None]:
            argv = _distinct(f"pub-{run}-{uuid.uuid4().hex}", n)

            def body() -> None:
                for args in argv:
                    call(args)

            return body

        return prepare

    parts = {"identity: Deduplicator.identity (fingerprint + key)": timed(identity_part)}
    if gate is not None:
        parts["reserve: Deduplicator.gate (one EVALSHA)"] = timed(gate_part)
    parts["plain enqueue (the framework's own)"] = timed(call_part(plain))
    parts["total: gated enqueue"] = timed(call_part(gated))
    samples, _ = interleaved(parts, ctx.sizes.runs, baseline=None)
    rows = [Row(section, name, "us/call", values) for name, values in samples.items()]
    columns = list(zip(*samples.values(), strict=True))
    if gate is not None:
        rest = [total - ident - res - pub for ident, res, pub, total in columns]
        note = ("total - identity - reserve - plain, per run (the reserve's wait hides under "
                "the framework's message build: what is left of it, the wrapper, can be "
                "below 0)")
    else:
        rest = [total - ident - pub for ident, pub, total in columns]
        note = ("total - identity - plain, per run: the wrapper and the script's extra "
                "server time (the reservation rides in the framework's own round trip)")
    rows.append(Row(section, "rest: the integration's own wrapper", "us/call", rest,
                    note=note))
    reset()
    return rows


def gated_breakdown(ctx: Context) -> tuple[list[Row], dict[str, Any]]:
    """Where the time of a gated Celery publish and of a gated RQ enqueue goes: the parts,
    timed and interleaved, and a differential cProfile (gated minus plain, per call)."""
    client = ctx.client
    dedup = get_deduplicator(apps.app)
    task = apps.charge_dedup
    func = task._func()
    policy = apps.POLICY

    def celery_reset() -> None:
        client.delete(apps.PUBLISH_QUEUE)
        purge(client, "taskdedup:bench.*")

    def celery_key(args: Any) -> str:
        return dedup.identity(task.name, policy, args, None, func=func).key

    rows = _parts(
        ctx, "gated Celery publish, gate in its own round trip, per call", celery_key,
        lambda key, owner: dedup.gate(task.name, policy, Identity(key), owner,
                                      ttl_ms=policy.ttl_ms),
        apps.charge_plain.apply_async, task.apply_async, celery_reset,
    )
    profiles = {"celery": _differential(ctx, apps.charge_plain.apply_async, task.apply_async,
                                        celery_reset)}
    fused = apps.charge_fused
    rows += _parts(
        ctx, "gated Celery publish, reserve inside the push (default), per call",
        lambda args: dedup.identity(fused.name, policy, args, None, func=fused._func()).key,
        None, apps.charge_plain.apply_async, fused.apply_async, celery_reset,
    )

    name = "bench-rq-breakdown"
    plain_q = Queue(name, connection=client)
    gated_q = DedupQueue(name, connection=client, dedup=policy)
    rq_dedup = gated_q.dedup
    job = jobs.rq_charge
    assert gated_q._fuses(gated_q.create_job(job, args=(1,)))  # one round trip, as shipped
    job_name = f"{job.__module__}.{job.__qualname__}"

    def rq_reset() -> None:
        plain_q.empty()
        purge(client, f"taskdedup:{job_name}:*")

    def rq_key(args: Any) -> str:
        return rq_dedup.identity(job_name, policy, args, None, func=job).key

    rows += _parts(
        ctx, "gated RQ enqueue (reserve inside RQ's own enqueue), per call", rq_key, None,
        lambda args: plain_q.enqueue(job, *args), lambda args: gated_q.enqueue(job, *args),
        rq_reset,
    )
    profiles["rq"] = _differential(ctx, lambda args: plain_q.enqueue(job, *args),
                                   lambda args: gated_q.enqueue(job, *args), rq_reset)
    return rows, profiles


def _package(filename: str, function: str) -> str:
    if filename == "~":
        return "socket I/O" if ("recv" in function or "send" in function) else "builtins"
    for name in ("taskdedup", "celery", "kombu", "rq", "redis", "billiard", "vine", "amqp"):
        if f"{os.sep}{name}{os.sep}" in filename:
            return name
    return "python stdlib"


def _own_times(call: Callable[[Any], Any], argv: list[tuple[Any, ...]],
               ) -> dict[tuple[str, int, str], tuple[float, float]]:
    profiler = cProfile.Profile()
    profiler.enable()
    for args in argv:
        call(args)
    profiler.disable()
    stats: Any = pstats.Stats(profiler).stats
    return {where: (values[2], values[3]) for where, values in stats.items()}


def _differential(ctx: Context, plain: Callable[[Any], Any], gated: Callable[[Any], Any],
                  reset: Callable[[], None]) -> dict[str, Any]:
    """cProfile ``profile_calls`` plain and gated calls; per call: own time by package for
    both, and the functions whose own time grows the most from plain to gated."""
    calls = ctx.sizes.profile_calls
    reset()
    base = _own_times(plain, _distinct(f"prof-plain-{uuid.uuid4().hex}", calls))
    reset()
    ours = _own_times(gated, _distinct(f"prof-gated-{uuid.uuid4().hex}", calls))
    reset()

    def by_package(stats: dict[tuple[str, int, str], tuple[float, float]]) -> dict[str, float]:
        grouped: dict[str, float] = defaultdict(float)
        for (filename, _, function), (own, _) in stats.items():
            grouped[_package(filename, function)] += own / calls * 1e6
        return {k: round(v, 1) for k, v in sorted(grouped.items(), key=lambda kv: -kv[1])}

    extra: list[tuple[float, str]] = []
    for where, (own, _) in ours.items():
        before = base.get(where, (0.0, 0.0))[0]
        filename, line, function = where
        extra.append(((own - before) / calls * 1e6,
                      f"{os.path.basename(filename)}:{line}({function})"))
    extra.sort(reverse=True)
    cumulative = {
        f"{os.path.basename(filename)}:{line}({function})": round(cum / calls * 1e6, 1)
        for (filename, line, function), (_, cum) in ours.items()
        if (filename.endswith(f"{os.sep}taskdedup{os.sep}core.py")
            and function in ("identity", "gate"))
        or (f"{os.sep}taskdedup{os.sep}" in filename and function in ("apply_async", "_gated",
                                                                       "enqueue", "_eval"))
    }
    plain_pkg, gated_pkg = by_package(base), by_package(ours)
    return {
        "calls": calls,
        "us_per_call_under_profiler": {"plain": round(sum(plain_pkg.values()), 1),
                                       "gated": round(sum(gated_pkg.values()), 1)},
        "own_us_per_call_by_package": {"plain": plain_pkg, "gated": gated_pkg},
        "largest_extra_own_time_us_per_call": [
            {"function": where, "extra_us": round(us, 1)} for us, where in extra[:15]
        ],
        "taskdedup_cumulative_us_per_call": cumulative,
    }
