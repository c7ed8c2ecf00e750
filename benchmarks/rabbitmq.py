"""A throwaway RabbitMQ node on loopback, for the benchmark's RabbitMQ rows and the tests that
run Celery workers on a RabbitMQ broker (Debian's ``rabbitmq-server``; they skip without it)."""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from pathlib import Path

from kombu import Connection

from taskdedup.testing import free_port

__all__ = ["RabbitMQ", "find_rabbitmq"]

# The server script itself first: Debian's /usr/sbin/rabbitmq-server switches to the rabbitmq
# user (dropping the environment this node is configured with).
_CANDIDATES = ("/usr/lib/rabbitmq/bin/rabbitmq-server", "/opt/homebrew/sbin/rabbitmq-server",
               "/usr/local/sbin/rabbitmq-server", "rabbitmq-server")


def find_rabbitmq() -> str | None:
    """The ``rabbitmq-server`` script, or None when RabbitMQ is not installed."""
    for candidate in _CANDIDATES:
        found = shutil.which(candidate)
        if found:
            return found
    return None


class RabbitMQ:
    """A throwaway RabbitMQ node on loopback (AMQP, distribution and epmd on free ports), its
    data, logs and Erlang cookie in a temporary directory; ``guest``/``guest`` (loopback)."""

    def __init__(self, binary: str) -> None:
        self.binary = binary
        self.port = free_port()
        self.dir = Path(tempfile.mkdtemp(prefix="taskdedup-rabbitmq-"))
        self.epmd_port = free_port()
        self.process: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"amqp://guest:guest@127.0.0.1:{self.port}//"

    def start(self, timeout: float = 90.0) -> RabbitMQ:
        """Start the node and wait until it takes an AMQP connection."""
        (self.dir / "enabled_plugins").write_text("[].\n")
        env = {
            **os.environ,
            "HOME": str(self.dir),  # the Erlang cookie
            "RABBITMQ_NODENAME": f"bench{self.port}@localhost",
            "RABBITMQ_NODE_IP_ADDRESS": "127.0.0.1",
            "RABBITMQ_NODE_PORT": str(self.port),
            "RABBITMQ_DIST_PORT": str(free_port()),
            "ERL_EPMD_PORT": str(self.epmd_port),
            "RABBITMQ_MNESIA_BASE": str(self.dir / "mnesia"),
            "RABBITMQ_LOG_BASE": str(self.dir / "log"),
            "RABBITMQ_LOGS": str(self.dir / "rabbit.log"),
            "RABBITMQ_ENABLED_PLUGINS_FILE": str(self.dir / "enabled_plugins"),
            "RABBITMQ_CONFIG_FILE": str(self.dir / "rabbitmq"),
            "RABBITMQ_PID_FILE": str(self.dir / "rabbit.pid"),
        }
        self.process = subprocess.Popen(
            [self.binary], env=env, cwd=self.dir, stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"rabbitmq-server exited with {self.process.returncode} "
                                   f"(logs in {self.dir})")
            with contextlib.suppress(OSError):
                socket.create_connection(("127.0.0.1", self.port), timeout=1).close()
                with Connection(self.url, connect_timeout=5) as conn:
                    conn.connect()
                return self
            time.sleep(0.5)
        self.stop()
        raise RuntimeError(f"RabbitMQ did not accept connections within {timeout:.0f}s "
                           f"(logs in {self.dir})")

    def stop(self) -> None:
        """Stop the node (its process group) and the epmd it started (found by its port)."""
        if self.process is not None and self.process.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.process.pid, signal.SIGTERM)
            try:
                self.process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(self.process.pid, signal.SIGKILL)
                self.process.wait(timeout=10)
        for pid in _epmd_of(self.epmd_port):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGTERM)
        shutil.rmtree(self.dir, ignore_errors=True)

    def __enter__(self) -> RabbitMQ:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def _epmd_of(port: int) -> list[int]:
    """The epmd daemons started with ``ERL_EPMD_PORT=port`` (ours: the port is our own)."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            if not (entry / "cmdline").read_bytes().split(b"\0")[0].endswith(b"epmd"):
                continue
            environ = (entry / "environ").read_bytes().split(b"\0")
        except OSError:
            continue
        if f"ERL_EPMD_PORT={port}".encode() in environ:
            found.append(int(entry.name))
    return found
