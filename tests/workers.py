"""Real worker subprocesses for integration tests (Celery now; RQ later)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

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
