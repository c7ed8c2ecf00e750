"""``taskdedup web``'s ASGI app through Starlette's TestClient, on the session's real Redis:
pages and JSON, SCAN paging (never KEYS), no argument values anywhere, the chart's
time series, mounting inside another app, and every way a clear is refused."""

from __future__ import annotations

import re
import time
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import redis
from click.testing import CliRunner
from starlette.applications import Starlette
from starlette.routing import Mount

from taskdedup import ConfigurationError, Deduplicator, Policy, RedisStore, stats
from taskdedup.cli import main
from taskdedup.core import Verdict
from taskdedup.stats import stats_key
from taskdedup.testing import free_port, wait_for
from taskdedup.web import create_app
from taskdedup.web.app import TOKEN_HEADER

with warnings.catch_warnings():  # Starlette 1.x prefers httpx2; httpx works with every release
    warnings.simplefilter("ignore")
    from starlette.testclient import TestClient

BASE = "http://127.0.0.1"  # a loopback Host: the dashboard answers only to its own names
TOKEN = "s3cret-token-for-tests"
SECRET = "SECRET-ORDER-4242"  # an argument value that must never appear on a page
POLICY = Policy(ttl=60)


class CountingRedis(redis.Redis):
    """A client that remembers the name of every command it sent."""

    commands: list[str]

    def execute_command(self, *args: Any, **options: Any) -> Any:
        self.commands.append(str(args[0]).upper())
        return super().execute_command(*args, **options)


@pytest.fixture
def client(redis_client: redis.Redis, redis_url: str) -> Iterator[CountingRedis]:
    counting = CountingRedis.from_url(redis_url)
    counting.commands = []
    yield counting
    counting.close()


@pytest.fixture
def make_app(client: CountingRedis) -> Iterator[Callable[..., TestClient]]:
    apps: list[Starlette] = []

    def make(**options: Any) -> TestClient:
        app = create_app(client, **options)
        apps.append(app)
        return TestClient(app, base_url=BASE)

    yield make
    for app in apps:
        app.state.dashboard.history.stop()


def take(dedup: Deduplicator, task: str, arg: Any, owner: str) -> str:
    identity = dedup.identity(task, POLICY, (arg,))
    assert dedup.gate(task, POLICY, identity, owner).verdict is Verdict.ACCEPTED
    return identity.key


@pytest.fixture
def dedup(redis_client: redis.Redis) -> Deduplicator:
    return Deduplicator(RedisStore(redis_client))


def test_the_overview_shows_locks_by_task_and_state_and_the_counters(
    make_app: Callable[..., TestClient], dedup: Deduplicator, redis_client: redis.Redis,
) -> None:
    recorder = stats.StatsRecorder(redis_client, interval=3600)
    dedup.events.add(recorder)
    keys = [take(dedup, "app.charge", f"{SECRET}-{n}", f"task-{n}") for n in range(3)]
    dedup.store.claim(keys[0], "task-0", 30_000)  # one running
    take(dedup, "app.mail", SECRET, "mail-1")
    identity = dedup.identity("app.charge", POLICY, (f"{SECRET}-1",))
    duplicate = dedup.gate("app.charge", POLICY, identity, "dup-1")
    assert duplicate.verdict is Verdict.DUPLICATE
    assert recorder.flush()
    redis_client.hincrby(stats_key("taskdedup", "app.mail"), "lease_lost", 2)
    redis_client.hincrby(stats_key("taskdedup", "app.mail"), "store_error", 1)

    page = make_app().get("/")
    assert page.status_code == 200
    text = page.text
    assert '<svg id="dup-rate-chart"' in text
    assert "Locks by task and state (4)" in text
    by_task = text[text.index('id="by-task"'):]
    row = by_task[by_task.index("app.charge"):]
    assert ">1</a>" in row[:row.index("</tr>")] and ">2</a>" in row[:row.index("</tr>")]
    stats_table = text[text.index('id="stats"'):]
    mail_row = stats_table[stats_table.index("app.mail"):]
    mail_row = mail_row[:mail_row.index("</tr>")]
    assert '<td class="n">2</td>' in mail_row and '<td class="n">1</td>' in mail_row
    charge_row = stats_table[stats_table.index("app.charge"):]
    assert "25.0%" in charge_row[:charge_row.index("</tr>")]  # 1 duplicate / (3 + 1)
    soonest = text[text.index('id="soonest"'):text.index('id="oldest"')]
    assert all(key in soonest for key in keys)
    assert SECRET not in text


