"""The dashboard's HTML and its chart, rendered on the server: no JavaScript, no CDN, no
template engine. Every value that came from Redis goes through :func:`esc` (HTML-escaped,
control characters and undecodable bytes written as ``\\x1b``-style escapes)."""

from __future__ import annotations

import html
import time
from collections.abc import Iterable, Mapping, Sequence
from typing import Final
from urllib.parse import urlencode

from ..locks import Lock, key_name, shown, ttl_text
from ..processing import Holder
from ..stats import DEFAULT_INTERVAL, TaskStats
from .data import STATES

__all__ = ["age_text", "esc", "page", "rate_chart", "table"]

PALETTE: Final = ("#1f77b4", "#d62728", "#2ca02c", "#ff7f0e", "#9467bd", "#8c564b",
                  "#e377c2", "#17becf")
MAX_SERIES: Final = len(PALETTE)

_CSS: Final = """
body{font:14px/1.4 system-ui,sans-serif;margin:1.5rem;color:#222;max-width:72rem}
h1{font-size:1.3rem;margin:0 0 .2rem} h2{font-size:1.05rem;margin:1.6rem 0 .4rem}
nav a{margin-right:1rem} .muted{color:#666} .warn{color:#a40000}
table{border-collapse:collapse;margin:.3rem 0} th,td{padding:.2rem .6rem;text-align:left;
border-bottom:1px solid #ddd;vertical-align:top} th{background:#f4f4f4}
td.n{text-align:right;font-variant-numeric:tabular-nums} code{font-size:12px;word-break:break-all}
code.id{word-break:normal;white-space:nowrap} table.fields th{background:none;font-weight:600}
.banner{padding:.4rem .7rem;background:#f4f4f4;border-left:4px solid #888;margin:.6rem 0}
.banner.bad{border-color:#a40000} form{margin:.8rem 0}
"""


def esc(value: object) -> str:
    """``value`` as HTML text (quotes escaped too: safe in attributes); control characters
    and undecodable bytes as escapes (``\\x1b``, ``\\xff``): a page must encode as UTF-8,
    and what Redis holds is shown as it is, never acted on."""
    return html.escape("-" if value is None or value == "" else shown(value), quote=True)


def link(root: str, path: str, text: object, **query: object) -> str:
    """An ``<a>`` to ``path`` with ``query``; undecodable bytes of a key travel
    percent-encoded as themselves (the app reads them back with ``surrogateescape``)."""
    params = {name: value for name, value in query.items() if value not in (None, "")}
    query_text = urlencode(params, encoding="utf-8", errors="surrogateescape")
    href = root + path + ("?" + query_text if params else "")
    return f'<a href="{esc(href)}">{esc(text)}</a>'


def age_text(seconds: float) -> str:
    seconds = max(0.0, seconds)
    if seconds < 90:
        return f"{seconds:.0f}s"
    if seconds < 5400:
        return f"{seconds / 60:.0f} min"
    if seconds < 172_800:
        return f"{seconds / 3600:.1f} h"
    return f"{seconds / 86400:.1f} days"


def clock_text(epoch: float) -> str:
    return time.strftime("%H:%M:%S UTC", time.gmtime(epoch))


def first_seen_text(first: float, now: float) -> str:
    """When this dashboard first saw something, as a time of day and how long ago."""
    return f"{clock_text(first)}, {age_text(now - first)} ago"


def table(headers: Sequence[str], rows: Iterable[Sequence[str]], *, numeric: Sequence[int] = (),
          table_id: str | None = None, empty: str = "none") -> str:
    """A table from ``rows`` of cells that are already HTML."""
    body = []
    for row in rows:
        cells = "".join(
            f'<td class="n">{cell}</td>' if index in numeric else f"<td>{cell}</td>"
            for index, cell in enumerate(row)
        )
        body.append(f"<tr>{cells}</tr>")
    if not body:
        return f'<p class="muted">{esc(empty)}</p>'
    head = "".join(f"<th>{esc(name)}</th>" for name in headers)
    ident = f' id="{esc(table_id)}"' if table_id else ""
    return f"<table{ident}><thead><tr>{head}</tr></thead><tbody>{''.join(body)}</tbody></table>"


def fields_table(rows: Iterable[tuple[str, str]], *, table_id: str) -> str:
    """A name/value table (one thing's fields): the names head their rows, no header row."""
    body = "".join(f'<tr><th scope="row">{esc(name)}</th><td>{value}</td></tr>'
                   for name, value in rows)
    return f'<table class="fields" id="{esc(table_id)}"><tbody>{body}</tbody></table>'


def owner_cell(owner: str) -> str:
    """An owner (task or job id): kept on one line, never broken inside the id."""
    return f'<code class="id">{esc(owner)}</code>'


