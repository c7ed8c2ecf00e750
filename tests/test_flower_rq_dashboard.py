"""A skipped duplicate where operators already look (SPEC §13): a real ``rq worker``'s INFO
output, rq-dashboard 0.9 and Flower, each a real server on 127.0.0.1 and a free port, read by
Debian's headless chromium (as tests/test_web_browser.py does).

* RQ's worker says ``Skipped (not run) [SKIPPED duplicate of <id> (<state>)] <description>``
  at INFO, never ``Successfully completed``; the job's description leads with the mark, so
  rq-dashboard's job list shows it, and its job page shows the result's ``SKIPPED`` key first.
* A Celery worker started with ``-E`` sends ``task-succeeded`` with the result's repr, which
  leads with ``{'SKIPPED': 'duplicate of <id> (done)'``: Flower's task page shows that, its
  task list too once the ``result`` column is on (``--tasks_columns``: Flower 2.2 lists no
  result by default), and Flower's search finds the skipped rows by ``SKIPPED`` or
  ``result:SKIPPED``.

Flower and rq-dashboard are in the ``test`` dependency group; without them (or without
chromium, which the shared `chromium` fixture installs with apt-get when we are root) the
module is skipped, except on CI, where that is an error.
"""

from __future__ import annotations

import html
import importlib.util
import json
import os
import subprocess
import sys
import urllib.parse
import urllib.request
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
import redis

from taskdedup import Policy
from taskdedup.rq import DedupQueue
from taskdedup.testing import free_port, wait_for
from tests import rq_jobs
from tests.workers import ROOT, CeleryWorker, RqWorker

_MISSING = [name for name in ("flower", "rq_dashboard") if importlib.util.find_spec(name) is None]
if _MISSING:
    _WHY = f"not installed: {', '.join(_MISSING)} (flower and rq-dashboard: the 'test' group)"
    if os.environ.get("CI"):  # as for a missing Redis binary: on CI an error, not a skip
        pytest.fail(_WHY, pytrace=False)
    pytest.skip(_WHY, allow_module_level=True)

pytestmark = pytest.mark.slow