def test_locks_are_paged_with_scan_and_a_cursor_never_keys(
    make_app: Callable[..., TestClient], dedup: Deduplicator, client: CountingRedis,
    redis_client: redis.Redis,
) -> None:
    expected = {take(dedup, "app.charge", n, f"task-{n}") for n in range(45)}
    redis_client.hset(stats_key("taskdedup", "app.charge"), "reserved", 45)  # not a lock
    redis_client.set("other:key", "x")  # not under the prefix
    web = make_app(page_size=10)
    seen: list[str] = []
    cursor, pages = 0, 0
    while True:
        data = web.get("/api/locks", params={"cursor": cursor}).json()
        seen += [lock["key"] for lock in data["locks"]]
        pages += 1
        cursor = data["cursor"]
        if cursor == 0:
            break
        assert pages < 50
    assert sorted(seen) == sorted(expected)  # each once, none missing
    assert pages > 1
    html = web.get("/locks", params={"state": "queued"}).text
    assert "next page" in html or "end of the scan" in html
    assert web.get("/").status_code == 200  # the overview scans too
    assert "SCAN" in client.commands
    assert "KEYS" not in client.commands


def test_a_page_filters_by_task_and_state(
    make_app: Callable[..., TestClient], dedup: Deduplicator,
) -> None:
    charge = take(dedup, "app.charge", 1, "task-1")
    running = take(dedup, "app.charge", 2, "task-2")
    dedup.store.claim(running, "task-2", 30_000)
    mail = take(dedup, "app.mail", 1, "mail-1")
    web = make_app()
    page = web.get("/locks", params={"task": "app.charge", "state": "running"}).text
    assert running in page and charge not in page and mail not in page
    data = web.get("/api/locks", params={"task": "app.mail"}).json()
    assert [lock["key"] for lock in data["locks"]] == [mail]


def test_one_locks_detail_shows_key_task_state_owner_and_ttl_never_arguments(
    make_app: Callable[..., TestClient], dedup: Deduplicator,
) -> None:
    key = take(dedup, "app.charge", SECRET, "task-42")
    web = make_app()
    page = web.get("/lock", params={"key": key})
    assert page.status_code == 200
    for text in (key, "app.charge", "queued", "task-42", "Read-only"):
        assert text in page.text
    assert 'id="clear-form"' not in page.text
    data = web.get("/api/lock", params={"key": key}).json()
    assert data["owner"] == "task-42" and 0 < data["ttl_ms"] <= 60_000
    for path in ("/", "/locks", "/api/locks", "/api/stats", "/api/series", "/chart.svg"):
        assert SECRET not in web.get(path).text
    assert web.get("/lock", params={"key": "taskdedup:app.charge:" + "0" * 32}).status_code == 404
    assert web.get("/api/lock", params={"key": "elsewhere"}).status_code == 404


def test_the_chart_plots_the_duplicate_rate_between_samples(
    make_app: Callable[..., TestClient], dedup: Deduplicator, redis_client: redis.Redis,
) -> None:
    key = stats_key("taskdedup", "app.charge")
    web = make_app(sample_every=3600, keep=3)  # the thread samples once; the test samples
    history = web.app.state.dashboard.history  # type: ignore[attr-defined]
    web.get("/")
    wait_for(lambda: len(history.snapshot()) == 1, what="the first sample")
    redis_client.hset(key, mapping={"reserved": 3, "duplicate": 1})
    history.sample()
    redis_client.hset(key, mapping={"reserved": 4, "duplicate": 4})
    history.sample()
    series = web.get("/api/series").json()
    assert series["samples"] == 3
    rates = [point["rate"] for point in series["duplicate_rate"]["app.charge"]]
    assert rates == [0.25, 0.75]  # 1 of 4, then 3 of 4
    svg = web.get("/chart.svg")
    assert svg.headers["content-type"].startswith("image/svg+xml")
    assert '<polyline class="series" data-task="app.charge"' in svg.text
    redis_client.hset(key, mapping={"reserved": 5})
    history.sample()
    assert len(history.snapshot()) == 3  # bounded: the oldest went
    assert [r for _, r in history.rates()["app.charge"]] == [0.75, 0.0]


