"""What a gated message carries: the ``taskdedup`` header, read on both sides.

The caller puts ``{"task": name, "key": lock key}`` (or ``"off": 1`` for a bypassed call) in
the message headers, so the worker never recomputes the identity; a call with an explicit key
(``dedup_key=``) adds ``"check"``, the argument digest its reservation holds, so the worker's
claim expects that value (a hint: a wrong one costs a round trip, never an outcome). The
worker marks the request
with the lock it claimed. A duplicate that is published anyway, because it continues a
workflow, is *marked*: ``"dup"`` names the original, ``"wf"`` says whether its workflow ends in
an error; the worker ends it without running the body.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ..core import check_hint

__all__ = [
    "COMPLETED_ATTR", "HEADER", "RELEASED_ATTR", "RUNNING_ATTR", "SKIPPED", "SKIP_ATTR",
    "STATE_ATTR", "TRACED_ATTR", "carried_check", "carried_key", "is_off", "marked", "mark",
    "request_header",
]

HEADER = "taskdedup"
"""Message header carrying ``{"task": name, "key": lock key}`` or ``{"task": name, "off": 1}``."""

STATE_ATTR = "_taskdedup"  # on the request: the claimed lock key, or SKIPPED
SKIPPED = "skipped"
SKIP_ATTR = "_taskdedup_skipped"  # on the request: the result of a skipped duplicate
RUNNING_ATTR = "_taskdedup_running"  # on the request: the token of taskdedup.running.enter
TRACED_ATTR = "_taskdedup_traced"  # on the request: before_start ran, __call__ is the tracer's
COMPLETED_ATTR = "_taskdedup_completed"  # on the request: __call__ completed its lock
RELEASED_ATTR = "_taskdedup_released"  # on the request: __call__ released it (a failure)
AHEAD_ATTR = "_taskdedup_ahead"  # on the request: its claim rode ahead, moments before the body
_DUPLICATE_OF, _WORKFLOW = "dup", "wf"


def request_header(request: Any) -> Any:
    """The ``taskdedup`` header of a worker's request (a message header or a request field)."""
    headers = getattr(request, "headers", None)
    if headers and HEADER in headers:
        return headers[HEADER]
    return getattr(request, HEADER, None)


def carried_key(raw: Any, task_name: str) -> str | None:
    """The lock key the caller put in the header, if it names this task and is a ``str``
    (whether this task could have made it is :meth:`~taskdedup.core.Deduplicator.trusted_key`'s
    question)."""
    if isinstance(raw, Mapping) and raw.get("task") == task_name:
        key = raw.get("key")
        if isinstance(key, str) and key:
            return key
    return None


def carried_check(raw: Any, task_name: str) -> str:
    """The argument check the caller put in the header (32 hex digits), or "" (none, or not
    one: a forged or malformed field is a hint that is dropped)."""
    if isinstance(raw, Mapping) and raw.get("task") == task_name:
        return check_hint(raw.get("check"))
    return ""


def is_off(raw: Any, task_name: str) -> bool:
    """Whether the caller bypassed dedup for this call (``dedup=False``)."""
    return isinstance(raw, Mapping) and raw.get("task") == task_name and bool(raw.get("off"))


def mark(raw: Mapping[str, Any], existing_id: str | None, workflow: bool) -> dict[str, Any]:
    """The header of a duplicate published anyway (it continues a workflow); ``existing_id``
    None when no id is known (an approximate window remembers the identity, not its id)."""
    return {**raw, _DUPLICATE_OF: existing_id or "", _WORKFLOW: int(workflow)}


def marked(raw: Any, task_name: str) -> tuple[str | None, bool] | None:
    """``(original's id or None, ends its workflow)`` for a marked duplicate of ``task_name``."""
    if isinstance(raw, Mapping) and raw.get("task") == task_name and _DUPLICATE_OF in raw:
        return str(raw[_DUPLICATE_OF] or "") or None, bool(raw.get(_WORKFLOW))
    return None
