"""Real worker subprocesses for integration tests (Celery and RQ)."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import tempfile
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, Self

import redis

from taskdedup.testing import wait_for

ROOT = Path(__file__).resolve().parent.parent


class WorkerProcess:
    """A worker command in its own process group, with its output in a log file.

    Subclasses give :meth:`command` and :meth:`ready`; this class starts, waits, stops
    (SIGTERM: warm shutdown) and kills (SIGKILL of the whole group).
    """

    kind = "worker"
    stop_timeout = 20.0

    def __init__(self, redis_url: str, env: dict[str, str] | None = None) -> None:
        self.redis_url = redis_url
        self.extra_env = dict(env or {})
        self.log = Path(tempfile.mkstemp(prefix=f"{self.kind}-", suffix=".log")[1])
        self.process: subprocess.Popen[bytes] | None = None
        self.log_start = 0  # where this start's output begins (a restart appends)

    def command(self) -> list[str]:
        raise NotImplementedError

    def environment(self) -> dict[str, str]:
        # PYTHONFAULTHANDLER: a worker that does not stop is sent SIGABRT (stop), and then
        # prints every thread's stack into its log
        return {"TASKDEDUP_TEST_REDIS_URL": self.redis_url, "PYTHONPATH": str(ROOT),
                "PYTHONFAULTHANDLER": "1"}

    def ready(self) -> bool:
        raise NotImplementedError

    def start(self, timeout: float = 60.0) -> Self:
        env = {**os.environ, **self.environment(), **self.extra_env}
        self.log_start = self.log.stat().st_size
        with open(self.log, "ab") as out:
            self.process = subprocess.Popen(
                self.command(), cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL, start_new_session=True,
            )
        wait_for(self._started, timeout=timeout, what=f"{self.kind} ready")
        return self

    def _started(self) -> bool:
        assert self.process is not None
        if self.process.poll() is not None:
            raise RuntimeError(f"{self.kind} exited early:\n{self.output()[-4000:]}")
        return self.ready()

    def output(self) -> str:
        return self.log.read_text(errors="replace")

    def kill(self) -> None:
        """SIGKILL the whole process group at once."""
        if self.process is not None and self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait(timeout=10)

    def running(self) -> Iterator[Self]:
        """Start, yield, stop: a fixture's body (``yield from worker.running()``)."""
        self.start()
        try:
            yield self
        finally:
            self.stop()

    def stop(self) -> None:
        """Warm shutdown (SIGTERM): the worker finishes its current task, then exits."""
        if self.process is None or self.process.poll() is not None:
            return
        os.killpg(self.process.pid, signal.SIGTERM)
        try:
            self.process.wait(timeout=self.stop_timeout)
        except subprocess.TimeoutExpired:
            self._stuck()

    def _stuck(self) -> None:
        """A warm shutdown that did not end: say where the worker was (its threads' stacks,
        printed by faulthandler on SIGABRT) on this test's stderr, then kill the group."""
        assert self.process is not None
        with contextlib.suppress(ProcessLookupError):  # the group: a prefork pool's children too
            os.killpg(self.process.pid, signal.SIGABRT)
        try:
            self.process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            pass
        with contextlib.suppress(ProcessLookupError):  # the rest of its group too
            os.killpg(self.process.pid, signal.SIGKILL)
        self.process.wait(timeout=10)
        print(f"\n{self.kind} did not stop within {self.stop_timeout:.0f}s of SIGTERM; the end "
              f"of its log:\n{self.output()[-8000:]}", file=sys.stderr)


WARM_STOP_TIMEOUT = 45.0
"""Seconds a prefork worker's warm shutdown may take: Celery 5.3-5.6 drop the pool's record
of a task whose result is in flight when the pool closes, so its result is never read, and
billiard's pool process waits 30 s for it to be read before it exits (Celery 5.7 reads it)."""


class CeleryWorker(WorkerProcess):
    """``celery -A tests.celery_app worker`` (prefork) in its own process group.

    :meth:`kill` SIGKILLs the main process and the pool children at once.
    """

    kind = "celery-worker"
    app_module = "tests.celery_app"

    def __init__(
        self, redis_url: str, *, queue: str = "celery", concurrency: int = 2,
        pool: str = "prefork", env: dict[str, str] | None = None,
    ) -> None:
        super().__init__(redis_url, env)
        self.queue = queue
        self.concurrency = concurrency
        self.pool = pool

    def command(self) -> list[str]:
        return [
            sys.executable, "-m", "celery", "-A", self.app_module, "worker",
            "-P", self.pool, "-c", str(self.concurrency), "-Q", self.queue,
            "-n", f"{self.node}@%h",
            "--without-gossip", "--without-mingle", "--without-heartbeat", "-l", "INFO",
        ]

    @property
    def node(self) -> str:
        """The node name's part before ``@`` (``request.hostname`` starts with it)."""
        return f"{self.queue}-{os.getpid()}-{id(self)}"

    def environment(self) -> dict[str, str]:
        return {**super().environment(), "TASKDEDUP_TEST_QUEUE": self.queue}

    def ready(self) -> bool:
        return " ready." in self.output()[self.log_start:]

    def warm_stop(self) -> None:
        """Celery's warm shutdown as an operator asks for it: SIGTERM to the main process only
        (:meth:`stop` signals the whole group, which kills prefork pool processes mid-task);
        one that does not end within :data:`WARM_STOP_TIMEOUT` has its stacks and log
        printed, and the test fails."""
        assert self.process is not None
        if self.process.poll() is None:
            os.kill(self.process.pid, signal.SIGTERM)
            try:
                self.process.wait(timeout=max(self.stop_timeout, WARM_STOP_TIMEOUT))
            except subprocess.TimeoutExpired:
                self._stuck()  # its stacks and log on stderr, its group killed
                raise