def test_the_chart_draws_lines_across_samples_taken_between_two_flushes() -> None:
    """#24 stumble 10: with --sample-every 2 and counts flushed every 5 s, every other
    interval saw no change and the chart was scattered dots; an idle spell still breaks it."""
    from taskdedup.web.render import rate_chart

    def lines(series: list[tuple[float, float | None]], every: float) -> list[int]:
        svg = rate_chart({"app.charge": series}, every=every)
        return [len(points.split()) for points in re.findall(r'<polyline[^>]* points="([^"]*)"',
                                                             svg)]

    flushed = [(t, 0.5 if t % 6 == 0 else None) for t in range(0, 62, 2)]  # 2 s samples
    assert lines(flushed, every=2) == [11]  # one line through all 11 flushed points
    idle = [(0.0, 0.2), (10.0, 0.3), (20.0, None), (30.0, None), (40.0, 0.4), (50.0, 0.5)]
    assert lines(idle, every=10) == [2, 2]  # 20 s without an enqueue: a gap, not a zero


def test_headers_say_what_they_count_owner_ids_stay_whole_and_the_lock_page_has_no_empty_header(
    make_app: Callable[..., TestClient], dedup: Deduplicator, redis_client: redis.Redis,
) -> None:
    """#24 stumbles 11 and 12: 'lease lost (+78s)' headers, a "seen for" column under
    "Oldest" that counted from the first page load, owner ids wrapped mid-UUID, a stray
    '- | -' header row on a lock's page."""
    owner = "0b5e4cde-6a4c-4e0f-9d63-2f1e3b8a7c11"
    key = take(dedup, "app.charge", SECRET, owner)
    redis_client.hset(stats_key("taskdedup", "app.charge"), mapping={"reserved": 1})
    web = make_app()
    text = web.get("/").text
    stats_table = text[text.index('id="stats"'):]
    headers = re.findall(r"<th>([^<]*)</th>", stats_table[:stats_table.index("</thead>")])
    assert headers == ["task", "accepted", "duplicates", "dup rate", "retries", "skipped",
                       "released on failure", "lease lost", "store errors"]
    assert 'id="stats-note"' in text and "(+n)</code> are those of the last" in text
    assert "Oldest" not in text and "seen for" not in text
    oldest = text[text.index('id="oldest"'):]
    assert "<th>first seen by this dashboard</th>" in oldest
    assert re.search(r"<td>\d\d:\d\d:\d\d UTC, \d+s ago</td>", oldest)
    assert f'<code class="id">{owner}</code>' in oldest
    assert re.search(r"code\.id\{[^}]*white-space:nowrap", text)  # never broken inside
    page = web.get("/lock", params={"key": key}).text
    detail = page[page.index('id="lock"'):page.index("</table>", page.index('id="lock"'))]
    assert "<thead>" not in detail and "<th>-</th>" not in detail
    assert '<th scope="row">owner (task id)</th><td><code class="id">' in detail
    assert '<th scope="row">first seen by this dashboard</th>' in detail


def test_clearing_is_refused_when_the_app_is_read_only(
    make_app: Callable[..., TestClient], dedup: Deduplicator, redis_client: redis.Redis,
) -> None:
    key = take(dedup, "app.charge", 1, "task-1")
    web = make_app(token=TOKEN)  # a token without allow_clear enables nothing
    for path in ("/clear", "/api/clear"):
        answer = web.post(path, data={"key": key, "owner": "task-1", "token": TOKEN},
                          headers={TOKEN_HEADER: TOKEN})
        assert answer.status_code == 403
        assert "read-only" in answer.text
    assert web.get("/clear").status_code == 405
    assert redis_client.exists(key)