def browse(chromium: str, tmp_path: Path, url: str) -> str:
    """The DOM headless chromium ends with on ``url`` (after its scripts ran)."""
    profile = tmp_path / f"profile-{uuid.uuid4().hex[:8]}"
    done = subprocess.run(
        [chromium, "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic",
         "--no-first-run", "--disable-background-networking", "--disable-component-update",
         "--disable-sync", f"--user-data-dir={profile}", "--virtual-time-budget=5000",
         "--dump-dom", url],
        capture_output=True, text=True, timeout=120,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    return html.unescape(done.stdout)


def get(url: str) -> str:
    with urllib.request.urlopen(url, timeout=10) as response:
        return str(response.read().decode())


@contextmanager
def server(args: list[str], url: str, log: Path, env: dict[str, str] | None = None
           ) -> Iterator[str]:
    """A web UI in its own process group: yields its base URL once it answers."""
    with open(log, "wb") as out:
        process = subprocess.Popen(args, stdout=out, stderr=subprocess.STDOUT, cwd=ROOT,
                                   env={**os.environ, "PYTHONPATH": str(ROOT), **(env or {})},
                                   start_new_session=True)

    def up() -> bool:
        if process.poll() is not None:
            raise RuntimeError(f"{args[:3]} exited:\n{log.read_text()[-3000:]}")
        try:
            get(url)
        except OSError:
            return False
        return True

    try:
        wait_for(up, timeout=60, what=f"{url} answers")
        yield url
    finally:
        process.terminate()
        try:
            process.wait(timeout=15)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(timeout=10)


# -- RQ: the worker's output and rq-dashboard ----------------------------------------------


@pytest.fixture(scope="module")
def rq_skipped(redis_url: str) -> Iterator[tuple[RqWorker, Any, str]]:
    """A job a real ``rq worker`` (INFO, its default) skipped: another id runs its identity."""
    rc = redis.Redis.from_url(redis_url)
    queue_name = f"ui-rq-{uuid.uuid4().hex[:8]}"
    policy = Policy(mode="while_executing")
    q = DedupQueue(queue_name, connection=rc, dedup=policy)
    worker = RqWorker(redis_url, [queue_name], scheduler=False).start()
    label = uuid.uuid4().hex[:12]
    name = f"{rq_jobs.record.__module__}.{rq_jobs.record.__qualname__}"
    key = q.dedup.identity(name, policy, (label,), {}, func=rq_jobs.record).key
    rc.set(key, "R||someone-else", px=60_000)  # another worker runs this identity now
    try:
        job = q.enqueue(rq_jobs.record, label)
        assert job is not None
        wait_for(lambda: job.get_status(refresh=True) == "finished", timeout=30,
                 what="skipped job finished")
        # RQ writes the job's last line after the job's status: wait for it
        wait_for(lambda: any(end in worker.output() for end in ("Skipped", "Successfully")),
                 timeout=10, what="the worker's line for the job")
        yield worker, job, queue_name
    finally:
        rc.delete(key)
        worker.stop()


def test_rq_worker_says_skipped_at_info_not_successfully_completed(
    rq_skipped: tuple[RqWorker, Any, str], rc: redis.Redis
) -> None:
    worker, job, _ = rq_skipped
    lines = [line for line in worker.output().splitlines()
             if "tests.rq_jobs.record" in line or job.id in line]
    done = [line for line in lines if "job in" in line or "Skipped" in line]
    assert done, worker.output()[-3000:]
    assert all("Successfully completed" not in line for line in lines), lines
    assert any("Skipped (not run) [SKIPPED duplicate of someone-else (running)] "
               "tests.rq_jobs.record(" in line for line in done), done
    assert job.return_value()["SKIPPED"] == "duplicate of someone-else (running)"


def test_rq_dashboard_lists_the_skipped_job_as_skipped(
    rq_skipped: tuple[RqWorker, Any, str], redis_url: str, tmp_path: Path, chromium: str
) -> None:
    _, job, queue_name = rq_skipped
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    args = [sys.executable, "-c", "from rq_dashboard.cli import main; main()",
            "--redis-url", redis_url, "--bind", "127.0.0.1", "--port", str(port)]
    with server(args, base + "/", tmp_path / "rq-dashboard.log"):
        listing = browse(chromium, tmp_path, f"{base}/0/view/jobs/{queue_name}/finished/8/asc/1")
        assert job.id in listing
        assert "[SKIPPED duplicate of someone-else (running)] tests.rq_jobs.record(" in listing
        page = browse(chromium, tmp_path, f"{base}/0/view/job/{job.id}")
        result = page[page.index("Result"):]
        # Flask sorts the keys: the uppercase SKIPPED comes first
        assert result.index('"SKIPPED": "duplicate of someone-else (running)"') < result.index(
            '"existing_id"')


# -- Celery: Flower, from the worker's events ------------------------------------------------


COLUMNS = "name,uuid,state,result,received,runtime,worker"


class EventsWorker(CeleryWorker):
    """The observe app's worker with task events (``-E``), as Flower needs."""

    app_module = "tests.observe_app"

    def command(self) -> list[str]:
        return [*super().command(), "-E"]


def test_flower_shows_a_skipped_duplicate_as_skipped(
    redis_url: str, tmp_path: Path, chromium: str
) -> None:
    from tests import observe_app

    queue = f"ui-flower-{uuid.uuid4().hex[:8]}"
    observe_app.configure(redis_url, queue)
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    # Flower 2.2's task list shows no result column unless asked (--tasks_columns): the
    # setting docs/how-to/operating.md gives; the task page and the search need nothing
    args = [sys.executable, "-m", "celery", "-A", "tests.observe_app", "flower",
            "--address=127.0.0.1", f"--port={port}", f"--tasks_columns={COLUMNS}"]
    env = {"TASKDEDUP_TEST_REDIS_URL": redis_url, "FLOWER_UNAUTHENTICATED_API": "true"}
    worker = EventsWorker(redis_url, queue=queue, concurrency=1)
    with server(args, base + "/healthcheck", tmp_path / "flower.log", env):
        worker.start()
        try:
            task = observe_app.send_welcome_email
            label = uuid.uuid4().hex[:12]

            def seen(task_id: str) -> dict[str, Any] | None:
                tasks = json.loads(get(f"{base}/api/tasks"))
                info = tasks.get(task_id)
                return info if info and info.get("state") == "SUCCESS" else None

            # Flower's event receiver connects on its own time: the first run, when it shows
            # in Flower, says Flower listens (a run sent before that would be missed)
            def first_seen() -> str | None:
                first = task.delay(1, label)
                first.get(timeout=30)
                try:
                    wait_for(lambda: seen(first.id), timeout=3)
                except TimeoutError:
                    return None
                return str(first.id)

            first_id = wait_for(first_seen, timeout=60, what="Flower receives events")
            skipped = observe_app.app.send_task(task.name, (1, label), queue=queue)
            assert skipped.get(timeout=30)["existing_id"] == first_id
            info = wait_for(lambda: seen(skipped.id), timeout=30, what="Flower has the skip")
            assert str(info["result"]).startswith(f"{{'SKIPPED': 'duplicate of {first_id}")

            # the task list, as an operator's browser renders it
            listing = browse(chromium, tmp_path, f"{base}/tasks")
            row = listing[listing.index(skipped.id):]
            row = row[:row.index("</tr>")]
            assert f"{{'SKIPPED': 'duplicate of {first_id} (done)'" in row
            assert "SUCCESS" in row
            first_row = listing[listing.index(first_id):]
            assert "SKIPPED" not in first_row[:first_row.index("</tr>")]

            # the task's own page
            page = browse(chromium, tmp_path, f"{base}/task/{skipped.id}")
            assert f"{{'SKIPPED': 'duplicate of {first_id} (done)'" in page

            # the documented search terms find the skipped rows only
            for term in ("SKIPPED", "result:SKIPPED"):
                query = urllib.parse.urlencode({
                    "draw": 1, "start": 0, "length": 50, "search[value]": term,
                    "order[0][column]": 0, "columns[0][data]": "name", "order[0][dir]": "asc",
                })
                found = json.loads(get(f"{base}/tasks/datatable?{query}"))
                ids = {row["uuid"] for row in found["data"]}
                assert skipped.id in ids and first_id not in ids, (term, found)
        finally:
            worker.stop()
    assert "SKIPPED" in worker.output()  # Celery's own INFO line carries the result

