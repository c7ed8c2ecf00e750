"""``taskdedup web``: serve the dashboard with uvicorn.

Importable without Starlette or uvicorn (``taskdedup --help`` lists ``web``); the command says
what to install when they are missing.
"""

from __future__ import annotations

import secrets

import click

from ..cli import CliError, _Env
from ..exceptions import ConfigurationError
from . import INSTALL_HINT, MIN_TOKEN_LENGTH

__all__ = ["web"]


@click.command("web")
@click.option("--url", envvar="TASKDEDUP_URL", metavar="URL", hidden=True,
              help="Redis URL (default: taskdedup's --url, else $TASKDEDUP_URL).")
@click.option("--host", default="127.0.0.1", show_default=True,
              help="Address to bind; anything but loopback exposes the dashboard.")
@click.option("--port", type=click.IntRange(0, 65535), default=8077, show_default=True,
              metavar="PORT", help="Port to listen on.")
@click.option("--allowed-host", "allowed_hosts", multiple=True, metavar="NAME",
              help="Also answer requests for this host name (repeatable); loopback names and "
                   "the --host address always work, any other Host header gets 400.")
@click.option("--allow-clear", is_flag=True,
              help="Enable clearing a lock from its page; requests must carry the token.")
@click.option("--token", envvar="TASKDEDUP_WEB_TOKEN", metavar="TOKEN",
              help="The clear token (default $TASKDEDUP_WEB_TOKEN; with --allow-clear and no "
                   "token, one is generated and printed once).")
@click.option("--sample-every", type=click.FloatRange(min=0.1), default=10.0,
              show_default=True, metavar="SECONDS",
              help="Seconds between two samples of the stats (the chart's resolution).")
@click.option("--keep", type=click.IntRange(min=2), default=360, show_default=True,
              help="Samples kept in memory (the chart spans keep x sample-every seconds).")
@click.pass_obj
def web(
    env: _Env, url: str | None, host: str, port: int, allowed_hosts: tuple[str, ...],
    allow_clear: bool, token: str | None, sample_every: float, keep: int,
) -> None:
    """Serve a read-only dashboard of the locks and stats (taskdedup[web]).

    Locks by task and state with TTLs, the soonest to expire and the oldest, one lock's
    detail, duplicate rate per task over time, lost leases and store errors. Binds
    127.0.0.1 unless --host says otherwise. With --allow-clear a lock can be cleared from its
    page with the token; without --token one is generated and printed once, on stderr.
    It answers only to loopback names, the --host address and each --allowed-host (a
    DNS-rebinding page gets 400). The locks are read from taskdedup's --url (given before
    the command: taskdedup --url URL web), else $TASKDEDUP_URL.
    """
    try:
        import uvicorn

        from . import create_app
    except ImportError:
        raise CliError(f"taskdedup web needs Starlette and uvicorn: {INSTALL_HINT}") from None
    url = url or env.url
    if not url:
        raise CliError("no Redis URL: pass --url or set TASKDEDUP_URL")
    if token is not None and not allow_clear:
        token = None  # a token alone enables nothing
    if allow_clear and token is None:
        token = secrets.token_urlsafe(24)
        click.echo(f"taskdedup web: clearing enabled; the token (shown only now): {token}",
                   err=True)
    elif allow_clear and token is not None and len(token) < MIN_TOKEN_LENGTH:
        raise CliError(f"--token must have at least {MIN_TOKEN_LENGTH} characters")
    try:
        app = create_app(url, prefix=env.prefix, allow_clear=allow_clear, token=token,
                         sample_every=sample_every, keep=keep,
                         allowed_hosts=[host, *allowed_hosts])
    except ConfigurationError as exc:
        raise CliError(str(exc)) from None
    except ImportError as exc:
        raise CliError(str(exc)) from None
    from .hosts import is_loopback  # starlette is there: create_app imported it

    if not is_loopback(host):
        click.echo(f"taskdedup web: listening on {host}, not loopback: anyone who reaches it "
                   "sees task names and lock owners; it answers only to the names given with "
                   "--allowed-host", err=True)
    shown = f"[{host}]" if ":" in host else host
    click.echo(f"taskdedup web: http://{shown}:{port}/ "
               f"({'clearing enabled' if allow_clear else 'read-only'})", err=True)
    uvicorn.run(app, host=host, port=port, log_level="info", server_header=False,
                proxy_headers=False)