def test_clearing_needs_the_token_and_the_current_owner(
    make_app: Callable[..., TestClient], dedup: Deduplicator, redis_client: redis.Redis,
) -> None:
    key = take(dedup, "app.charge", 1, "task-1")
    web = make_app(allow_clear=True, token=TOKEN)
    assert 'id="clear-form"' in web.get("/lock", params={"key": key}).text
    form = {"key": key, "owner": "task-1"}
    assert web.post("/clear", data=form).status_code == 403
    assert web.post("/clear", data={**form, "token": TOKEN[:-1]}).status_code == 403
    assert web.post("/clear", data=form, params={"token": TOKEN}).status_code == 403
    assert web.post("/api/clear", json=form, headers={TOKEN_HEADER: "x" * 20}).status_code == 403
    assert redis_client.exists(key)
    stale = web.post("/api/clear", json={**form, "owner": "task-0"},
                     headers={TOKEN_HEADER: TOKEN})
    assert stale.status_code == 409 and stale.json()["cleared"] is False
    assert redis_client.exists(key)  # another owner's lock is never deleted
    done = web.post("/clear", data={**form, "token": TOKEN})
    assert done.status_code == 200 and 'id="clear-result"' in done.text
    assert not redis_client.exists(key)
    redis_client.set("other:key:" + "0" * 32, "Q||x")  # a lock-like value outside the prefix
    outside = web.post("/api/clear", json={"key": "other:key:" + "0" * 32, "owner": "x"},
                       headers={TOKEN_HEADER: TOKEN})
    assert outside.status_code == 400 and "not a lock key" in outside.json()["error"]
    assert redis_client.exists("other:key:" + "0" * 32)


def test_create_app_refuses_unsafe_settings(redis_client: redis.Redis) -> None:
    with pytest.raises(ConfigurationError, match="needs a token"):
        create_app(redis_client, allow_clear=True)
    with pytest.raises(ConfigurationError, match="at least 16"):
        create_app(redis_client, allow_clear=True, token="short")
    with pytest.raises(ConfigurationError):
        create_app("http://localhost:6379")


def test_the_app_mounts_inside_another_asgi_app(
    client: CountingRedis, dedup: Deduplicator,
) -> None:
    key = take(dedup, "app.charge", 1, "task-1")
    dashboard = create_app(client)
    host = Starlette(routes=[Mount("/ops/taskdedup", app=dashboard)])
    try:
        web = TestClient(host, base_url=BASE)
        home = web.get("/ops/taskdedup/")
        assert home.status_code == 200
        assert 'href="/ops/taskdedup/locks?task=app.charge"' in home.text
        locks = web.get("/ops/taskdedup/locks")
        assert f'href="/ops/taskdedup/lock?key={key.replace(":", "%3A")}"' in locks.text
        assert web.get("/ops/taskdedup/lock", params={"key": key}).status_code == 200
        assert web.get("/ops/taskdedup/api/series").json()["every"] == 10.0
    finally:
        dashboard.state.dashboard.history.stop()


def test_an_unreachable_server_is_one_clear_line() -> None:
    app = create_app(f"redis://127.0.0.1:{free_port()}/0")
    try:
        web = TestClient(app, base_url=BASE)
        page = web.get("/")
        assert page.status_code == 503
        assert "cannot reach Redis at" in page.text
        assert web.get("/api/locks").json()["error"].startswith("cannot reach Redis")
    finally:
        app.state.dashboard.history.stop()


def test_the_web_command_is_listed_and_needs_a_url() -> None:
    runner = CliRunner()
    assert "web" in runner.invoke(main, ["--help"]).output
    helped = runner.invoke(main, ["web", "--help"])
    assert helped.exit_code == 0 and "--allow-clear" in helped.output
    assert "127.0.0.1" in helped.output
    missing = runner.invoke(main, ["web"], env={"TASKDEDUP_URL": ""})
    assert missing.exit_code == 1 and "no Redis URL" in missing.output
    short = runner.invoke(main, ["--url", "redis://127.0.0.1:1/0", "web", "--allow-clear",
                                 "--token", "short"])
    assert short.exit_code == 1 and "at least 16" in short.output


def test_the_mount_example_of_the_dashboard_page_runs(
    monkeypatch: pytest.MonkeyPatch, redis_url: str, dedup: Deduplicator,
) -> None:
    page = (Path(__file__).resolve().parent.parent / "docs" / "how-to" / "web-dashboard.md")
    blocks = re.findall(r"```python\n(# mount\.py\n.*?)```", page.read_text(), re.DOTALL)
    assert len(blocks) == 1
    key = take(dedup, "app.charge", 1, "task-1")
    monkeypatch.setenv("TASKDEDUP_URL", redis_url)
    namespace: dict[str, Any] = {}
    exec(compile(blocks[0], "mount.py", "exec"), namespace)
    try:
        web = TestClient(namespace["app"], base_url="http://ops.example.com")
        locks = web.get("/ops/taskdedup/locks")
        assert locks.status_code == 200 and key in locks.text
        assert web.post("/ops/taskdedup/clear", data={"key": key, "owner": "task-1"},
                        headers={TOKEN_HEADER: TOKEN}).status_code == 403
    finally:
        namespace["dashboard"].state.dashboard.history.stop()