def page(title: str, body: str, *, root: str, where: str, read_only: bool,
         refresh: int | None = None) -> str:
    meta = f'<meta http-equiv="refresh" content="{refresh}">' if refresh else ""
    mode = ("read-only" if read_only
            else "clearing enabled (a token is asked for)")
    return (
        "<!doctype html><html lang=en><head><meta charset=utf-8>"
        f"<title>{esc(title)} · taskdedup</title>{meta}"
        '<meta name="viewport" content="width=device-width, initial-scale=1">'
        f"<style>{_CSS}</style></head><body>"
        f"<h1>taskdedup · {esc(title)}</h1>"
        f'<p class="muted">Redis at {esc(where)} · {esc(mode)} · {esc(clock_text(time.time()))}'
        "</p>"
        f"<nav>{link(root, '/', 'overview')}{link(root, '/locks', 'all locks')}"
        f"{link(root, '/fetch', 'processing lists')}"
        f"{link(root, '/api/stats', 'stats (JSON)')}</nav>"
        f"{body}</body></html>"
    )


def lock_rows(root: str, locks: Iterable[Lock], *, extra: Mapping[str, str] | None = None
              ) -> list[list[str]]:
    rows = []
    for lock in locks:
        row = [
            link(root, "/lock", lock.key, key=lock.key),
            esc(lock.task), esc(lock.scope), esc(lock.state), owner_cell(lock.owner),
            esc(ttl_text(lock.ttl_ms)),
        ]
        if extra is not None:
            row.append(esc(extra.get(lock.key, "")))
        rows.append(row)
    return rows


def holder_rows(holders: Iterable[Holder]) -> list[list[str]]:
    """One row per processing list of the reliable fetch: its owner (worker, pid), its
    source queue, how many messages it holds, and the owner's lease (orphans flagged)."""
    rows = []
    for holder in holders:
        lease = ('<span class="warn">lapsed: orphan</span>' if holder.orphan
                 else esc(ttl_text(holder.ttl_ms)))
        who = [esc(holder.worker or holder.owner), esc(holder.pid), owner_cell(holder.owner)]
        for source, size in sorted(holder.lists.items()) or [("", 0)]:
            rows.append([*who, f"<code>{esc(source)}</code>", str(size), lease])
    return rows


def counts_table(root: str, counts: Mapping[tuple[str, str], Mapping[str, int]]) -> str:
    """Counts by (task, scope): each links to exactly that task's locks in that scope."""
    rows = []
    for (task, scope), by_state in counts.items():
        cells = [link(root, "/locks", key_name(task, scope), task=task, scope=scope)]
        for state in STATES:
            n = by_state.get(state, 0)
            cells.append(link(root, "/locks", n, task=task, scope=scope, state=state)
                         if n else "0")
        cells.append(str(sum(by_state.values())))
        rows.append(cells)
    return table(["task", *STATES, "total"], rows, numeric=(1, 2, 3, 4), table_id="by-task",
                 empty="no locks held")


def _rate(value: float | None) -> str:
    return "-" if value is None else f"{value:.1%}"


def stats_table(stats: Mapping[str, TaskStats], window: Mapping[str, Mapping[str, int]],
                window_text: str) -> str:
    rows = []
    # the second call's answers (SPEC §15): a column only when some task counted one
    extra = [n for n in ("waits", "coalesced", "superseded")
             if any(item.second_calls[n] for item in stats.values())]
    for name, item in stats.items():
        recent = window.get(name, {})
        lost, errors = item.lease_lost, item.store_errors
        rows.append([
            esc(name), str(item.accepted), str(item.duplicates), _rate(item.duplicate_rate),
            str(item.retries), str(item.skipped), str(item.released_on_failure),
            _flag(lost, recent.get("lease_lost")), _flag(errors, recent.get("store_errors")),
            *(str(item.second_calls[n]) for n in extra),
        ])
    found = table(
        ["task", "accepted", "duplicates", "dup rate", "retries", "skipped",
         "released on failure", "lease lost", "store errors", *extra],
        rows, numeric=tuple(range(1, 9 + len(extra))), table_id="stats",
        empty="no stats flushed yet (producers and workers flush them every few seconds)",
    )
    if not rows:
        return found
    return found + (
        '<p class="muted" id="stats-note">Counts since the counters began. Lease lost and '
        f"store errors: <code>(+n)</code> are those of the last {esc(window_text)}, in red "
        "while there are any.</p>")


def limits_table(rows: Mapping[str, Mapping[str, int]]) -> str:
    """Per task with limits (SPEC §16): slots in use and calls waiting now, calls put off
    and dropped by a limit (never per key value: keys can be user data)."""
    return table(
        ["task", "slots in use", "waiting", "put off", "dropped"],
        [[esc(name), str(row["slots_in_use"]), str(row["waiting"]), str(row["limited"]),
          str(row["dropped"])] for name, row in rows.items()],
        numeric=(1, 2, 3, 4), table_id="limits", empty="no task with limits in use",
    )


