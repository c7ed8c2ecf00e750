"""What an RQ call is: the identity name of its function reference, the callable its
arguments bind to, and what a job's stored status or hash says about it."""

from __future__ import annotations

import functools
from collections.abc import Callable
from datetime import UTC, datetime
from typing import Any

from rq.job import Job
from rq.utils import import_attribute, resolve_function_reference

from . import _compat

__all__ = ["alive", "decode_hash", "delay_seconds", "job_task", "task_of"]


@functools.lru_cache(maxsize=1024)
def _import_quietly(path: str) -> Callable[..., Any] | None:
    try:
        return import_attribute(path)
    except Exception:  # not importable here: identity from the arguments as given
        return None


def task_of(func: Any) -> tuple[str, Callable[..., Any] | None]:
    """The identity name of an RQ function reference and the callable to bind arguments to.

    A function is ``module.qualname`` (RQ's ``func_name``); a string reference is itself
    (and is bound when it can be imported here); a bound method or a callable instance is
    ``module.Class.method`` — the instance itself is not part of the identity.
    """
    instance, func_name = resolve_function_reference(func)
    if isinstance(func, str):
        return func, _import_quietly(func)
    if instance is not None:
        cls = type(instance)
        return f"{cls.__module__}.{cls.__qualname__}.{func_name}", func
    return func_name, func


def job_task(job: Job) -> tuple[str, Callable[..., Any] | None]:
    """:func:`task_of` for a job as stored: the identity name of its function (the same name
    the queue gave the call) and the callable its arguments bind to. Loads the job's data."""
    instance, func_name = job.instance, job.func_name
    if func_name is None:
        raise TypeError(f"job {job.id} names no function")
    if instance is not None:
        return task_of(getattr(instance, func_name))
    return task_of(func_name)


def alive(status: str | None) -> bool:
    """Whether a job with this status (None: no such job) exists and has not ended."""
    return status is not None and status not in _compat.DEAD_STATUSES


def decode_hash(flat: list[Any] | None) -> dict[str, Any]:
    """A job hash as HGETALL in Lua answers it (a flat list), with text keys; the status
    under ``"status"`` as text too. Values stay bytes (``Job.restore`` reads them so)."""
    if not flat:
        return {}
    items = iter(flat)
    data = {_as_text(field): value for field, value in zip(items, items, strict=True)}
    if "status" in data:
        data["status"] = _as_text(data["status"])
    return data


def _as_text(value: Any) -> Any:
    return value.decode("utf-8", "surrogateescape") if isinstance(value, bytes) else value


def delay_seconds(when: datetime) -> float:
    """Seconds until ``when``; a naive datetime is local time, as RQ's scheduler reads it."""
    aware = when if when.tzinfo else when.astimezone()
    return max(0.0, (aware - datetime.now(UTC)).total_seconds())
