"""``taskdedup outbox relay`` and ``taskdedup outbox status``: the SQLAlchemy outbox, operated.

It lives in ``taskdedup/sql/`` rather than in the framework-free ``taskdedup/outbox/``
because both commands operate this tier's table through SQLAlchemy, with the same ``--url``
/ ``TASKDEDUP_SQL_URL`` and the same error reporting as ``taskdedup sql init`` (they share
:mod:`taskdedup.sql.cli`'s helpers); the Django app runs the same relay loop
(:class:`taskdedup.outbox.Relay`) from its own management command.

Importable without SQLAlchemy, Celery or RQ (``taskdedup --help`` lists ``outbox``); the
commands say what to install when something is missing. The relay publishes Celery rows with
the app of ``-A/--app`` (or ``CELERY_APP``) and RQ rows on ``RQ_REDIS_URL``; the lock store
is the one the app or the queue would use (``TASKDEDUP_URL``, which the global ``--url`` sets).
"""

from __future__ import annotations

import json
import os
import signal
import threading
from datetime import UTC, datetime
from typing import Any

import click

from .cli import _URL_HELP, _database, _engine, _fail

__all__ = ["outbox"]


@click.group("outbox")
def outbox() -> None:
    """The transactional outbox (taskdedup.sql.outbox): relay what was committed but not
    published, show the backlog."""


def _celery_app(name: str) -> Any:
    """The Celery app of ``-A``, loaded as ``taskdedup key -A`` loads it."""
    try:
        from ..celery.load import load_app
    except ImportError:
        raise click.ClickException(
            "-A/--app needs Celery: pip install 'taskdedup[celery]'") from None
    from ..exceptions import ConfigurationError

    try:
        return load_app(name)
    except ConfigurationError as exc:
        raise click.ClickException(str(exc)) from None


def _rq_connection(url: str) -> Any:
    try:
        import redis
        import rq  # noqa: F401  (the adapter needs it)
    except ImportError:
        raise click.ClickException("RQ_REDIS_URL needs RQ: pip install 'taskdedup[rq]'") from None
    try:
        return redis.Redis.from_url(url)
    except ValueError as exc:
        raise click.ClickException(f"RQ_REDIS_URL is not a Redis URL: {exc}") from None


@outbox.command("relay")
@click.option("--url", envvar="TASKDEDUP_SQL_URL", help=_URL_HELP)
@click.option("-A", "--app", "app_name", envvar="CELERY_APP", metavar="MODULE",
              help="The Celery app that publishes Celery rows (default: CELERY_APP).")
@click.option("--rq-url", envvar="RQ_REDIS_URL", metavar="URL",
              help="The RQ Redis that RQ rows are enqueued on (default: RQ_REDIS_URL).")
@click.option("--grace", type=click.FloatRange(min=0), default=None,
              help="Seconds a row waits before the relay takes it (default 10): its producer "
                   "publishes it itself right after the commit.")
@click.option("--batch", type=click.IntRange(min=1), default=None,
              help="Rows per batch (default 100).")
@click.option("--poll", type=click.FloatRange(min=0.01), default=None,
              help="Seconds to wait when there is nothing to do (default 1).")
