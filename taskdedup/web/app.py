"""The dashboard as a Starlette application (see :func:`taskdedup.web.create_app`)."""

from __future__ import annotations

import hmac
import json
import time
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any, Final
from urllib.parse import parse_qs

import redis
from starlette.applications import Starlette
from starlette.concurrency import run_in_threadpool
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import HTMLResponse, JSONResponse, Response
from starlette.routing import Route

from ..limits import summary
from ..locks import lock_key_error, redis_error_text, shown, ttl_text
from ..processing import holders
from ..stats import read_stats
from ..stores.redis import describe_client
from . import render
from .data import FirstSeen, StatsHistory, clear_lock, lock_page, overview, read_lock
from .hosts import HostGuard
from .render import esc, link

__all__ = ["MAX_BODY", "TOKEN_HEADER", "build_app"]

TOKEN_HEADER: Final = "X-Taskdedup-Token"
MAX_BODY: Final = 16_384
"""Bytes a clear request's body may hold: refused (413) past it, before it is read further."""
_HEADERS: Final = {
    "Content-Security-Policy": ("default-src 'none'; style-src 'unsafe-inline'; "
                                "form-action 'self'; frame-ancestors 'self'"),
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
    "Cache-Control": "no-store",
}


@dataclass
class _Dashboard:
    client: redis.Redis
    prefix: str
    allow_clear: bool
    token: str | None
    history: StatsHistory
    seen: FirstSeen
    page_size: int
    scan_cap: int

    @property
    def where(self) -> str:
        return describe_client(self.client)


def _root(request: Request) -> str:
    return str(request.scope.get("root_path", "")).rstrip("/")


def _html(request: Request, title: str, body: str, status: int = 200,
          refresh: int | None = None) -> HTMLResponse:
    dash: _Dashboard = request.app.state.dashboard
    content = render.page(title, body, root=_root(request), where=dash.where,
                          read_only=not dash.allow_clear, refresh=refresh)
    return HTMLResponse(content, status_code=status, headers=_HEADERS)


def _json(data: Any, status: int = 200) -> JSONResponse:
    return JSONResponse(_encodable(data), status_code=status, headers=_HEADERS)


def _encodable(data: Any) -> Any:
    """``data`` with the undecodable bytes of a key or value (lone surrogates from
    ``surrogateescape``) written ``\\xff``: JSON text is UTF-8 and cannot hold them."""
    if isinstance(data, str):
        return shown(data) if any("\ud800" <= c <= "\udfff" for c in data) else data
    if isinstance(data, dict):
        return {_encodable(k): _encodable(v) for k, v in data.items()}
    if isinstance(data, list):
        return [_encodable(item) for item in data]
    return data


def _query(request: Request, name: str) -> str:
    """A query parameter with undecodable bytes kept (``surrogateescape``), so a link to a
    key that is not UTF-8 finds that key again (Starlette's own parsing replaces them)."""
    raw = request.scope.get("query_string", b"").decode("latin-1")
    values = parse_qs(raw, keep_blank_values=True, encoding="utf-8", errors="surrogateescape")
    found: list[str] = values.get(name, [""])
    return found[0]


def _dash(request: Request) -> _Dashboard:
    dash: _Dashboard = request.app.state.dashboard
    dash.history.ensure_started()
    return dash


def _window_text(dash: _Dashboard) -> str:
    samples = dash.history.snapshot()
    if len(samples) < 2:
        return "since start"
    return render.age_text(samples[-1].time - samples[0].time)


# -- pages -------------------------------------------------------------------------------------


