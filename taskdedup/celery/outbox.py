"""The outbox's Celery adapter: a task call packed into an envelope, and published again.

The body records the task's name and the call — ``args``, ``kwargs`` and the options
(queue, routing, eta, expires, priority, headers, ``dedup_key``, ...) — serialized with the
task's own serializer (``json`` by default; a binary one such as pickle is base64 in the JSON
body). A countdown is stored as the absolute eta it stands for, and a relative ``expires`` as
its moment, so a late publish by the relay does not push them further.

Publishing goes through :meth:`DedupTask.apply_async` with the row's id as task id and the
:data:`~taskdedup.celery.task.OUTBOX` option: the gate of a fresh call, except that the id's
own queued or running lock lets a copy through (the worker runs one of them: SPEC §5), and
its own done or finished lock means the call ran already (nothing is sent).
"""

from __future__ import annotations

import json
from datetime import UTC, datetime, timedelta
from typing import Any, Final

from celery import Celery
from celery.canvas import Signature
from kombu.serialization import dumps, loads, prepare_accept_content

from ..events import logger
from ..exceptions import ConfigurationError, DuplicateTaskError
from ..outbox.envelope import CELERY, MAX_TARGET, Envelope, b64decode, b64encode, new_id
from ..policy import Policy, is_disabled
from .config import get_deduplicator
from .task import OUTBOX, DedupTask

__all__ = ["pack", "publish"]

VERSION: Final = 1
_REFUSED_OPTIONS: Final = frozenset({"producer", "connection", "publisher", "router"})


def _task_of(target: Any) -> tuple[Any, tuple[Any, ...], dict[str, Any], dict[str, Any]]:
    """The task, args, kwargs and options of a task or a single task's signature."""
    if isinstance(target, Signature):
        if target.get("subtask_type") or not isinstance(target.task, str):
            raise ConfigurationError(
                "outbox.add(target, ...) takes one task's signature, not a chain, group or "
                "chord: add each task, or a task that starts the workflow"
            )
        return (target.type, tuple(target.args or ()), dict(target.kwargs or {}),
                dict(target.options or {}))
    return target, (), {}, {}


def _policy(task: Any, override: Any) -> Policy:
    """The task's dedup policy for this call, or ConfigurationError: the outbox publishes at
    least once, and only the policy makes a second publish of a row run once."""
    name = getattr(task, "name", type(task).__name__)
    policy = task._call_policy(override) if isinstance(task, DedupTask) else None
    if policy is None:
        raise ConfigurationError(
            f"outbox.add: {name} has no dedup policy (declare it with base=DedupTask, and do "
            "not pass dedup=False): the outbox publishes a committed call at least once (the "
            "relay publishes again what a dead producer may have sent), and only taskdedup's "
            "gate and worker guard make a second publish of the same id run once"
        )
    if not policy.mode.gates_execution:
        raise ConfigurationError(
            f"outbox.add: {name} uses mode={policy.mode.value!r}, whose worker does not guard "
            "the execution: a row published twice would run twice; use until_expired (the "
            "default), until_executed or while_executing"
        )
    return policy


def _moment(value: Any, field: str) -> str:
    if isinstance(value, datetime):
        return (value if value.tzinfo else value.replace(tzinfo=UTC)).isoformat()
    if isinstance(value, str):
        datetime.fromisoformat(value)  # refused now, not when it is published
        return value
    raise ConfigurationError(f"outbox.add: {field} must be a datetime or ISO 8601 text, "
                             f"not {type(value).__name__}")


def _options(options: dict[str, Any], now: datetime) -> dict[str, Any]:
    """The options as they travel: countdown and a relative expires made absolute."""
    refused = sorted(_REFUSED_OPTIONS & set(options))
    if refused:
        raise ConfigurationError(f"outbox.add: the option(s) {', '.join(refused)} belong to "
                                 "this process and cannot be stored with the call")
    options = {k: v for k, v in options.items() if v is not None}
    countdown = options.pop("countdown", None)
    if countdown is not None:
        if "eta" in options:
            raise ConfigurationError("outbox.add: give countdown or eta, not both")
        options["eta"] = (now + timedelta(seconds=float(countdown))).isoformat()
    elif "eta" in options:
        options["eta"] = _moment(options["eta"], "eta")
    expires = options.get("expires")
    if isinstance(expires, (int, float)) and not isinstance(expires, bool):
        options["expires"] = (now + timedelta(seconds=float(expires))).isoformat()
    elif expires is not None:
        options["expires"] = _moment(expires, "expires")
    return options