@click.option("--once", is_flag=True, help="Run one batch and exit.")
@click.pass_context
def relay_command(ctx: click.Context, url: str | None, app_name: str | None,
                  rq_url: str | None, grace: float | None, batch: int | None,
                  poll: float | None, once: bool) -> None:
    """Publish the rows committed but not published (their producer died, or the broker was
    down), until SIGTERM/SIGINT (the batch under way finishes; exit 0)."""
    engine = _engine(url)
    from sqlalchemy.exc import SQLAlchemyError

    from ..exceptions import ConfigurationError
    from ..outbox import DEFAULT_BATCH, DEFAULT_GRACE, DEFAULT_POLL, Publisher, Relay
    from .outbox import SqlRows, backlog

    store_url = getattr(ctx.obj, "url", None)
    if store_url:  # the global --url: the lock store the app and the queues use
        os.environ["TASKDEDUP_URL"] = store_url
    if not app_name and not rq_url:
        raise click.ClickException(
            "nothing to publish with: pass -A/--app MODULE (or set CELERY_APP) for Celery rows "
            "and/or set RQ_REDIS_URL (--rq-url) for RQ rows")
    publisher = Publisher(celery_app=_celery_app(app_name) if app_name else None,
                          rq_connection=_rq_connection(rq_url) if rq_url else None)
    try:
        backlog(engine)  # the table is there and the database answers: else exit 1 now
        relay = Relay(SqlRows(engine), publisher,
                      batch=DEFAULT_BATCH if batch is None else batch,
                      grace=DEFAULT_GRACE if grace is None else grace,
                      poll=DEFAULT_POLL if poll is None else poll)
    except (SQLAlchemyError, ConfigurationError) as exc:
        engine.dispose()
        raise _fail(engine, exc) from None
    if once:
        try:
            taken = relay.run_once()
        except (SQLAlchemyError, ConfigurationError) as exc:
            raise _fail(engine, exc) from None
        finally:
            engine.dispose()
        click.echo(f"took {taken} row{'' if taken == 1 else 's'}")
        return
    stop = threading.Event()

    def _stop(signum: int, frame: Any) -> None:
        stop.set()

    previous = {sig: signal.signal(sig, _stop) for sig in (signal.SIGTERM, signal.SIGINT)}
    click.echo(f"taskdedup outbox relay on {engine.url.render_as_string(hide_password=True)} "
               f"(grace {relay.grace:g}s, batch {relay.batch}); SIGTERM/SIGINT to stop",
               err=True)
    try:
        relay.run(stop)
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        engine.dispose()
    click.echo("taskdedup outbox relay stopped", err=True)


def _printable(text: str) -> str:
    """Text from the database as a terminal should see it: control characters escaped."""
    return "".join(c if c.isprintable() else repr(c)[1:-1] for c in text)


def _age(seconds: float) -> str:
    if seconds < 120:
        return f"{seconds:.0f}s"
    if seconds < 7200:
        return f"{seconds / 60:.0f}m"
    return f"{seconds / 3600:.1f}h"


@outbox.command("status")
@click.option("--url", envvar="TASKDEDUP_SQL_URL", help=_URL_HELP)
@click.option("--json", "as_json", is_flag=True, help="Print JSON.")
def status_command(url: str | None, as_json: bool) -> None:
    """The backlog per target (rows, the oldest row's age, failing rows, the last error);
    exit 0 whatever it holds, 1 when the database or the table cannot be read."""
    with _database(url) as engine:
        from .outbox import backlog

        backlogs = backlog(engine)
    now = datetime.now(UTC)
    total = sum(b.rows for b in backlogs)
    ages = [max(0.0, (now - b.oldest).total_seconds()) for b in backlogs]
    if as_json:
        click.echo(json.dumps({"rows": total, "oldest_age_s": round(max(ages), 3) if ages
                               else None, "failing": sum(b.failing for b in backlogs),
                               "targets": [b.as_dict(now) for b in backlogs]}))
        return
    if not backlogs:
        click.echo("the outbox is empty")
        return
    click.echo(f"{total} row{'' if total == 1 else 's'}, the oldest {_age(max(ages))} old")
    header = ("KIND", "TARGET", "ROWS", "OLDEST", "FAILING", "ATTEMPTS", "LAST ERROR")
    lines = [header] + [
        (b.kind, _printable(b.target), str(b.rows), _age(age), str(b.failing),
         str(b.attempts), _printable(b.last_error or "-"))
        for b, age in zip(backlogs, ages, strict=True)
    ]
    widths = [max(len(line[i]) for line in lines) for i in range(len(header) - 1)]
    for line in lines:
        cells = [cell.ljust(width) for cell, width in zip(line, widths, strict=False)]
        click.echo("  ".join([*cells, line[-1]]))