def home(request: Request) -> Response:
    dash = _dash(request)
    root = _root(request)
    view = overview(dash.client, dash.prefix, cap=dash.scan_cap, seen=dash.seen)
    stats = read_stats(dash.client, dash.prefix)
    now = time.time()
    scope_note = ("" if view.complete else
                  f'<p class="muted">counted over the first {view.locks} locks found '
                  f"(the scan stops at {dash.scan_cap} keys); see all locks for the rest</p>")
    oldest_rows = render.lock_rows(
        root, [lock for lock, _ in view.oldest],
        extra={lock.key: render.first_seen_text(first, now) for lock, first in view.oldest},
    )
    error = dash.history.last_error
    body = "".join([
        f'<p class="banner bad">stats sampling failed: {esc(error)}</p>' if error else "",
        "<h2>Duplicate rate per task over time</h2>",
        render.rate_chart(dash.history.rates(), every=dash.history.every),
        f'<p class="muted">one sample of the flushed counters every {dash.history.every:g}s, '
        f"the latest {dash.history.samples.maxlen} kept in this process</p>",
        "<h2>Per task: enqueues, duplicates, lost leases, store errors</h2>",
        render.stats_table(stats, dash.history.window_deltas(), _window_text(dash)),
        *_limits_section(dash, stats),
        *_fetch_summary(dash, root),
        f"<h2>Locks by task and state ({view.locks})</h2>", scope_note,
        render.counts_table(root, view.counts),
        f'<p class="muted">{view.no_expiry} without expiry (set by hand?)</p>'
        if view.no_expiry else "",
        "<h2>Expiring soonest</h2>",
        render.table(["key", "task", "scope", "state", "owner", "ttl"],
                     render.lock_rows(root, view.soonest), table_id="soonest"),
        "<h2>Held longest, as far as this dashboard has watched</h2>",
        render.table(["key", "task", "scope", "state", "owner", "ttl",
                      "first seen by this dashboard"], oldest_rows, table_id="oldest"),
        '<p class="muted">Not the locks\' ages: Redis does not record when a key was written '
        "(and a running lock's heartbeat keeps renewing its TTL), so this counts from the "
        "first time this dashboard saw the lock with its owner; a lock older than the "
        "dashboard shows when the dashboard first looked.</p>",
    ])
    return _html(request, "overview", body, refresh=30)


def _fetch_summary(dash: _Dashboard, root: str) -> list[str]:
    """One line on the reliable fetch's processing lists (SPEC §17), when any worker uses it."""
    found = holders(dash.client, dash.prefix)
    if not found:
        return []
    orphans = [h for h in found if h.orphan and h.held]
    line = (f"{sum(1 for h in found if not h.orphan)} worker(s) on the reliable fetch hold "
            f"{sum(h.held for h in found if not h.orphan)} message(s)")
    if orphans:
        line += (f'; <span class="warn">{sum(h.held for h in orphans)} wait in the lists of '
                 f"{len(orphans)} worker(s) whose lease lapsed</span>")
    return ["<h2>Reliable fetch</h2>", f"<p>{line} · {link(root, '/fetch', 'details')}</p>"]


def fetch_lists(request: Request) -> Response:
    """The reliable fetch's processing lists: who holds what, and the orphans (read-only)."""
    dash = _dash(request)
    found = holders(dash.client, dash.prefix)
    orphans = [h for h in found if h.orphan and h.held]
    note = (f'<p class="banner bad" id="orphans">{sum(h.held for h in orphans)} message(s) '
            f"wait in the processing lists of {len(orphans)} worker(s) whose lease lapsed: a "
            "live worker with the reliable fetch puts them back at the head of their queues "
            "within a third of its lease (is one running on these queues?)</p>"
            if orphans else "")
    body = (
        f"<h2>Processing lists ({len(found)} owner(s), "
        f"{sum(h.held for h in found)} message(s) held)</h2>" + note
        + render.table(["worker", "pid", "owner", "queue list", "held", "lease"],
                       render.holder_rows(found), numeric=(1, 4), table_id="processing",
                       empty="no worker uses the reliable fetch under this prefix "
                       "(taskdedup_reliable_fetch; its lists live in the broker's Redis)")
        + '<p class="muted">Each worker on the reliable fetch moves a message from its queue '
        "into a list of its own, renews a lease while it lives, and removes the message on "
        "ack. Messages held by a live worker (an ETA, a long task) are never handed out again; "
        "a worker's lists are put back once its lease lapsed.</p>"
    )
    return _html(request, "processing lists", body, refresh=30)


