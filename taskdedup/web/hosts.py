"""The dashboard answers only to the names it is served under (SPEC §8): DNS rebinding.

A page the operator visits can re-point its own name at 127.0.0.1 and then read the loopback
dashboard as same-origin; its requests still carry the page's name in ``Host``. So a request
whose ``Host`` is not a loopback name (``localhost``, ``127.0.0.1`` and the other loopback
addresses, ``[::1]``; any port) or a name allowed explicitly is refused with 400 before any
route runs. Plain ASGI, not Starlette's ``TrustedHostMiddleware``: that one reads an IPv6
``Host`` (``[::1]:8077``) differently across the Starlette releases taskdedup supports, and
redirects ``www.`` names.
"""

from __future__ import annotations

import ipaddress
from collections.abc import Iterable
from typing import Final

from starlette.datastructures import Headers
from starlette.responses import PlainTextResponse
from starlette.types import ASGIApp, Receive, Scope, Send

__all__ = ["ANY_HOST", "HostGuard", "host_name", "is_loopback", "normalize_host"]

ANY_HOST: Final = "*"
"""In ``allowed_hosts``: answer any ``Host`` (behind a proxy that checks it already)."""


def normalize_host(name: str) -> str:
    """A host name or address as compared: lower case, no brackets, no trailing dot."""
    name = name.strip().lower()
    if name.startswith("[") and name.endswith("]"):
        name = name[1:-1]
    return name[:-1] if name.endswith(".") else name


def host_name(header: str) -> str | None:
    """The host of a ``Host`` header without its port, normalized; None when malformed."""
    header = header.strip()
    if header.startswith("["):
        closing = header.find("]")
        if closing < 0 or (header[closing + 1:] and not _port(header[closing + 1:])):
            return None
        name = header[1:closing]
        try:
            ipaddress.IPv6Address(name)
        except ValueError:
            return None
        return normalize_host(name)
    name, sep, port = header.rpartition(":")
    if not sep:
        name = header
    elif not port.isdigit():
        return None
    if not name or any(c in name for c in "/\\@ []:"):
        return None
    return normalize_host(name)


def _port(text: str) -> bool:
    return text.startswith(":") and text[1:].isdigit()


def is_loopback(name: str) -> bool:
    """Whether ``name`` (normalized) is a loopback name or address."""
    if name == "localhost":
        return True
    try:
        return ipaddress.ip_address(name).is_loopback
    except ValueError:
        return False


class HostGuard:
    """ASGI middleware: 400 for an HTTP request whose ``Host`` is not loopback nor allowed."""

    def __init__(self, app: ASGIApp, allowed_hosts: Iterable[str] = ()) -> None:
        self.app = app
        hosts = list(allowed_hosts)
        self.allow_any = ANY_HOST in hosts
        self.allowed = frozenset(normalize_host(h) for h in hosts if h != ANY_HOST)

    def allows(self, header: str | None) -> bool:
        if self.allow_any:
            return True
        name = host_name(header) if header else None
        return name is not None and (is_loopback(name) or name in self.allowed)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or self.allows(
            Headers(scope=scope).get("host")
        ):
            await self.app(scope, receive, send)
            return
        response = PlainTextResponse(
            "taskdedup web answers only to loopback names and the hosts it was told about: "
            "start it with --allowed-host NAME (create_app(allowed_hosts=[...]) when mounted)",
            status_code=400,
        )
        await response(scope, receive, send)
