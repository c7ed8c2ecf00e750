"""``taskdedup web``: a dashboard of the locks and counters in Redis, as an ASGI app.

Pages: locks by task and state with their TTLs, the soonest to expire and the oldest, one
lock's detail (key, task, state, owner id, TTL), the duplicate rate per task over time (an
inline SVG chart), lost leases and store errors; and the same as JSON under ``/api/``.
Locks are found with SCAN and a cursor, never KEYS. Keys hold digests, never argument
values, and nothing here shows more than the key, the state and the owner's task id.

It answers only to loopback names (``localhost``, ``127.0.0.1``, ``[::1]``) and the hosts
it is given (``allowed_hosts``, ``taskdedup web --allowed-host``): any other ``Host`` gets
400, so a DNS-rebinding page cannot read it. A clear request's body is refused (413) past
16 KB, before it is read further.

Read-only by default: ``POST /clear`` (and ``/api/clear``) answer 403 unless the app was
made with ``allow_clear=True`` and the request carries the token (header
``X-Taskdedup-Token`` or form field ``token``). Clearing is fenced: it deletes a lock only
while the owner shown on the page still holds it.

Mount it in an existing ASGI app::

    from starlette.routing import Mount
    from taskdedup.web import create_app

    app.mount("/taskdedup", create_app("redis://localhost:6379/0",
                                       allowed_hosts=["ops.example.com"]))  # FastAPI / Starlette

Needs Starlette (``pip install 'taskdedup[web]'``, which also brings uvicorn for the
``taskdedup web`` command); importing this package does not import it.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Final

import redis

from ..core import DEFAULT_PREFIX
from ..exceptions import ConfigurationError

if TYPE_CHECKING:
    from starlette.applications import Starlette

__all__ = ["INSTALL_HINT", "MIN_TOKEN_LENGTH", "create_app", "require_web"]

INSTALL_HINT: Final = "pip install 'taskdedup[web]'"
MIN_TOKEN_LENGTH: Final = 16


def require_web(*, server: bool = False) -> None:
    """Raise ImportError with the install command when Starlette (or uvicorn) is missing."""
    try:
        import starlette  # noqa: F401

        if server:
            import uvicorn  # noqa: F401
    except ImportError as exc:
        raise ImportError(f"taskdedup web needs Starlette and uvicorn: {INSTALL_HINT}") from exc


def create_app(
    client_or_url: redis.Redis | str,
    *,
    prefix: str = DEFAULT_PREFIX,
    allow_clear: bool = False,
    token: str | None = None,
    sample_every: float = 10.0,
    keep: int = 360,
    page_size: int = 200,
    scan_cap: int = 10_000,
    allowed_hosts: Sequence[str] = (),
) -> Starlette:
    """The dashboard as a Starlette (ASGI) application.

    Args:
        client_or_url: a ``redis.Redis`` client, or a URL (``redis://``, ``rediss://``,
            ``unix://``, ``valkey://``).
        prefix: the key prefix of the Deduplicators to show (``taskdedup`` by default).
        allow_clear: enable ``POST /clear``; needs ``token``.
        token: the secret a clear request must carry, at least 16 characters.
        sample_every: seconds between two samples of the stats (the chart's resolution).
        keep: how many samples are kept (bounded memory): ``keep * sample_every`` seconds.
        page_size: about how many locks a page of ``/locks`` shows.
        scan_cap: the overview counts over at most about this many keys.
        allowed_hosts: the names (or addresses) it answers to besides the loopback ones,
            e.g. ``["ops.example.com"]`` when mounted in an app served under that name;
            ``["*"]`` answers any ``Host`` (only behind a proxy that checks it). Any other
            ``Host`` gets 400 (DNS rebinding).

    Raises:
        ConfigurationError: ``allow_clear`` without a token, a short token, a bad URL, an
            allowed host that is not a non-empty string.
        ImportError: Starlette is not installed (the message says what to install).
    """
    require_web()
    if allow_clear and not token:
        raise ConfigurationError(
            "allow_clear=True needs a token: clear requests must carry it "
            "(taskdedup web --allow-clear generates one when --token is not given)"
        )
    if token is not None and len(token) < MIN_TOKEN_LENGTH:
        raise ConfigurationError(f"the clear token must have at least {MIN_TOKEN_LENGTH} "
                                 "characters (e.g. python -c 'import secrets; "
                                 "print(secrets.token_urlsafe())')")
    if not prefix or ":" in prefix:
        raise ConfigurationError("prefix must be a non-empty string without ':'")
    if isinstance(allowed_hosts, str) or not all(
        isinstance(host, str) and host.strip() for host in allowed_hosts
    ):
        raise ConfigurationError(
            f"allowed_hosts must be a list of host names, got {allowed_hosts!r}"
        )
    if isinstance(client_or_url, str):
        from ..stores.redis import RedisStore

        client = RedisStore.from_url(client_or_url).client
    else:
        client = client_or_url
    from .app import build_app

    return build_app(
        client, prefix=prefix, allow_clear=allow_clear, token=token if allow_clear else None,
        sample_every=sample_every, keep=keep, page_size=page_size, scan_cap=scan_cap,
        allowed_hosts=list(allowed_hosts),
    )