def api_fetch(request: Request) -> Response:
    dash = _dash(request)
    return _json({"owners": [
        {"owner": h.owner, "worker": h.worker, "host": h.host, "pid": h.pid,
         "lease_ms": h.lease_ms, "ttl_ms": h.ttl_ms, "orphan": h.orphan, "held": h.held,
         "lists": h.lists}
        for h in holders(dash.client, dash.prefix)]})


def _page_args(request: Request) -> tuple[str | None, str | None, str | None, int]:
    task = _query(request, "task") or None
    scope = (_query(request, "scope") or None) if task is not None else None
    state = request.query_params.get("state") or None
    if state is not None and state not in ("queued", "running", "done"):
        state = None
    try:
        cursor = max(0, int(request.query_params.get("cursor", "0")))
    except ValueError:
        cursor = 0
    return task, scope, state, cursor


def locks(request: Request) -> Response:
    dash = _dash(request)
    root = _root(request)
    task, scope, state, cursor = _page_args(request)
    found = lock_page(dash.client, dash.prefix, task=task, state=state, cursor=cursor,
                      limit=dash.page_size, seen=dash.seen, scope=scope)
    what = " ".join(filter(None, [f"task {task}" if task else "",
                                  f"in scope {scope}" if scope else "", state or ""])) or "all"
    more = (link(root, "/locks", "next page →", task=task, scope=scope, state=state,
                 cursor=found.cursor)
            if found.cursor else '<span class="muted">end of the scan</span>')
    body = (
        f"<h2>Locks: {esc(what)} ({len(found.locks)} on this page)</h2>"
        + render.table(["key", "task", "scope", "state", "owner", "ttl"],
                       render.lock_rows(root, found.locks), table_id="locks",
                       empty="no locks on this page")
        + f"<p>{more}</p>"
    )
    return _html(request, "locks", body)


def lock_detail(request: Request) -> Response:
    dash = _dash(request)
    key = _query(request, "key")
    lock = read_lock(dash.client, dash.prefix, key) if key else None
    if lock is None:
        body = (f"<p>No lock at <code>{esc(key)}</code>: never taken, released, expired, or "
                "not a taskdedup lock under this prefix.</p>")
        return _html(request, "lock", body, status=404)
    first = dash.seen.see([lock])[lock.key]
    rows = [
        ["key", f"<code>{esc(lock.key)}</code>"],
        ["task", esc(lock.task)],
        ["scope", esc(lock.scope)],
        ["state", esc(lock.state)],
        ["owner (task id)", render.owner_cell(lock.owner)],
        ["ttl", esc(ttl_text(lock.ttl_ms))],
        ["idempotency check", "set (explicit dedup_key)" if lock.check else "not set"],
        ["first seen by this dashboard", esc(render.first_seen_text(first, time.time()))],
    ]
    if dash.allow_clear and (shown(lock.key) != lock.key or shown(lock.owner) != lock.owner):
        # the page shows them escaped, so a form would post back text that is not the key
        clear = ('<p class="muted" id="no-clear">This key or owner holds control characters '
                 "or bytes that are not UTF-8, shown escaped: clear it with "
                 "<code>taskdedup clear</code> or redis-cli.</p>")
    elif dash.allow_clear:
        clear = (
            f'<form method="post" action="{esc(_root(request) + "/clear")}" id="clear-form">'
            f'<input type="hidden" name="key" value="{esc(lock.key)}">'
            f'<input type="hidden" name="owner" value="{esc(lock.owner)}">'
            '<label>token <input type="password" name="token" autocomplete="off"></label> '
            '<button type="submit">clear this lock</button></form>'
            '<p class="muted">Deletes the lock only while this owner still holds it; the '
            "identity can then be enqueued again. A running task is not stopped.</p>"
        )
    else:
        clear = ('<p class="muted" id="read-only">Read-only: start the dashboard with '
                 "<code>--allow-clear</code> to clear locks (a token is asked for).</p>")
    body = (render.fields_table([(name, value) for name, value in rows], table_id="lock")
            + '<p class="muted">Keys hold a digest of the arguments, never their values.</p>'
            + clear)
    return _html(request, "lock", body)


