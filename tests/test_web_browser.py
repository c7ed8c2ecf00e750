"""``taskdedup web`` in a real headless browser: Debian's chromium against the dashboard served
by a real uvicorn (the ``taskdedup web`` command in a subprocess) on 127.0.0.1 and a free port,
with locks and counters the test created in the session's Redis.

The browser's DOM lists the locks, the chart's SVG has a line, and a POST to ``/clear`` sent
by the browser is refused without ``--allow-clear`` and without the token (and accepted with
it). chromium is installed with apt-get when we are root (as CI is), else the module is skipped
with the reason. ``TASKDEDUP_WEB_SCREENSHOT=1`` also saves the screenshot as
docs/images/web.png.
"""

from __future__ import annotations

import html
import json
import os
import subprocess
import sys
import urllib.request
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
import redis

from taskdedup import Deduplicator, Policy, RedisStore, stats
from taskdedup.core import Verdict
from taskdedup.testing import free_port, wait_for

pytestmark = pytest.mark.timeout(900)  # the first test may apt-get install chromium

ROOT = Path(__file__).resolve().parent.parent
SCREENSHOT = ROOT / "docs" / "images" / "web.png"
POLICY = Policy(ttl=300)
TOKEN = "browser-test-token-0123456789"


@pytest.fixture
def browse(chromium: str, tmp_path: Path) -> Callable[..., str]:
    """Run headless chromium on ``url``: the DOM it ends with (or a screenshot)."""

    def run(url: str, *extra: str) -> str:
        profile = tmp_path / f"profile-{len(list(tmp_path.iterdir()))}"
        args = [
            chromium, "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic",
            "--no-first-run", "--disable-background-networking", "--disable-component-update",
            "--disable-sync", f"--user-data-dir={profile}", *extra, url,
        ]
        done = subprocess.run(args, capture_output=True, text=True, timeout=120)
        assert done.returncode == 0, done.stderr[-2000:]
        return done.stdout

    return run


def dump(browse: Callable[..., str], url: str) -> str:
    return browse(url, "--virtual-time-budget=5000", "--dump-dom")


def post_from_browser(browse: Callable[..., str], tmp_path: Path, action: str,
                      fields: dict[str, str]) -> str:
    """Have the browser submit a form to ``action`` (as a user's click would) and return the
    DOM of the answer."""
    inputs = "".join(f'<input name="{html.escape(k)}" value="{html.escape(v)}">'
                     for k, v in fields.items())
    page = tmp_path / f"post-{len(list(tmp_path.iterdir()))}.html"
    page.write_text(f'<!doctype html><form method="post" action="{html.escape(action)}">'
                    f"{inputs}</form><script>document.forms[0].submit()</script>")
    return dump(browse, page.as_uri())


def get_json(url: str) -> Any:
    with urllib.request.urlopen(url, timeout=5) as answer:
        return json.load(answer)


@contextmanager
def dashboard(redis_url: str, tmp_path: Path, *args: str) -> Iterator[tuple[str, Path]]:
    """``taskdedup web`` in a subprocess on a free port: its base URL and its log."""
    port = free_port()
    log = tmp_path / f"web-{port}.log"
    with log.open("w") as out:
        process = subprocess.Popen(
            [sys.executable, "-m", "taskdedup", "--url", redis_url, "web", "--port", str(port),
             "--sample-every", "0.2", *args],
            stdout=out, stderr=subprocess.STDOUT, cwd=ROOT,
        )
    base = f"http://127.0.0.1:{port}"

    def up() -> bool:
        if process.poll() is not None:
            raise AssertionError(f"taskdedup web exited: {log.read_text()[-2000:]}")
        try:
            get_json(base + "/api/series")
        except OSError:
            return False
        return True

    try:
        wait_for(up, timeout=30, what="taskdedup web to answer")
        yield base, log
    finally:
        process.terminate()
        try:
            process.wait(timeout=15)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(timeout=15)


def take(dedup: Deduplicator, task: str, arg: Any, owner: str) -> str:
    identity = dedup.identity(task, POLICY, (arg,))
    assert dedup.gate(task, POLICY, identity, owner).verdict is Verdict.ACCEPTED
    return identity.key


def duplicate(dedup: Deduplicator, task: str, arg: Any, owner: str) -> None:
    identity = dedup.identity(task, POLICY, (arg,))
    assert dedup.gate(task, POLICY, identity, owner).verdict is Verdict.DUPLICATE


