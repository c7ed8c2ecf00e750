"""The two stored forms of a lock's owner: its task id as text, or compact.

A lock value ends with the task id that owns it. A UUID task id (Celery's and RQ's default)
can be stored compact: ``~`` and the UUID's 16 bytes in 22 base64url characters, 23 bytes
instead of 36. On Redis 6.2 that moves a queued lock's value into a smaller allocation
(16 B less per key, level with celery-singleton; see docs/explanation/performance.md).

Every reader takes both forms (the Lua scripts' ``same``/``owner_text``, :func:`owner_text`
here), so stores that write either share every lock. Writing compact is a
:class:`~taskdedup.stores.redis.RedisStore` option (``compact_owners``), off by default in
this release: a process of an earlier release reads a compact owner as another task's and
would take its own message for a duplicate. Turn it on once every producer and worker runs
a release that reads both (this one or later).
"""

from __future__ import annotations

import base64
import binascii
import os
import uuid

from ..exceptions import ConfigurationError

__all__ = ["COMPACT_MARK", "ENV", "compact_owner", "compact_setting", "looks_compact",
           "owner_text"]

ENV = "TASKDEDUP_COMPACT_OWNERS"
"""The environment variable that turns compact owners on for stores built from a URL or a
client by the Celery and RQ integrations (``1``/``true``/``yes``/``on``)."""

_TRUE = frozenset({"1", "true", "yes", "on"})
_FALSE = frozenset({"", "0", "false", "no", "off"})

COMPACT_MARK = "~"
"""The first character of a compact owner."""

_COMPACT_LEN = 23


def compact_setting(value: object = None) -> bool:
    """Whether stores write compact owners: ``value`` (a bool, or a string as :data:`ENV`
    takes it) when not None, else :data:`ENV`, else no.

    Raises:
        ConfigurationError: a value that is neither yes nor no.
    """
    if value is None:
        value = os.environ.get(ENV, "")
    if isinstance(value, bool):
        return value
    text = str(value).strip().lower()
    if text in _TRUE or text in _FALSE:
        return text in _TRUE
    raise ConfigurationError(
        f"compact owners must be yes or no ({ENV}=1 or 0, taskdedup_compact_owners=True or "
        f"False), got {value!r}")


def compact_owner(owner: str) -> str:
    """``owner`` in compact form when it is a UUID's canonical text (lowercase, dashed);
    any other owner as it is (ids that are not UUIDs are always stored as given)."""
    if len(owner) != 36 or owner[8] != "-":
        return owner
    try:
        value = uuid.UUID(owner)
    except ValueError:
        return owner
    if str(value) != owner:  # upper case, braces, no dashes: keep the caller's text
        return owner
    return COMPACT_MARK + base64.urlsafe_b64encode(value.bytes)[:22].decode("ascii")


def owner_text(owner: str) -> str:
    """The task id ``owner`` names: a compact owner's UUID as text, any other as it is."""
    if len(owner) != _COMPACT_LEN or owner[0] != COMPACT_MARK:
        return owner
    raw = _decode(owner)
    return owner if raw is None else str(uuid.UUID(bytes=raw))


def looks_compact(owner: str) -> bool:
    """Whether ``owner`` has the compact form (a task id that does would be read as the
    UUID it encodes, so the store refuses it as an owner)."""
    return len(owner) == _COMPACT_LEN and owner[0] == COMPACT_MARK and _decode(owner) is not None


def _decode(owner: str) -> bytes | None:
    digits = owner[1:]
    try:
        raw = base64.urlsafe_b64decode(digits + "==")
    except (binascii.Error, ValueError):
        return None
    # b64decode skips characters outside the alphabet: only an exact round trip counts
    if len(raw) != 16 or base64.urlsafe_b64encode(raw)[:22].decode("ascii") != digits:
        return None
    return raw