# -- untrusted input (SPEC §8: the dashboard, input is not trusted) ------------------------------


def test_only_loopback_names_the_bound_address_and_allowed_hosts_are_answered(
    client: CountingRedis,
) -> None:
    """DNS rebinding: a page whose name now resolves to 127.0.0.1 sends its own name as Host."""
    plain = create_app(client)
    allowed = create_app(client, allowed_hosts=["ops.example.com", "10.0.0.7"])
    mounted = create_app(client, allowed_hosts=["ops.example.com"])
    parent = Starlette(routes=[Mount("/ops/taskdedup", app=mounted)])
    try:
        web = TestClient(plain, base_url=BASE)
        for host in ("127.0.0.1", "127.0.0.1:8077", "localhost", "LOCALHOST:8077", "[::1]",
                     "[::1]:8077", "localhost."):
            answer = web.get("/api/locks", headers={"Host": host})
            assert answer.status_code == 200, host
        for host in ("evil.example", "evil.example:8077", "127.0.0.1.evil.example", "",
                     "ops.example.com", "[::2]", "localhost.evil"):
            refused = web.get("/api/locks", headers={"Host": host})
            assert refused.status_code == 400, host
            assert "allowed-host" in refused.text
            assert web.get("/", headers={"Host": host}).status_code == 400
        other = TestClient(allowed, base_url="http://ops.example.com")
        assert other.get("/").status_code == 200
        assert other.get("/", headers={"Host": "10.0.0.7:8077"}).status_code == 200
        assert other.get("/", headers={"Host": "localhost"}).status_code == 200
        assert other.get("/", headers={"Host": "evil.example"}).status_code == 400
        inside = TestClient(parent, base_url="http://ops.example.com")
        assert inside.get("/ops/taskdedup/api/locks").status_code == 200
        assert inside.get("/ops/taskdedup/api/locks",
                          headers={"Host": "evil.example"}).status_code == 400
        anyone = TestClient(create_app(client, allowed_hosts=["*"]), base_url="http://x.test")
        assert anyone.get("/api/locks").status_code == 200
    finally:
        for app in (plain, allowed, mounted):
            app.state.dashboard.history.stop()


def test_the_web_command_answers_its_bound_address_and_allowed_hosts(
    monkeypatch: pytest.MonkeyPatch, redis_url: str,
) -> None:
    import uvicorn

    served: dict[str, Any] = {}
    monkeypatch.setattr(uvicorn, "run", lambda app, **options: served.update(app=app))
    result = CliRunner().invoke(main, ["--url", redis_url, "web", "--host", "10.1.2.3",
                                       "--allowed-host", "ops.example.com",
                                       "--allowed-host", "dash.example.com"])
    assert result.exit_code == 0, result.output
    app = served["app"]
    try:
        web = TestClient(app, base_url=BASE)
        for host in ("10.1.2.3:8077", "ops.example.com", "dash.example.com", "127.0.0.1"):
            assert web.get("/api/locks", headers={"Host": host}).status_code == 200, host
        assert web.get("/api/locks", headers={"Host": "evil.example"}).status_code == 400
    finally:
        app.state.dashboard.history.stop()


def test_a_clear_body_over_the_limit_is_refused_before_it_is_read(
    client: CountingRedis, dedup: Deduplicator, redis_client: redis.Redis,
) -> None:
    from taskdedup.web.app import MAX_BODY

    key = take(dedup, "app.charge", 1, "task-1")
    writable = create_app(client, allow_clear=True, token=TOKEN)
    read_only = create_app(client)
    parent = Starlette(routes=[Mount("/ops", app=create_app(client, allow_clear=True,
                                                            token=TOKEN))])
    big = b"key=" + b"x" * MAX_BODY
    try:
        for web, prefix in ((TestClient(writable, base_url=BASE), ""),
                            (TestClient(read_only, base_url=BASE), ""),
                            (TestClient(parent, base_url=BASE), "/ops")):
            for path in ("/clear", "/api/clear"):
                answer = web.post(prefix + path, content=big, headers={
                    TOKEN_HEADER: TOKEN, "Content-Type": "application/x-www-form-urlencoded"})
                assert answer.status_code == 413, (prefix, path, answer.text)
        ok = TestClient(writable, base_url=BASE).post(
            "/api/clear", json={"key": key, "owner": "task-1"}, headers={TOKEN_HEADER: TOKEN})
        assert ok.status_code == 200  # a body within the limit still clears
    finally:
        for app in (writable, read_only):
            app.state.dashboard.history.stop()


