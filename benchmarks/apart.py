"""The locks apart from the broker as users meet it: a RabbitMQ broker, the locks in Valkey.

plain ``apply_async``, taskdedup, celery-once and celery-singleton publish to a RabbitMQ
started for the run (``rabbitmq-server`` from the system's package, on free loopback ports,
its files in a temporary directory), each library's locks in the benchmark's Valkey; the
variants run interleaved and each ratio is taken within its run. Every gated publish pays one
round trip to Valkey on top of the AMQP publish (which waits for no reply): what differs is
how much of it each library hides and its Python overhead. Skipped, with a note, where
RabbitMQ is not installed.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from celery import Celery
from kombu import Connection

from taskdedup.celery import DedupTask
from taskdedup.testing import free_port

from . import apps
from .harness import Row, purge
from .micro import Context
from .realistic import publish_rows

__all__ = ["SECTION", "RabbitMQ", "apart_publish", "find_rabbitmq"]

SECTION = "celery publish (RabbitMQ broker, locks in Valkey)"
PLAIN = "plain Celery apply_async"
GATED = "taskdedup DedupTask"
QUEUE = "bench-apart"
_LOCKS = {
    PLAIN: (),
    GATED: ("taskdedup:bench.apart.*",),
    "celery-once QueueOnce": ("qo_bench.apart.*",),
    "celery-singleton Singleton": ("SINGLETONLOCK_bench.apart.*",),
}
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


def _charge(user_id: int, amount_cents: int, currency: str, order_id: str, run: str) -> None:
    """Never runs: no worker consumes the queue."""


def _app(broker: str, locks: str) -> tuple[Celery, dict[str, Any]]:
    """One app on RabbitMQ with the four tasks, every library's locks in ``locks``."""
    app = Celery("bench-apart", set_as_current=False)
    app.conf.update(
        broker_url=broker, taskdedup_url=locks, singleton_backend_url=locks,
        ONCE={"backend": "celery_once.backends.Redis",
              "settings": {"url": locks, "default_timeout": 600}},
        singleton_lock_expiry=600, task_ignore_result=True, task_default_queue=QUEUE,
        broker_connection_retry_on_startup=True,
    )
    tasks: dict[str, Any] = {
        PLAIN: app.task(name="bench.apart.plain", shared=False)(_charge),
        GATED: app.task(name="bench.apart.dedup", base=DedupTask, dedup=apps.POLICY,
                        shared=False)(_charge),
    }
    if apps.HAVE_ONCE:
        tasks["celery-once QueueOnce"] = app.task(
            name="bench.apart.once", base=apps.QueueOnce, shared=False,
            once={"graceful": True, "timeout": 600})(_charge)
    if apps.HAVE_SINGLETON:
        tasks["celery-singleton Singleton"] = app.task(
            name="bench.apart.singleton", base=apps.Singleton, shared=False)(_charge)
    return app, tasks


@contextlib.contextmanager
def _broker(ctx: Context) -> Iterator[str | None]:
    """A RabbitMQ URL (``TASKDEDUP_BENCH_AMQP`` or a node started here), or None."""
    given = os.environ.get("TASKDEDUP_BENCH_AMQP")
    if given:
        yield given
        return
    binary = find_rabbitmq()
    if binary is None:
        yield None
        return
    with RabbitMQ(binary) as node:
        yield node.url


def apart_publish(ctx: Context) -> list[Row]:
    """Publish throughput (distinct arguments) on RabbitMQ with the locks in Valkey."""
    with _broker(ctx) as url:
        if url is None:
            ctx.log(f"  {SECTION}: skipped, RabbitMQ is not installed (rabbitmq-server not "
                    "found; apt-get install rabbitmq-server, or TASKDEDUP_BENCH_AMQP=amqp://...)")
            return [Row(SECTION, PLAIN, "publishes/s", [], note="skipped: RabbitMQ is not "
                        "installed")]
        return _measure(ctx, url)


def _measure(ctx: Context, url: str) -> list[Row]:
    client = ctx.client
    app, tasks = _app(url, ctx.url)
    rows: list[Row] = []
    try:
        with app.connection_for_write() as conn:
            channel = conn.default_channel

            def purge_queue() -> None:
                with contextlib.suppress(Exception):
                    channel.queue_purge(QUEUE)

            def queued() -> int:
                time.sleep(0.2)  # AMQP publishes are not confirmed: let the broker catch up
                return int(channel.queue_declare(QUEUE, passive=True).message_count)

            def reset(label: str) -> None:
                purge_queue()
                purge(client, *_LOCKS[label])

            rows = publish_rows(ctx, SECTION, tasks, reset, queued,
                                extra={"broker": "RabbitMQ"})
            with contextlib.suppress(Exception):
                channel.queue_delete(QUEUE)
    finally:
        app.close()
    return rows
