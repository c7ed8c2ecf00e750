"""Logging: quiet by default, counted duplicates at DEBUG, what needs action still seen.

A library logs and the application decides where it goes: the ``taskdedup`` logger has a
``NullHandler``. ``rq worker`` configures no root logger, so ``DedupWorker`` sends our records
to the worker's own output, at the worker's level. Stats that Redis cannot take when a
process exits are reported once, and only when counts are really lost.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
import uuid

import redis

from taskdedup import Policy
from taskdedup.rq import DedupQueue, skipped_info
from taskdedup.testing import free_port, wait_for
from tests import rq_jobs
from tests.workers import RqWorker

LOST = "stats counts lost as this process exits"


def _python(code: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True,
                          text=True, timeout=timeout)


def test_an_app_that_configured_no_logging_gets_no_output_from_taskdedup() -> None:
    done = _python("""
        import logging, taskdedup
        logging.getLogger("taskdedup").warning("taskdedup: a warning nobody asked to see")
    """)
    assert done.returncode == 0, done.stderr
    assert done.stderr == "" and done.stdout == ""


# -- the exit-time flush of the stats ----------------------------------------------------------

EXIT_SCRIPT = """
    import logging, sys
    import redis
    from taskdedup import Deduplicator, MemoryStore, Policy, stats
    from taskdedup.testing import wait_for

    logging.basicConfig(level=logging.WARNING, stream=sys.stderr, format="%(message)s")
    url, calls, interval = sys.argv[1], int(sys.argv[2]), float(sys.argv[3])
    client = redis.Redis.from_url(url, socket_connect_timeout=1, socket_timeout=1)
    dedup = Deduplicator(MemoryStore())  # stats go to `client`, locks stay in memory
    recorder = stats.attach(dedup, client=client, interval=interval)
    policy = Policy(ttl=60)
    for n in range(calls):
        dedup.gate("app.exiting", policy, dedup.identity("app.exiting", policy, (n,)), f"t{n}")
    if interval < 1:  # let the flush thread fail (and warn) before the exit
        wait_for(lambda: recorder._failing_since is not None, timeout=10, what="a failed flush")
"""


def _exit_with_stats(url: str, calls: int, interval: float = 3600) -> str:
    done = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(EXIT_SCRIPT), url, str(calls), str(interval)],
        capture_output=True, text=True, timeout=60,
    )
    assert done.returncode == 0, done.stderr
    return done.stderr


def test_counts_lost_at_exit_are_reported_once_and_say_they_are_lost() -> None:
    dead = f"redis://127.0.0.1:{free_port()}/0"
    stderr = _exit_with_stats(dead, calls=3)
    lines = [line for line in stderr.splitlines() if LOST in line]
    assert len(lines) == 1, stderr
    assert "keeping" not in stderr  # nothing is kept: the process is gone


def test_a_flush_thread_that_already_warned_still_reports_the_loss_at_exit() -> None:
    """The periodic warning is throttled to one a minute; the exit line is not throttled away
    (before, counts lost within that minute went without a word)."""
    dead = f"redis://127.0.0.1:{free_port()}/0"
    stderr = _exit_with_stats(dead, calls=3, interval=0.05)
    assert "could not flush stats" in stderr
    assert sum(LOST in line for line in stderr.splitlines()) == 1, stderr


def test_no_exit_line_when_nothing_is_lost(redis_url: str, redis_client: redis.Redis) -> None:
    dead = f"redis://127.0.0.1:{free_port()}/0"
    assert _exit_with_stats(dead, calls=0) == ""  # Redis down, but nothing pending
    assert _exit_with_stats(redis_url, calls=3) == ""  # written at exit
    assert int(redis_client.hget("taskdedup:stats:app.exiting", "reserved") or 0) >= 3


# -- rq worker -----------------------------------------------------------------------------------


def _skipped_job(rc: redis.Redis, queue: str) -> tuple[DedupQueue, str]:
    """A job that the worker will skip: another owner runs its identity."""
    q = DedupQueue(queue, connection=rc, dedup=Policy(mode="while_executing", ttl=60))
    name = uuid.uuid4().hex[:12]
    key = q.dedup.identity("tests.rq_jobs.record", Policy(), (name,), {},
                           func=rq_jobs.record).key
    rc.set(key, "R||someone-else", px=60_000)
    job = q.enqueue(rq_jobs.record, name)
    assert job is not None
    return q, job.id


def _skipped(q: DedupQueue, job_id: str) -> bool:
    job = q.fetch_job(job_id)
    return job is not None and skipped_info(job) is not None


def test_rq_worker_output_says_skipped_at_info_and_the_detail_at_debug(
    redis_url: str, redis_client: redis.Redis
) -> None:
    verbose, quiet = f"log-debug-{uuid.uuid4().hex[:8]}", f"log-info-{uuid.uuid4().hex[:8]}"
    started: list[RqWorker] = []
    try:
        for queue, args in ((verbose, ["--logging_level", "DEBUG"]), (quiet, [])):
            q, job_id = _skipped_job(redis_client, queue)
            worker = RqWorker(redis_url, [queue], scheduler=False, args=args).start()
            started.append(worker)
            wait_for(lambda q=q, job_id=job_id: _skipped(q, job_id), timeout=30,
                     what=f"job {job_id} skipped")
            q.empty()
        # the worker prints its line after it saved the job's result: wait for the line
        for worker in started:
            wait_for(lambda w=worker: "Skipped (not run)" in w.output(), timeout=15,
                     what="the worker's line for the skipped job")
        debug, info = (w.output() for w in started)
        assert "skipped tests.rq_jobs.record[" in debug and "someone-else" in debug
        assert "skipped tests.rq_jobs.record[" not in info  # the detail line: DEBUG only
        assert "Skipped (not run)" in info and "Successfully completed" not in info
    finally:
        for worker in started:
            worker.stop()