def test_a_chunked_body_is_cut_off_at_the_limit_by_a_real_uvicorn(
    client: CountingRedis, redis_url: str,
) -> None:
    """No Content-Length: the body streams in chunks. The dashboard stops reading past its
    limit and answers 413 while the client is still sending (memory stays bounded)."""
    import select
    import socket
    import threading

    import uvicorn

    from taskdedup.web.app import MAX_BODY

    received = [0]

    def counting(app: Any) -> Any:
        async def wrapper(scope: Any, receive: Any, send: Any) -> None:
            async def counted() -> Any:
                message = await receive()
                received[0] += len(message.get("body", b""))
                return message

            await app(scope, counted, send)

        return wrapper

    for allow_clear in (True, False):
        received[0] = 0
        dashboard = create_app(client, allow_clear=allow_clear,
                               token=TOKEN if allow_clear else None)
        port = free_port()
        server = uvicorn.Server(uvicorn.Config(counting(dashboard), host="127.0.0.1", port=port,
                                               log_level="warning", lifespan="off"))
        thread = threading.Thread(target=server.run, daemon=True)
        thread.start()
        try:
            wait_for(lambda server=server: server.started, timeout=20, what="uvicorn to start")
            sock = socket.create_connection(("127.0.0.1", port), timeout=10)
            sock.sendall(b"POST /api/clear HTTP/1.1\r\nHost: 127.0.0.1\r\n"
                         b"Content-Type: application/x-www-form-urlencoded\r\n"
                         b"Transfer-Encoding: chunked\r\n" + TOKEN_HEADER.encode()
                         + b": " + TOKEN.encode() + b"\r\n\r\n")
            chunk = b"%x\r\n%s\r\n" % (8192, b"x" * 8192)
            total, sent, reply, pending = 8 * 1024 * 1024, 0, b"", b""
            sock.setblocking(False)
            deadline = time.monotonic() + 30
            while b"\r\n\r\n" not in reply and time.monotonic() < deadline:
                readable, writable, _ = select.select([sock], [sock] if sent < total else [],
                                                      [], 1.0)
                if readable:
                    try:
                        more = sock.recv(65536)
                    except ConnectionError:
                        break
                    if not more:
                        break
                    reply += more
                elif writable:
                    pending = pending or chunk
                    try:
                        done = sock.send(pending)
                    except BlockingIOError:
                        continue
                    except ConnectionError:
                        break
                    pending = pending[done:]
                    sent += done
            sock.close()
            assert reply.startswith(b"HTTP/1.1 413"), reply[:200]
            assert sent < total  # answered while the client was still sending
            assert received[0] <= MAX_BODY + 256 * 1024, received[0]  # read about the limit
        finally:
            server.should_exit = True
            thread.join(timeout=20)
            dashboard.state.dashboard.history.stop()


def test_odd_keys_and_stats_fields_break_no_page(
    make_app: Callable[..., TestClient], dedup: Deduplicator, redis_client: redis.Redis,
) -> None:
    key = take(dedup, "app.charge", 1, "task-1")
    odd = b"taskdedup:app.\xff\xfe:" + b"2" * 32
    redis_client.set(odd, "Q||id-odd")
    redis_client.set("taskdedup:app.\x1b[31m<b>x</b>:" + "3" * 32, "R||own\x1b]0;t\x07")
    redis_client.hset(stats_key("taskdedup", "app.charge"), mapping={"reserved": 3,
                                                                     "duplicate": "lots"})
    redis_client.hset(b"taskdedup:stats:app.\xff", "reserved", 2)
    web = make_app(sample_every=3600)
    history = web.app.state.dashboard.history  # type: ignore[attr-defined]
    for path in ("/", "/locks", "/api/locks", "/api/stats", "/api/series", "/chart.svg"):
        answer = web.get(path)
        assert answer.status_code == 200, (path, answer.text[-500:])
        assert "\x1b" not in answer.text, path
        if not path.startswith("/api/"):
            assert "<b>x</b>" not in answer.text, path
    home = web.get("/").text
    assert key in home and "app.\\xff\\xfe" in home and "app.\\x1b[31m" in home
    stats = web.get("/api/stats").json()
    assert stats["app.charge"]["accepted"] == 3
    assert stats["app.charge"]["ignored_fields"] == ["duplicate"]
    assert stats["app.\\xff"]["accepted"] == 2
    assert history.sample() is not None and history.last_error is None  # sampling goes on
    rows = web.get("/api/locks").json()["locks"]
    assert {row["key"] for row in rows} >= {key, "taskdedup:app.\\xff\\xfe:" + "2" * 32}
    escaped = web.get("/locks").text
    link = escaped[escaped.index("app.\\xff\\xfe") - 200:escaped.index("app.\\xff\\xfe")]
    href = re.findall(r'href="([^"]+)"', link)[-1]
    assert web.get(href.replace("&amp;", "&")).status_code == 200  # its detail page opens