class RqWorker(WorkerProcess):
    """``rq worker`` (``taskdedup.rq.DedupWorker`` with ``DedupJob``) in its own process group.

    Ready when the worker has registered in Redis and is idle (and, with ``scheduler``, holds
    the scheduler lock of its first queue). The work-horse calls ``setpgrp``, so :meth:`kill`
    does not reach a running horse: a test that needs it dead kills its pid too.
    """

    kind = "rq-worker"
    stop_timeout = 30.0

    def __init__(
        self, redis_url: str, queues: list[str], *, scheduler: bool = True,
        worker_class: str = "taskdedup.rq.DedupWorker", env: dict[str, str] | None = None,
        args: list[str] | None = None,
    ) -> None:
        super().__init__(redis_url, env)
        self.queues = list(queues)
        self.args = list(args or [])  # more `rq worker` options, e.g. --logging_level DEBUG
        self.scheduler = scheduler
        self.worker_class = worker_class
        # Unique for good: id(self) can come back for a new worker while RQ still lists a
        # SIGKILLed one of that name as active, and RQ then refuses to start it.
        self.name = f"rqw-{os.getpid()}-{uuid.uuid4().hex[:12]}"
        self._client: redis.Redis | None = None
        self._own_lock: bytes | None = None  # the scheduler lock's value it took

    def command(self) -> list[str]:
        return [
            sys.executable, "-m", "rq.cli", "worker", "-w", self.worker_class,
            "--job-class", "taskdedup.rq.DedupJob", "--url", self.redis_url, "-n", self.name,
            *(["--with-scheduler"] if self.scheduler else []), *self.args, *self.queues,
        ]

    def ready(self) -> bool:
        client = self.client()
        if client.hget(f"rq:worker:{self.name}", "state") != b"idle":
            return False
        return not self.scheduler or bool(client.exists(self.scheduler_lock()))

    def client(self) -> redis.Redis:
        if self._client is None:
            self._client = redis.Redis.from_url(self.redis_url)
        return self._client

    def scheduler_lock(self) -> str:
        return f"rq:scheduler-lock:{self.queues[0]}"

    def start(self, timeout: float = 60.0) -> Self:
        before = self.client().get(self.scheduler_lock()) if self.scheduler else None
        super().start(timeout)
        held = self.client().get(self.scheduler_lock()) if self.scheduler else None
        # the lock appeared while this worker started: it took it (SET NX), so it is its own
        self._own_lock = held if before is None else None
        return self

    def stop(self) -> None:
        """Warm shutdown, and the scheduler lock this worker took is gone after it.

        RQ forks its scheduler and the child sets its SIGTERM handler a moment later: a warm
        stop that lands in between kills the child before it releases the lock, which then
        outlives the worker by a minute (``interval + 60`` s; 1 in 8 quick stops here), and a
        worker started meanwhile schedules nothing for two minutes. So the lock this worker
        took, if still there once it stopped, is deleted (only that one: compared first)."""
        super().stop()
        own, self._own_lock = self._own_lock, None
        if own is not None and self.client().get(self.scheduler_lock()) == own:
            self.client().delete(self.scheduler_lock())


def stored_result(app: Any, task_id: str, worker: WorkerProcess, timeout: float = 30.0,
                  about: Callable[[], str] | None = None) -> Any:
    """The result a worker stored for ``task_id``, read with ``GET`` until it is ready (not
    through the backend's pub/sub); raises it when it is a failure. When none comes by the
    deadline, the AssertionError names the state stored, ``about()`` (what the test knows of
    the call) and the end of the worker's log: a lost call, a hung one or a missed
    notification tell themselves apart."""
    seen: dict[str, Any] = {}

    def ready() -> bool:
        seen.update(app.backend.get_task_meta(task_id, cache=False))
        return seen.get("status") in ("SUCCESS", "FAILURE", "REVOKED")

    try:
        wait_for(ready, timeout=timeout, interval=0.1, what=f"the result of {task_id}")
    except TimeoutError as exc:
        raise AssertionError(
            f"no result for {task_id}: stored {seen.get('status')!r}"
            f"{', ' + about() if about is not None else ''}; worker log:\n"
            f"{worker.output()[-6000:]}") from exc
    if seen["status"] != "SUCCESS":
        result = seen.get("result")
        raise result if isinstance(result, BaseException) else AssertionError(seen)
    return seen.get("result")


def staging(redis_url: str, stage: str) -> Iterator[redis.Redis]:
    """A client for a test that publishes to ``stage`` (a queue no worker reads) and then
    moves it to a worker's queue: the stage is empty before and after (a fixture's body:
    ``yield from staging(redis_url, STAGE)``)."""
    client = redis.Redis.from_url(redis_url)
    client.delete(stage)
    yield client
    client.delete(stage)


def celery_test_app(redis_url: str, queue: str) -> Any:
    """``tests.celery_app`` in the test process, pointed at the test server and at a worker's
    queue (:func:`tests.celery_app.configure`)."""
    from tests import celery_app

    celery_app.configure(redis_url, queue)
    return celery_app
