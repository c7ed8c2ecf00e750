"""End-to-end worker throughput: N tasks pre-published, then drained; plain vs gated, and
kombu's fetch vs taskdedup's reliable fetch (SPEC §17).

Celery (prefork -c 2 and solo): one worker per pool stays up for all runs and consumes
``bench-live-<pool>``. A batch is published to ``bench-stage`` (no consumer, not timed),
then ``RENAME``d to the worker's queue in one command, so it sees the whole batch at once.
RQ (``Worker``, which forks a work-horse per job, and ``SimpleWorker``): the batch is
enqueued, then ``rq worker --burst`` drains it and exits.

Throughput is measured by the bodies themselves (see :mod:`benchmarks.apps`): from the
wall-clock time of the first body to that of the last, over N-1 tasks, so worker start-up
and polling never count. Plain and gated batches alternate, and each ratio is taken within
one run. Server command counts per task come from ``INFO commandstats`` over the batch
(for RQ they include the burst worker's own start and stop, amortized over N).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

from rq import Queue

from taskdedup.rq import DedupQueue

from . import apps, jobs
from .harness import Row, command_calls, command_delta, interleaved
from .micro import Context

__all__ = ["celery_fetch", "celery_workers", "rq_workers"]

ROOT = Path(__file__).resolve().parent.parent
STAGE, LIVE = "bench-stage", "bench-live"
_IGNORED = ("exists",)  # the benchmark's own polling (its two GETs of t0/t1: 2 per batch)


def _env(url: str) -> dict[str, str]:
    return {**os.environ, jobs.ENV_URL: url, "PYTHONPATH": str(ROOT)}


def _timing(ctx: Context, key: str, total: int, deadline: float,
            alive: Callable[[], None] = lambda: None) -> tuple[float, float]:
    """Wait for the last body of a batch; its (first, last) body times."""
    client = ctx.client
    while not client.exists(f"{key}:t1"):
        alive()
        if time.monotonic() > deadline:
            done = client.get(f"{key}:done")
            raise TimeoutError(f"batch {key}: {int(done or 0)} of {total} tasks done in time")
        time.sleep(0.02)
    t0, t1 = client.get(f"{key}:t0"), client.get(f"{key}:t1")
    return float(t0 or 0), float(t1 or 0)


def _rate(t0: float, t1: float, total: int) -> float:
    return (total - 1) / (t1 - t0) if total > 1 and t1 > t0 else float("nan")


class _CeleryWorker:
    """``celery worker`` consuming ``bench-live-<pool>``, in its own process group;
    ``fetch="reliable"``: ``bench-live-<pool>-reliable`` through the reliable fetch."""

    def __init__(self, ctx: Context, pool: str, concurrency: int, fetch: str = "kombu",
                 app: str = "benchmarks.apps") -> None:
        self.queue = f"{LIVE}-{pool}" + ("-reliable" if fetch == "reliable" else "")
        self.log = Path(tempfile.mkstemp(prefix=f"bench-celery-{pool}-", suffix=".log")[1])
        cmd = [
            sys.executable, "-m", "celery", "-A", app, "worker",
            "-P", pool, "-c", str(concurrency), "-Q", self.queue,
            "-n", f"bench-{pool}-{fetch}-{os.getpid()}@%h",
            "--without-gossip", "--without-mingle", "--without-heartbeat", "-l", "WARNING",
        ]
        with open(self.log, "ab") as out:
            self.process = subprocess.Popen(
                cmd, cwd=ROOT, env={**_env(ctx.url), "TASKDEDUP_BENCH_FETCH": fetch},
                stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                start_new_session=True,
            )

    def alive(self) -> None:
        if self.process.poll() is not None:
            tail = self.log.read_text(errors="replace")[-3000:]
            raise RuntimeError(f"celery worker exited with {self.process.returncode}:\n{tail}")

    def stop(self) -> None:
        """SIGKILL its process group: every batch is drained and acked by now, and a warm
        or cold shutdown of a prefork pool takes seconds that measure nothing."""
        if self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGKILL)
        self.process.wait(timeout=10)
        self.log.unlink(missing_ok=True)


def _celery_batch(ctx: Context, worker: _CeleryWorker, task: Any, total: int,
                  timeout: float) -> tuple[float, dict[str, float]]:
    client = ctx.client
    key = f"bench:celery:{uuid.uuid4().hex}"
    run = f"{key}|{total}"
    client.delete(STAGE)
    for i in range(total):
        task.apply_async((i, 5000, "EUR", f"ORD-{key}-{i}", run), queue=STAGE)
    before = command_calls(client)
    client.rename(STAGE, worker.queue)
    t0, t1 = _timing(ctx, key, total, time.monotonic() + timeout, worker.alive)
    after = command_calls(client)
    commands = command_delta(before, after, total)
    for name in _IGNORED:
        commands.pop(name, None)
    client.delete(f"{key}:done", f"{key}:t0", f"{key}:t1")
    return _rate(t0, t1, total), commands


def celery_workers(ctx: Context) -> list[Row]:
    """Celery prefork (-c 2) and solo, the realistic app (default configuration: the locks in
    the broker's Redis): plain task vs DedupTask vs the peers, pre-published batches."""
    sizes = ctx.sizes
    total = sizes.celery_tasks
    rows: list[Row] = []
    tasks = {"plain Celery task": apps.realistic["plain"],
             "taskdedup DedupTask": apps.realistic["taskdedup"],
             **{f"{peer}": task for peer, task in apps.realistic.items()
                if peer not in ("plain", "taskdedup")}}
    pools = {pool: _CeleryWorker(ctx, pool, concurrency,  # start-ups overlap; idle is ~free
                                 app="benchmarks.apps:realistic_app")
             for pool, concurrency in (("prefork", 2), ("solo", 1))}
    try:
        for pool, worker in pools.items():
            timeout = 120 + total / 20
            for task in tasks.values() if sizes.warmup else ():  # start-up, scripts: untimed
                _celery_batch(ctx, worker, task, max(2, min(total, 20)), timeout)
            commands: dict[str, dict[str, float]] = {}

            def variant(label: str, task: Any, worker: _CeleryWorker = worker,
                        commands: dict[str, dict[str, float]] = commands,
                        timeout: float = timeout) -> Callable[[int], float]:
                def one(run: int) -> float:
                    sample, commands[label] = _celery_batch(ctx, worker, task, total, timeout)
                    return sample

                return one

            samples, ratios = interleaved(
                {label: variant(label, task) for label, task in tasks.items()},
                sizes.celery_runs, baseline="plain Celery task",
            )
            rows += _celery_rows(pool, total, tasks, samples, ratios, commands)
    finally:
        for worker in pools.values():
            worker.stop()
    ctx.client.delete(STAGE, *(worker.queue for worker in pools.values()))
    return rows


def _guard_round_trips(cmds: dict[str, float]) -> float:
    """The worker's claim and completion per task, from the server's command counts: a
    script each (``EVALSHA``, whose inner ``GET``/``SET`` are not round trips), or on a server
    with ``SET IFEQ`` a swap each (``SET``; ``taskdedup/stores/cas.py``): their sum, as a
    worker process's other scripts (a stats flush, a settle) also show in the counts, once in
    a batch. Plain workers and the peers send neither (the peers' release is a ``DEL``)."""
    return (cmds.get("evalsha", 0.0) + cmds.get("eval", 0.0)) + cmds.get("set", 0.0)


def _celery_rows(pool: str, total: int, tasks: dict[str, Any], samples: dict[str, list[float]],
                 ratios: dict[str, list[float]], commands: dict[str, dict[str, float]],
                 ) -> list[Row]:
    rows = []
    for label in tasks:
        cmds = commands[label]
        rows.append(Row(
            f"celery worker ({pool}{' -c 2' if pool == 'prefork' else ''})", label,
            "tasks/s", samples[label],
            baseline=None if label.startswith("plain") else "plain Celery task",
            ratios=ratios.get(label), commands=cmds,
            round_trips=_guard_round_trips(cmds),
            note=f"{total:,} tasks per run; {sum(cmds.values()):.1f} server commands per task "
                 "(the body's INCR and the broker's included); round trips = the claim and "
                 "the completion per task (EVALSHA, or SET where the server swaps)",
        ))
    return rows


FETCH_SECTION = "celery fetch"
"""The rows of :func:`celery_fetch`: ``celery fetch (prefork -c 2)``, ``celery fetch (solo)``."""
_FETCHES = {"kombu's fetch (BRPOP)": "kombu", "taskdedup reliable fetch": "reliable"}


def celery_fetch(ctx: Context) -> list[Row]:
    """Consuming throughput, kombu's fetch vs the reliable fetch (SPEC §17: within 5 %), side
    by side: per pool (prefork -c 2, solo) one worker of each stays up, and batches of the
    plain task alternate between them within each run."""
    sizes = ctx.sizes
    total = sizes.celery_tasks
    rows: list[Row] = []
    workers = {(pool, fetch): _CeleryWorker(ctx, pool, concurrency, fetch)
               for pool, concurrency in (("prefork", 2), ("solo", 1))
               for fetch in _FETCHES.values()}
    try:
        for pool in ("prefork", "solo"):
            timeout = 120 + total / 20
            for fetch in _FETCHES.values() if sizes.warmup else ():  # start-up: untimed
                _celery_batch(ctx, workers[pool, fetch], apps.charge_plain,
                              max(2, min(total, 20)), timeout)
            commands: dict[str, dict[str, float]] = {}

            def variant(label: str, worker: _CeleryWorker,
                        commands: dict[str, dict[str, float]] = commands,
                        timeout: float = timeout) -> Callable[[int], float]:
                def one(run: int) -> float:
                    sample, commands[label] = _celery_batch(ctx, worker, apps.charge_plain,
                                                            total, timeout)
                    return sample

                return one

            baseline = next(iter(_FETCHES))
            samples, ratios = interleaved(
                {label: variant(label, workers[pool, fetch]) for label, fetch in _FETCHES.items()},
                sizes.celery_runs, baseline=baseline,
            )
            for label in _FETCHES:
                cmds = commands[label]
                rows.append(Row(
                    f"{FETCH_SECTION} ({pool}{' -c 2' if pool == 'prefork' else ''})",
                    label, "tasks/s", samples[label],
                    baseline=None if label == baseline else baseline,
                    ratios=ratios.get(label), commands=cmds,
                    round_trips=sum(cmds.get(name, 0.0) for name in _FETCH_COMMANDS),
                    note=f"{total:,} plain tasks per run; round trips = fetch and ack per task "
                         "(kombu: BRPOP, its unacked write and its ack, each a MULTI; reliable: "
                         "EVALSHA or BLMOVE, then LREM)",
                ))
    finally:
        for worker in workers.values():
            worker.stop()
    ctx.client.delete(STAGE, *(worker.queue for worker in workers.values()))
    return rows


_FETCH_COMMANDS = ("brpop", "multi", "evalsha", "eval", "blmove", "lrem")


# -- RQ --------------------------------------------------------------------------------------


def _rq_batch(ctx: Context, queue: Queue, worker_class: str, job_class: str | None,
              total: int, timeout: float) -> tuple[float, dict[str, float]]:
    client = ctx.client
    key = f"bench:rq:{uuid.uuid4().hex}"
    run = f"{key}|{total}"
    queue.empty()
    for i in range(total):
        queue.enqueue(jobs.rq_charge, i, 5000, "EUR", f"ORD-{key}-{i}", run)
    cmd = [
        sys.executable, "-m", "rq.cli", "worker", "--burst", "-w", worker_class,
        "--url", ctx.url, "-n", f"bench-{uuid.uuid4().hex[:12]}", "--logging_level", "WARNING",
        *(["--job-class", job_class] if job_class else []), queue.name,
    ]
    before = command_calls(client)
    done = subprocess.run(
        cmd, cwd=ROOT, env=_env(ctx.url), capture_output=True, text=True, timeout=timeout,
    )
    if done.returncode != 0:
        raise RuntimeError(f"rq worker exited with {done.returncode}:\n{done.stderr[-3000:]}")
    after = command_calls(client)
    t0, t1 = _timing(ctx, key, total, time.monotonic() + 5)
    commands = command_delta(before, after, total)
    for name in _IGNORED:
        commands.pop(name, None)
    client.delete(f"{key}:done", f"{key}:t0", f"{key}:t1")
    return _rate(t0, t1, total), commands


def rq_workers(ctx: Context) -> list[Row]:
    """RQ Worker (fork per job) and SimpleWorker: plain vs DedupWorker, burst drains."""
    sizes = ctx.sizes
    client = ctx.client
    rows: list[Row] = []
    kinds = (
        ("Worker (fork per job)", sizes.rq_fork_jobs, "rq.worker.Worker",
         "taskdedup.rq.DedupWorker", "shipped"),
        ("SimpleWorker (no fork)", sizes.rq_simple_jobs, "rq.worker.SimpleWorker",
         "benchmarks.rqworker.DedupSimpleWorker",
         "DedupSimpleWorker(SimpleWorker, DedupWorker) composed in benchmarks/rqworker.py: "
         "taskdedup ships no simple variant"),
    )
    for kind, total, plain_class, dedup_class, where in kinds:
        name = f"bench-rq-{'fork' if 'fork' in kind else 'simple'}"
        variants = {
            f"plain RQ {plain_class.rsplit('.', 1)[1]}": (
                Queue(name, connection=client), plain_class, None),
            f"taskdedup {dedup_class.rsplit('.', 1)[1]}": (
                DedupQueue(name, connection=client, dedup=apps.POLICY), dedup_class,
                "taskdedup.rq.DedupJob"),
        }
        baseline = next(iter(variants))
        timeout = 120 + total / 5
        commands: dict[str, dict[str, float]] = {}

        def variant(label: str, spec: tuple[Queue, str, str | None], total: int = total,
                    timeout: float = timeout, commands: dict[str, dict[str, float]] = commands,
                    ) -> Callable[[int], float]:
            queue, worker_class, job_class = spec

            def one(run: int) -> float:
                sample, commands[label] = _rq_batch(ctx, queue, worker_class, job_class,
                                                    total, timeout)
                return sample

            return one

        samples, ratios = interleaved(
            {label: variant(label, spec) for label, spec in variants.items()},
            sizes.rq_runs, baseline=baseline,
        )
        for label in variants:
            cmds = commands[label]
            rows.append(Row(
                f"rq worker ({kind})", label, "jobs/s", samples[label],
                baseline=None if label == baseline else baseline, ratios=ratios.get(label),
                commands=cmds, round_trips=_guard_round_trips(cmds),
                note=f"{total:,} jobs per run" + ("" if label == baseline else f"; {where}"),
            ))
        Queue(name, connection=client).empty()
    return rows
