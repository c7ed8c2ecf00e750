"""``taskdedup sql init`` and ``taskdedup sql prune``: the durable tier's tables, operated.

Importable without SQLAlchemy (``taskdedup --help`` lists ``sql``); the commands say what to
install when it is missing. ``--url`` is a SQLAlchemy URL (default ``TASKDEDUP_SQL_URL``); a
bare ``postgresql://`` uses psycopg 3.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import click

from . import INSTALL_HINT, require_sqlalchemy

__all__ = ["sql"]

_URL_HELP = ("SQLAlchemy database URL, e.g. postgresql://user@host/db or sqlite:///app.db "
             "(default: TASKDEDUP_SQL_URL).")


def _engine(url: str | None) -> Any:
    if not url:
        raise click.ClickException("no database URL: pass --url or set TASKDEDUP_SQL_URL")
    try:
        require_sqlalchemy()
    except ImportError as exc:
        raise click.ClickException(str(exc)) from None
    from sqlalchemy.exc import ArgumentError

    from ..exceptions import ConfigurationError
    from .admin import engine_from_url

    try:
        return engine_from_url(url)
    except ConfigurationError as exc:
        raise click.ClickException(str(exc)) from None
    except ArgumentError as exc:
        raise click.ClickException(f"not a database URL: {exc}") from None
    except ImportError as exc:  # the dialect's driver
        hint = "pip install 'taskdedup[sql,postgres]'" if "psycopg" in str(exc) else INSTALL_HINT
        raise click.ClickException(f"no driver for this URL ({exc}): {hint}") from None


def _fail(engine: Any, exc: Exception) -> click.ClickException:
    return click.ClickException(
        f"{engine.url.render_as_string(hide_password=True)}: {type(exc).__name__}: "
        f"{str(exc).splitlines()[0] if str(exc) else ''}"
    )


@contextmanager
def _database(url: str | None) -> Iterator[Any]:
    """The engine of ``url`` for one command, disposed of at the end; a database error (or a
    table that is not taskdedup's) becomes a one-line ClickException naming the URL."""
    engine = _engine(url)
    from sqlalchemy.exc import SQLAlchemyError

    from ..exceptions import ConfigurationError

    try:
        yield engine
    except (SQLAlchemyError, ConfigurationError) as exc:
        raise _fail(engine, exc) from None
    finally:
        engine.dispose()


@click.group("sql")
def sql() -> None:
    """The durable tier's table (taskdedup.sql): create it, prune expired rows."""


@sql.command("init")
@click.option("--url", envvar="TASKDEDUP_SQL_URL", help=_URL_HELP)
def init_command(url: str | None) -> None:
    """Create the taskdedup_effects and taskdedup_outbox tables and their indexes (does
    nothing if they exist)."""
    with _database(url) as engine:
        from .admin import create_tables
        from .schema import OUTBOX_TABLE_NAME, TABLE_NAME

        created = create_tables(engine)
    click.echo(f"created {', '.join(created)}" if created else
               f"{TABLE_NAME} and {OUTBOX_TABLE_NAME} exist: nothing to do")


@sql.command("prune")
@click.option("--url", envvar="TASKDEDUP_SQL_URL", help=_URL_HELP)
@click.option("--batch", type=click.IntRange(min=1), default=1000, show_default=True,
              help="Rows deleted per transaction.")
def prune_command(url: str | None, batch: int) -> None:
    """Delete the rows past their expiry, in batches of short transactions."""
    with _database(url) as engine:
        from .admin import prune

        deleted = prune(engine, batch=batch)
    click.echo(f"deleted {deleted} expired row{'' if deleted == 1 else 's'}")