def _flag(total: int, recent: int | None) -> str:
    text = f"{total} (+{recent})" if recent is not None else str(total)
    return f'<span class="warn">{esc(text)}</span>' if recent else esc(text)


# -- the chart ----------------------------------------------------------------------------------


def rate_chart(rates: Mapping[str, Sequence[tuple[float, float | None]]], *, every: float,
               width: int = 760, height: int = 260) -> str:
    """Duplicate rate per task over time, as inline SVG: one line per task (the
    :data:`MAX_SERIES` with the highest mean rate), gaps where a task saw no enqueue."""
    left, top, plot_w, plot_h = 48, 14, width - 48 - 230, height - 14 - 34
    parts = [
        f'<svg id="dup-rate-chart" xmlns="http://www.w3.org/2000/svg" width="{width}" '
        f'height="{height}" viewBox="0 0 {width} {height}" role="img" '
        'aria-labelledby="dup-rate-title" font-family="system-ui,sans-serif" font-size="11">',
        '<title id="dup-rate-title">Duplicate rate per task over time</title>',
        f'<rect x="{left}" y="{top}" width="{plot_w}" height="{plot_h}" fill="#fafafa" '
        'stroke="#ccc"/>',
    ]
    for fraction in (0.0, 0.25, 0.5, 0.75, 1.0):
        y = top + plot_h * (1 - fraction)
        parts.append(f'<line x1="{left}" x2="{left + plot_w}" y1="{y:.1f}" y2="{y:.1f}" '
                     'stroke="#e2e2e2"/>')
        parts.append(f'<text x="{left - 6}" y="{y + 4:.1f}" text-anchor="end" fill="#555">'
                     f"{fraction:.0%}</text>")
    chosen = _chosen_series(rates)
    times = [t for series in rates.values() for t, _ in series]
    if not times or not chosen:
        message = (f"collecting samples: one every {every:g}s, a point per interval with "
                   "enqueues" if not times else "no enqueues in the samples kept")
        parts.append(f'<text x="{left + plot_w / 2}" y="{top + plot_h / 2}" '
                     f'text-anchor="middle" fill="#666" class="empty">{esc(message)}</text>')
        parts.append("</svg>")
        return "".join(parts)
    start, end = min(times), max(times)
    # Producers and workers flush their counts every few seconds (stats.DEFAULT_INTERVAL): a
    # sample taken between two flushes sees no change. A line goes on across such samples and
    # breaks only where no enqueue was flushed for longer than a flush and a sample.
    bridge = every + DEFAULT_INTERVAL
    if end - start < every:
        start = end - every
    span = end - start

    def xy(t: float, rate: float) -> str:
        return (f"{left + plot_w * (t - start) / span:.1f},"
                f"{top + plot_h * (1 - rate):.1f}")

    for index, task in enumerate(chosen):
        color = PALETTE[index]
        points = rates[task]
        run: list[str] = []
        last: float | None = None
        for t, rate in [*points, (end + bridge + 1, 0.0)]:
            if rate is None:  # no enqueue flushed in this interval
                continue
            if last is None or t - last <= bridge:
                run.append(xy(t, rate))
                last = t
                continue
            if len(run) > 1:
                parts.append(f'<polyline class="series" data-task="{esc(task)}" fill="none" '
                             f'stroke="{color}" stroke-width="2" points="{" ".join(run)}"/>')
            for point in run:
                cx, cy = point.split(",")
                parts.append(f'<circle class="point" data-task="{esc(task)}" cx="{cx}" '
                             f'cy="{cy}" r="2.5" fill="{color}"/>')
            run, last = [xy(t, rate)], t
        legend_y = top + 12 + index * 18
        parts.append(f'<rect x="{left + plot_w + 16}" y="{legend_y - 9}" width="12" '
                     f'height="10" fill="{color}"/>')
        parts.append(f'<text x="{left + plot_w + 34}" y="{legend_y}" class="legend">'
                     f"{esc(_short(task))}</text>")
    parts.append(f'<text x="{left}" y="{height - 12}" fill="#555">{esc(clock_text(start))}'
                 "</text>")
    parts.append(f'<text x="{left + plot_w}" y="{height - 12}" text-anchor="end" '
                 f'fill="#555">{esc(clock_text(end))}</text>')
    parts.append("</svg>")
    return "".join(parts)


def _chosen_series(rates: Mapping[str, Sequence[tuple[float, float | None]]]) -> list[str]:
    scored = []
    for task, series in rates.items():
        values = [rate for _, rate in series if rate is not None]
        if values:
            scored.append((-sum(values) / len(values), task))
    return [task for _, task in sorted(scored)[:MAX_SERIES]]


def _short(task: str, limit: int = 32) -> str:
    return task if len(task) <= limit else "…" + task[-(limit - 1):]