def test_a_task_filter_is_exact_and_the_clear_is_refused_outside_the_prefix(
    make_app: Callable[..., TestClient], redis_client: redis.Redis,
) -> None:
    digest = "1" * 32
    for name in ("charge", "billing:charge", "charge:v2"):
        redis_client.set(f"taskdedup:{name}:{digest}", "Q||x")
    web = make_app()
    keys = [row["key"] for row in web.get("/api/locks", params={"task": "charge"}).json()["locks"]]
    assert keys == [f"taskdedup:charge:{digest}"]
    scoped = web.get("/api/locks", params={"task": "charge", "scope": "billing"}).json()
    assert [row["key"] for row in scoped["locks"]] == [f"taskdedup:billing:charge:{digest}"]
    home = web.get("/").text
    assert 'href="/locks?task=charge&amp;scope=billing"' in home


def test_the_processing_lists_of_the_reliable_fetch_show_owners_sizes_and_orphans(
    make_app: Callable[..., TestClient], redis_client: redis.Redis,
) -> None:
    """SPEC §17: a read-only page lists each worker's processing lists (owner, pid, queue list,
    held, lease), flags the orphans (lease lapsed, messages waiting), and the overview says it
    in one line; an owner entry that is not JSON, or a control character, breaks nothing."""
    from taskdedup import processing

    web = make_app(sample_every=3600)
    assert "no worker uses the reliable fetch" in web.get("/fetch").text
    assert "Reliable fetch" not in web.get("/").text
    owners = processing.owners_key("taskdedup")
    live, dead, odd = "w1@host/11/aaaa", "w2@host/22/bbbb", "w3\x1b[31m/33/cccc"
    redis_client.hset(owners, mapping={
        live: '{"worker": "w1@host", "host": "host", "pid": 11, "lease_ms": 30000}',
        dead: '{"worker": "w2@host", "host": "host", "pid": 22, "lease_ms": 30000}',
        odd: "not json"})
    redis_client.set(processing.lease_key("taskdedup", live), "1", px=30_000)
    redis_client.set(processing.lease_key("taskdedup", odd), "1", px=30_000)
    for owner, source, count in ((live, "celery", 2), (live, "celery\x06\x163", 1),
                                 (dead, "emails", 4)):
        redis_client.sadd(processing.sources_key("taskdedup", owner), source)
        redis_client.rpush(processing.list_key("taskdedup", owner, source), *range(count))
    page = web.get("/fetch")
    assert page.status_code == 200 and "\x1b" not in page.text
    table = page.text[page.text.index('id="processing"'):]
    assert "w1@host" in table and "celery\\x06\\x163" in table and "lapsed: orphan" in table
    row = table[table.index("w2@host"):]
    assert '<td class="n">4</td>' in row[:row.index("</tr>")]
    assert "4 message(s) wait in the processing lists of 1 worker(s)" in page.text
    assert "2 worker(s) on the reliable fetch hold 3 message(s)" in web.get("/").text
    data = web.get("/api/fetch").json()["owners"]
    by_owner = {o["owner"]: o for o in data}
    assert by_owner[live]["lists"] == {"celery": 2, "celery\x06\x163": 1}
    assert by_owner[dead]["orphan"] is True and by_owner[dead]["held"] == 4
    assert by_owner[odd]["pid"] is None and by_owner[odd]["held"] == 0
