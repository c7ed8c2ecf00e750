"""Check the built wheel and sdist: every file the package needs is inside, nothing else is.

    python tools/check_wheel.py dist/taskdedup-0.1.0-py3-none-any.whl dist/taskdedup-0.1.0.tar.gz

Needed in both: every file git tracks under ``taskdedup/`` (the modules, the Lua scripts, the
Django migrations, ``py.typed``) except notes (``*.md``). Refused in both: tests, caches,
compiled files.
Run by ``nox -s package``; exits 1 with the list of what is wrong.
"""

from __future__ import annotations

import subprocess
import sys
import tarfile
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _names(archive: Path) -> set[str]:
    """The paths inside a wheel, or inside an sdist without its top directory."""
    if archive.suffix == ".whl":
        return set(zipfile.ZipFile(archive).namelist())
    with tarfile.open(archive) as tar:
        return {name.split("/", 1)[1] for name in tar.getnames() if "/" in name}


def problems(archive: Path) -> list[str]:
    """What is missing from ``archive`` or should not be in it."""
    names = _names(archive)
    tracked = subprocess.run(["git", "ls-files", "taskdedup"], cwd=ROOT, check=True,
                             capture_output=True, text=True).stdout.split()
    needed = {name for name in tracked if not name.endswith(".md")}
    found = [f"{archive.name}: missing {name}" for name in sorted(needed - names)]
    for name in sorted(names):
        if name.startswith("tests/") or "__pycache__" in name or name.endswith((".pyc", ".pyo")):
            found.append(f"{archive.name}: should not ship {name}")
    return found


def main(argv: list[str]) -> int:
    if not argv:
        print(__doc__, file=sys.stderr)
        return 2
    found = [line for archive in argv for line in problems(Path(archive))]
    for line in found:
        print(line, file=sys.stderr)
    if not found:
        print(f"{', '.join(Path(a).name for a in argv)}: every tracked package file inside, "
              "no tests or caches")
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