# -- clearing ----------------------------------------------------------------------------------


class _TooLarge(Exception):
    """A request body over :data:`MAX_BODY`."""


async def _body(request: Request) -> bytes:
    """The body, read no further than :data:`MAX_BODY`: a larger Content-Length is refused
    before reading, a chunked body is cut off at the limit (memory stays bounded)."""
    length = request.headers.get("content-length")
    if length is not None and (not length.strip().isdigit() or int(length) > MAX_BODY):
        raise _TooLarge
    chunks: list[bytes] = []
    size = 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > MAX_BODY:
            raise _TooLarge
        chunks.append(chunk)
    return b"".join(chunks)


async def _form(request: Request) -> dict[str, str]:
    body = await _body(request)
    kind = request.headers.get("content-type", "").split(";")[0].strip().lower()
    if kind == "application/json":
        try:
            data = json.loads(body or b"{}")
        except ValueError:
            return {}
        return {k: v for k, v in data.items() if isinstance(v, str)} if isinstance(data,
                                                                                   dict) else {}
    parsed = parse_qs(body.decode("utf-8", "replace"), keep_blank_values=True)
    return {name: values[0] for name, values in parsed.items()}


def _refusal(dash: _Dashboard, request: Request, form: dict[str, str]) -> tuple[int, str] | None:
    if not dash.allow_clear or dash.token is None:
        return 403, ("clearing is off: this dashboard is read-only (start it with "
                     "--allow-clear, or create_app(allow_clear=True, token=...))")
    given = request.headers.get(TOKEN_HEADER) or form.get("token") or ""
    if not hmac.compare_digest(given.encode(), dash.token.encode()):
        return 403, (f"wrong or missing token (send it in the {TOKEN_HEADER} header or the "
                     "token form field)")
    if not form.get("key") or not form.get("owner"):
        return 400, "pass the lock's key and its owner (the task id that holds it)"
    outside = lock_key_error(dash.prefix, form["key"])
    if outside is not None:
        return 400, f"{outside}: nothing cleared"
    return None


async def _clear(request: Request) -> tuple[int, str, dict[str, Any]]:
    dash = _dash(request)
    try:
        form = await _form(request)
    except _TooLarge:
        text = f"request body over {MAX_BODY} bytes: refused"
        return 413, text, {"cleared": False, "error": text}
    refused = _refusal(dash, request, form)
    if refused is not None:
        return refused[0], refused[1], {"cleared": False, "error": refused[1]}
    key, owner = form["key"], form["owner"]
    cleared = await run_in_threadpool(clear_lock, dash.client, dash.prefix, key, owner)
    if not cleared:
        text = "not cleared: the lock is gone, or another owner holds it now"
        return 409, text, {"cleared": False, "key": key, "error": text}
    return 200, "cleared", {"cleared": True, "key": key}


async def clear_form(request: Request) -> Response:
    status, text, data = await _clear(request)
    key = data.get("key")
    body = f'<p class="banner{"" if status == 200 else " bad"}" id="clear-result">{esc(text)}'
    body += f": <code>{esc(key)}</code></p>" if key else "</p>"
    return _html(request, "clear", body, status=status)


async def clear_api(request: Request) -> Response:
    status, _, data = await _clear(request)
    return _json(data, status)