def pack(target: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Envelope:
    """The envelope of a Celery task (or one task's signature) called with ``args``/``kwargs``
    (appended to the signature's, as ``.delay`` does)."""
    task, sig_args, sig_kwargs, options = _task_of(target)
    call_args = (*sig_args, *args)
    call_kwargs = {**sig_kwargs, **kwargs}
    policy = _policy(task, options.get("dedup"))
    name = str(task.name)
    if len(name) > MAX_TARGET:
        raise ConfigurationError(f"outbox.add: a task name of at most {MAX_TARGET} characters")
    task_id = options.pop("task_id", None) or new_id()
    options = _options(options, datetime.now(UTC))
    if not is_disabled():  # arguments without identity are refused now, as at enqueue
        get_deduplicator(task.app).identity(name, policy, call_args, call_kwargs,
                                            func=task._func(), dedup_key=options.get("dedup_key"))
    serializer = options.get("serializer") or task.serializer
    try:
        content_type, encoding, payload = dumps(
            {"args": list(call_args), "kwargs": call_kwargs, "options": options},
            serializer=serializer)  # type: ignore[no-untyped-call]
    except Exception as exc:  # kombu's EncodeError, or the serializer's own
        raise ConfigurationError(
            f"outbox.add: the call of {name} cannot be serialized with {serializer!r} "
            f"({type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}); pass "
            "arguments this task's serializer accepts"
        ) from None
    binary = isinstance(payload, bytes)
    body = {"v": VERSION, "task": name, "content_type": content_type,
            "content_encoding": encoding, "b64": binary,
            "call": b64encode(payload) if binary else payload}
    return Envelope(str(task_id), CELERY, name, json.dumps(body, separators=(",", ":")))


def call_of(app: Celery, envelope: Envelope) -> tuple[Any, dict[str, Any]]:
    """The task and the call (``args``, ``kwargs``, ``options``) an envelope holds, read with
    the content types the app accepts."""
    data = envelope.data()
    name = data.get("task")
    task = app.tasks.get(name) if isinstance(name, str) else None
    if task is None:
        raise LookupError(f"task {name!r} is not registered in the app {app.main!r} (import "
                          "its module in the relay's app, or pass -A the producer's app)")
    if not isinstance(task, DedupTask):
        raise LookupError(f"task {name!r} is not a DedupTask in the app {app.main!r}")
    raw = data["call"]
    payload = b64decode(raw) if data.get("b64") else raw
    accept = prepare_accept_content(app.conf.accept_content)  # type: ignore[no-untyped-call]
    call = loads(payload, data["content_type"], data["content_encoding"],  # type: ignore[no-untyped-call]
                 accept=accept)
    if not isinstance(call, dict):
        raise ValueError("the stored call is not a mapping")
    return task, call


def publish(app: Celery, envelope: Envelope) -> None:
    """Publish the call under its own id through the task's gate (see the module docstring).

    A duplicate of another call is an answer, not a failure: the row is done (logged at INFO).
    Any other error is raised for the caller to keep the row and try again later.
    """
    task, call = call_of(app, envelope)
    options = dict(call.get("options") or {})
    options.pop("task_id", None)
    try:
        task.apply_async(call.get("args") or (), call.get("kwargs") or {},
                         task_id=envelope.id, **options, **{OUTBOX: True})
    except DuplicateTaskError as exc:
        if exc.existing_id != envelope.id:
            logger.info("taskdedup: outbox row %s (%s) is a duplicate of %s: not sent",
                        envelope.id, envelope.target, exc.existing_id)