def test_the_page_lists_the_locks_and_draws_the_chart_and_refuses_to_clear(
    browse: Callable[..., str], redis_client: redis.Redis, redis_url: str, tmp_path: Path,
) -> None:
    dedup = Deduplicator(RedisStore(redis_client))
    recorder = stats.StatsRecorder(redis_client, interval=3600)
    dedup.events.add(recorder)
    keys = [take(dedup, "payments.charge", f"ORD-{n}", f"charge-{n}") for n in range(4)]
    keys += [take(dedup, "mail.send_receipt", f"ORD-{n}", f"mail-{n}") for n in range(3)]
    dedup.store.claim(keys[0], "charge-0", 60_000)
    assert recorder.flush()
    with dashboard(redis_url, tmp_path) as (base, log):
        def rates(task: str) -> list[float]:
            series = get_json(base + "/api/series")["duplicate_rate"].get(task, [])
            return [point["rate"] for point in series if point["rate"] is not None]

        first = get_json(base + "/api/series")["samples"]
        wait_for(lambda: get_json(base + "/api/series")["samples"] > first, what="a sample")
        # Traffic in waves after the first sample: each wave is an interval's rate.
        for wave in range(3):
            for n in range(wave + 1):
                duplicate(dedup, "payments.charge", f"ORD-{n}", f"retry-{wave}-{n}")
            keys.append(take(dedup, "payments.charge", f"ORD-{10 + wave}", f"charge-{10 + wave}"))
            duplicate(dedup, "mail.send_receipt", "ORD-0", f"mail-retry-{wave}")
            assert recorder.flush()
            wait_for(lambda wave=wave: len(rates("payments.charge")) > wave, timeout=15,
                     what="the web process to sample the new counters")

        dom = dump(browse, base + "/")
        for key in keys:
            assert key in dom
        assert '<svg id="dup-rate-chart"' in dom
        chart = dom[dom.index('<svg id="dup-rate-chart"'):dom.index("</svg>")]
        assert 'data-task="payments.charge"' in chart  # a line, or points between gaps
        assert 'data-task="mail.send_receipt"' in chart
        assert "Locks by task and state (10)" in dom

        detail = dump(browse, base + "/lock?key=" + keys[0])
        for text in (keys[0], "payments.charge", "running", "charge-0", 'id="read-only"'):
            assert text in detail
        assert 'id="clear-form"' not in detail

        refused = post_from_browser(browse, tmp_path, base + "/clear",
                                    {"key": keys[1], "owner": "charge-1", "token": TOKEN})
        assert 'id="clear-result"' in refused and "read-only" in refused
        assert redis_client.exists(keys[1])

        shot = tmp_path / "web.png"
        browse(base + "/", "--window-size=1100,1500", "--hide-scrollbars",
               f"--screenshot={shot}")
        data = shot.read_bytes()
        assert data.startswith(b"\x89PNG\r\n\x1a\n") and len(data) > 20_000
        if os.environ.get("TASKDEDUP_WEB_SCREENSHOT"):
            SCREENSHOT.parent.mkdir(parents=True, exist_ok=True)
            SCREENSHOT.write_bytes(data)
        assert "ORD-" not in log.read_text()  # no argument value in the server's log either


def test_clearing_from_the_browser_needs_the_generated_token(
    browse: Callable[..., str], redis_client: redis.Redis, redis_url: str, tmp_path: Path,
) -> None:
    dedup = Deduplicator(RedisStore(redis_client))
    key = take(dedup, "payments.charge", "ORD-1", "charge-1")
    with dashboard(redis_url, tmp_path, "--allow-clear") as (base, log):
        line = next(line for line in log.read_text().splitlines() if "the token" in line)
        token = line.rsplit(" ", 1)[1]
        assert len(token) >= 16

        detail = dump(browse, base + "/lock?key=" + key)
        assert 'id="clear-form"' in detail and 'type="password"' in detail
        assert token not in detail

        form = {"key": key, "owner": "charge-1"}
        for fields in (form, {**form, "token": token[:-1] + "x"}):
            answer = post_from_browser(browse, tmp_path, base + "/clear", fields)
            assert "wrong or missing token" in answer
            assert redis_client.exists(key)

        answer = post_from_browser(browse, tmp_path, base + "/clear", {**form, "token": token})
        assert 'id="clear-result"' in answer and "cleared" in answer
        assert "wrong" not in answer
        assert not redis_client.exists(key)
        assert log.read_text().count(token) == 1  # printed once, at start, never logged again