# -- JSON --------------------------------------------------------------------------------------


def api_locks(request: Request) -> Response:
    dash = _dash(request)
    task, scope, state, cursor = _page_args(request)
    found = lock_page(dash.client, dash.prefix, task=task, state=state, cursor=cursor,
                      limit=dash.page_size, seen=dash.seen, scope=scope)
    return _json({"locks": [lock.as_dict() for lock in found.locks], "cursor": found.cursor})


def api_lock(request: Request) -> Response:
    dash = _dash(request)
    lock = read_lock(dash.client, dash.prefix, _query(request, "key"))
    if lock is None:
        return _json({"exists": False}, 404)
    return _json({**lock.as_dict(), "exists": True})


def _limits_section(dash: _Dashboard, stats: Any) -> list[str]:
    """The per-key limits of the tasks that have them (SPEC §16), or nothing."""
    rows = summary(dash.client, dash.prefix, stats)
    if not rows:
        return []
    return ["<h2>Per task: limits (slots in use, calls waiting, put off, dropped)</h2>",
            render.limits_table(rows)]


def api_stats(request: Request) -> Response:
    dash = _dash(request)
    stats = read_stats(dash.client, dash.prefix)
    data: dict[str, Any] = {name: item.as_dict() for name, item in stats.items()}
    for name, row in summary(dash.client, dash.prefix, stats).items():
        data.setdefault(name, {})["limits"] = row
    return _json(data)


def api_series(request: Request) -> Response:
    dash = _dash(request)
    samples = dash.history.snapshot()
    return _json({
        "every": dash.history.every,
        "samples": len(samples),
        "last_error": dash.history.last_error,
        "duplicate_rate": {
            task: [{"time": t, "rate": rate} for t, rate in series]
            for task, series in dash.history.rates(samples).items()
        },
    })


def chart(request: Request) -> Response:
    dash = _dash(request)
    svg = render.rate_chart(dash.history.rates(), every=dash.history.every)
    return Response(svg, media_type="image/svg+xml", headers=_HEADERS)


async def _redis_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, redis.RedisError)
    dash: _Dashboard = request.app.state.dashboard
    message = redis_error_text(dash.where, exc)
    if request.url.path.startswith(_root(request) + "/api/"):
        return _json({"error": message}, 503)
    return _html(request, "error", f'<p class="banner bad">{esc(message)}</p>', status=503)


def build_app(
    client: redis.Redis, *, prefix: str, allow_clear: bool, token: str | None,
    sample_every: float, keep: int, page_size: int, scan_cap: int,
    allowed_hosts: Sequence[str] = (),
) -> Starlette:
    routes = [
        Route("/", home),
        Route("/locks", locks),
        Route("/lock", lock_detail),
        Route("/fetch", fetch_lists),
        Route("/clear", clear_form, methods=["POST"]),
        Route("/chart.svg", chart),
        Route("/api/locks", api_locks),
        Route("/api/lock", api_lock),
        Route("/api/stats", api_stats),
        Route("/api/series", api_series),
        Route("/api/fetch", api_fetch),
        Route("/api/clear", clear_api, methods=["POST"]),
    ]
    history = StatsHistory(client, prefix, every=sample_every, keep=keep)

    @asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        # Served on its own (taskdedup web): sample from the start. Mounted in another app,
        # no lifespan event arrives and the first request starts the sampling instead.
        history.ensure_started()
        try:
            yield
        finally:
            history.stop()

    app = Starlette(routes=routes, exception_handlers={redis.RedisError: _redis_error},
                    lifespan=lifespan,
                    middleware=[Middleware(HostGuard, allowed_hosts=allowed_hosts)])
    app.state.dashboard = _Dashboard(
        client=client, prefix=prefix, allow_clear=allow_clear, token=token, history=history,
        seen=FirstSeen(), page_size=page_size, scan_cap=scan_cap,
    )
    return app
