"""Real worker subprocesses for integration tests (Celery and RQ)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

import redis

from taskdedup.testing import wait_for

ROOT = Path(__file__).resolve().parent.parent


class CeleryWorker:
    """``celery -A tests.celery_app worker`` (prefork) in its own process group."""

    def __init__(
        self, redis_url: str, *, queue: str = "celery", concurrency: int = 2,
        pool: str = "prefork", env: dict[str, str] | None = None,
    ) -> None:
        self.redis_url = redis_url
        self.queue = queue
        self.concurrency = concurrency
        self.pool = pool
        self.extra_env = dict(env or {})
        self.log = Path(tempfile.mkstemp(prefix="celery-worker-", suffix=".log")[1])
        self.process: subprocess.Popen[bytes] | None = None

    def start(self, timeout: float = 60.0) -> CeleryWorker:
        env = {
            **os.environ,
            "TASKDEDUP_TEST_REDIS_URL": self.redis_url,
            "TASKDEDUP_TEST_QUEUE": self.queue,
            "PYTHONPATH": str(ROOT),
            **self.extra_env,
        }
        cmd = [
            sys.executable, "-m", "celery", "-A", "tests.celery_app", "worker",
            "-P", self.pool, "-c", str(self.concurrency), "-Q", self.queue,
            "-n", f"{self.queue}-{os.getpid()}-{id(self)}@%h",
            "--without-gossip", "--without-mingle", "--without-heartbeat", "-l", "INFO",
        ]
        with open(self.log, "ab") as out:
            self.process = subprocess.Popen(
                cmd, cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL, start_new_session=True,
            )
        wait_for(self._ready, timeout=timeout, what="celery worker ready")
        return self

    def _ready(self) -> bool:
        assert self.process is not None
        if self.process.poll() is not None:
            raise RuntimeError(f"celery worker exited early:\n{self.output()[-4000:]}")
        return " ready." in self.output()

    def output(self) -> str:
        return self.log.read_text(errors="replace")

    def kill(self) -> None:
        """SIGKILL the whole worker (main process and pool children) at once."""
        if self.process is not None and self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait(timeout=10)

    def stop(self) -> None:
        if self.process is None or self.process.poll() is not None:
            return
        os.killpg(self.process.pid, signal.SIGTERM)
        try:
            self.process.wait(timeout=20)
        except subprocess.TimeoutExpired:
            self.kill()


class RqWorker:
    """``rq worker`` (``taskdedup.rq.DedupWorker`` with ``DedupJob``) in its own process group.

    Ready when the worker has registered in Redis and is idle (and, with ``scheduler``, holds
    the scheduler lock of its first queue). The work-horse calls ``setpgrp``, so :meth:`kill`
    does not reach a running horse: a test that needs it dead kills its pid too.
    """

    def __init__(
        self, redis_url: str, queues: list[str], *, scheduler: bool = True,
        worker_class: str = "taskdedup.rq.DedupWorker", env: dict[str, str] | None = None,
    ) -> None:
        self.redis_url = redis_url
        self.queues = list(queues)
        self.scheduler = scheduler
        self.worker_class = worker_class
        self.extra_env = dict(env or {})
        self.name = f"rqw-{os.getpid()}-{id(self):x}"
        self.log = Path(tempfile.mkstemp(prefix="rq-worker-", suffix=".log")[1])
        self.process: subprocess.Popen[bytes] | None = None

    def start(self, timeout: float = 60.0) -> RqWorker:
        env = {
            **os.environ,
            "TASKDEDUP_TEST_REDIS_URL": self.redis_url,
            "PYTHONPATH": str(ROOT),
            **self.extra_env,
        }
        cmd = [
            sys.executable, "-m", "rq.cli", "worker", "-w", self.worker_class,
            "--job-class", "taskdedup.rq.DedupJob", "--url", self.redis_url, "-n", self.name,
            *(["--with-scheduler"] if self.scheduler else []), *self.queues,
        ]
        with open(self.log, "ab") as out:
            self.process = subprocess.Popen(
                cmd, cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL, start_new_session=True,
            )
        client = redis.Redis.from_url(self.redis_url)
        try:
            wait_for(lambda: self._ready(client), timeout=timeout, what="rq worker ready")
        finally:
            client.close()
        return self

    def _ready(self, client: redis.Redis) -> bool:
        assert self.process is not None
        if self.process.poll() is not None:
            raise RuntimeError(f"rq worker exited early:\n{self.output()[-4000:]}")
        state = client.hget(f"rq:worker:{self.name}", "state")
        if state != b"idle":
            return False
        lock = f"rq:scheduler-lock:{self.queues[0]}"
        return not self.scheduler or bool(client.exists(lock))

    def output(self) -> str:
        return self.log.read_text(errors="replace")

    def kill(self) -> None:
        """SIGKILL the worker's process group (main process and scheduler, not the horse)."""
        if self.process is not None and self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait(timeout=10)

    def stop(self) -> None:
        """Warm shutdown (SIGTERM): the worker finishes its current job, then exits."""
        if self.process is None or self.process.poll() is not None:
            return
        os.killpg(self.process.pid, signal.SIGTERM)
        try:
            self.process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.kill()
