"""The outbox's RQ adapter: a ``DedupQueue`` call packed into an envelope, and published again.

The body records what the relay needs to rebuild the producer's queue — its name, its class,
job class and serializer (by import path), the lock prefix and the dedup policy's settings —
and the call: the function's import path, and its arguments and RQ's enqueue options
(``job_timeout``, ``result_ttl``, ``ttl``, ``failure_ttl``, ``description``, ``at_front``,
``meta``, ``retry``, ...) serialized with the queue's serializer (RQ's pickle by default),
base64 in the JSON body.

Publishing is the queue's own gated ``enqueue_call`` with the row's id as ``job_id``: a job of
that id that is alive is the call itself (nothing is enqueued again); a job that ended meets
its own done lock (nothing is enqueued: it ran); a lock its id holds with no job behind it (a
producer that died between the reservation and the job) is the id's own and is accepted.
"""

from __future__ import annotations

import json
import threading
from collections import OrderedDict
from typing import Any, Final

import redis
from rq.queue import Queue
from rq.utils import import_attribute

from ..approximate import Approximate
from ..events import logger
from ..exceptions import ConfigurationError, DuplicateTaskError
from ..outbox.envelope import MAX_TARGET, RQ, Envelope, b64decode, b64encode, new_id
from ..policy import Policy, is_disabled
from . import _compat
from .call import task_of
from .queue import DedupQueue

__all__ = ["pack", "policy_fields", "policy_from", "publish"]

VERSION: Final = 1
_CACHE_SIZE: Final = 64
_queues: OrderedDict[tuple[int, str], DedupQueue] = OrderedDict()
_queues_lock = threading.Lock()


def _path(obj: Any, what: str) -> str:
    """``obj``'s import path, checked to import back to ``obj``."""
    module, name = getattr(obj, "__module__", None), getattr(obj, "__qualname__", None)
    path = f"{module}.{name}" if isinstance(module, str) and isinstance(name, str) else ""
    if not path or "<" in path or _import(path) is not obj:
        raise ConfigurationError(
            f"outbox.add: the {what} {obj!r} must be importable by its dotted path (a "
            "module-level function or class): the relay imports it by name"
        )
    return path


def _import(path: str) -> Any:
    """What ``path`` names (RQ's own import of function references), or None."""
    try:
        return import_attribute(path)
    except Exception:
        return None


def _required(path: str, what: str) -> Any:
    """What ``path`` names, or LookupError: the relay rebuilds the producer's queue exactly or
    not at all (RQ's default class, serializer or identity in its place would publish the
    call as another job, or under another lock key than the producer's)."""
    found = _import(path)
    if found is None:
        raise LookupError(f"the {what} {path!r} does not import here (the relay imports the "
                          "producer's code by name: install it beside the relay)")
    return found


def _function(func: Any) -> str:
    """The import path of an RQ function reference (a callable or a dotted string)."""
    if isinstance(func, str):
        found = _import(func)
        if found is None or not callable(found):
            raise ConfigurationError(f"outbox.add: {func!r} does not import to a function "
                                     "here: the relay imports it by name")
        return func
    return _path(func, "function")


def policy_fields(policy: Policy) -> dict[str, Any]:
    """The settings of ``policy`` as JSON (a ``key`` callable by its import path)."""
    window = policy.window
    return {
        "mode": policy.mode.value, "ttl": policy.ttl, "lease": policy.lease,
        "include": sorted(policy.include) if policy.include is not None else None,
        "exclude": sorted(policy.exclude) if policy.exclude is not None else None,
        "key": _path(policy.key, "Policy.key") if policy.key is not None else None,
        "scope": policy.scope, "on_duplicate": policy.on_duplicate.value,
        "on_store_error": policy.on_store_error.value,
        "window": None if window is None else {
            "capacity": window.capacity, "error_rate": window.error_rate,
            "slices": window.slices, "partitions": window.partitions},
    }


def policy_from(fields: dict[str, Any]) -> Policy:
    """The Policy :func:`policy_fields` recorded."""
    values = dict(fields)
    if values.get("key") is not None:
        values["key"] = _required(values["key"], "Policy.key")
    if values.get("window") is not None:
        values["window"] = Approximate(**values["window"])
    return Policy(**values)


def _checked_policy(queue: DedupQueue, override: Any) -> Policy:
    policy = queue.dedup_policy if override is None else Policy.coerce(override)
    if policy is None:
        raise ConfigurationError(
            f"outbox.add: the queue {queue.name!r} has no dedup policy (dedup=False): the "
            "outbox publishes a committed call at least once, and only taskdedup's gate and "
            "DedupWorker make a second publish of the same job id run once"
        )
    if not policy.mode.gates_execution:
        raise ConfigurationError(
            f"outbox.add: mode={policy.mode.value!r} does not guard the execution: a row "
            "published twice would run twice; use until_expired (the default), "
            "until_executed or while_executing"
        )
    return policy


def pack(target: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Envelope:
    """The envelope of ``target.enqueue(*args, **kwargs)`` (``args[0]``: the function)."""
    if not isinstance(target, DedupQueue):
        what = "an RQ Queue" if isinstance(target, Queue) else type(target).__name__
        raise ConfigurationError(
            f"outbox.add takes a DedupQueue, not {what}: the outbox publishes a committed "
            "call at least once, and only DedupQueue's gate and DedupWorker make a second "
            "publish of the same job id run once"
        )
    if not args:
        raise ConfigurationError("outbox.add(queue, func, *args, **kwargs): the function is "
                                 "missing")
    if len(target.name) > MAX_TARGET:
        raise ConfigurationError(f"outbox.add: a queue name of at most {MAX_TARGET} characters")
    kwargs = dict(kwargs)
    override, dedup_key = kwargs.pop("dedup", None), kwargs.pop("dedup_key", None)
    params = _compat.parse_enqueue_args(*args, **kwargs)
    if params.pop("pipeline", None) is not None:
        raise ConfigurationError("outbox.add: pipeline= cannot be stored with the call")
    func = _function(params.pop("func"))
    job_id = params.pop("job_id", None) or new_id()
    call_args, call_kwargs = list(params.pop("args") or ()), dict(params.pop("kwargs") or {})
    options = {k: v for k, v in params.items() if v is not None and v is not False}
    policy = _checked_policy(target, override)
    if not is_disabled():  # arguments without identity are refused now, as at enqueue
        name, bind_to = task_of(func)
        target.dedup.identity(name, policy, call_args, call_kwargs, func=bind_to,
                              dedup_key=dedup_key)
    serializer = target.serializer
    try:
        payload = serializer.dumps({"args": call_args, "kwargs": call_kwargs,
                                    "options": options, "dedup_key": dedup_key})
    except Exception as exc:
        raise ConfigurationError(
            f"outbox.add: the call of {func} cannot be serialized by the queue's serializer "
            f"({type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''})"
        ) from None
    body = {
        "v": VERSION, "queue": target.name, "queue_class": _path(type(target), "queue class"),
        "job_class": _path(target.job_class, "job class"),
        "serializer": _path(serializer, "serializer"), "prefix": target.dedup.prefix,
        "policy": policy_fields(policy), "func": func, "call": b64encode(payload),
    }
    return Envelope(str(job_id), RQ, target.name, json.dumps(body, separators=(",", ":")))


def queue_of(connection: redis.Redis, data: dict[str, Any]) -> DedupQueue:
    """The queue a body describes, on ``connection`` (built once per connection and body)."""
    spec = json.dumps({k: data.get(k) for k in ("queue", "queue_class", "job_class",
                                                "serializer", "prefix", "policy")},
                      sort_keys=True)
    cache_key = (id(connection), spec)
    with _queues_lock:
        queue = _queues.get(cache_key)
        if queue is not None and queue.connection is connection:
            _queues.move_to_end(cache_key)
            return queue
    cls = _import(data["queue_class"])
    if not (isinstance(cls, type) and issubclass(cls, DedupQueue)):
        raise LookupError(f"{data['queue_class']!r} is not a DedupQueue class here")
    queue = cls(data["queue"], connection=connection,
                job_class=_required(data["job_class"], "job class"),
                serializer=_required(data["serializer"], "serializer"),
                dedup=policy_from(data["policy"]), dedup_prefix=data["prefix"])
    with _queues_lock:
        _queues[cache_key] = queue
        while len(_queues) > _CACHE_SIZE:
            _queues.popitem(last=False)
    return queue


def publish(connection: redis.Redis, envelope: Envelope, queue: DedupQueue | None = None) -> None:
    """Enqueue the call under its own job id through the queue's gate (the module docstring
    says what a second publish does). ``queue``: the producer's own, else rebuilt.

    A duplicate of another call is an answer, not a failure (logged at INFO); any other error
    is raised for the caller to keep the row and try again later.
    """
    data = envelope.data()
    if queue is None:
        queue = queue_of(connection, data)
    call = queue.serializer.loads(b64decode(data["call"]))
    try:
        queue.enqueue_call(data["func"], call["args"], call["kwargs"], job_id=envelope.id,
                           dedup=policy_from(data["policy"]), dedup_key=call.get("dedup_key"),
                           **call["options"])
    except DuplicateTaskError as exc:
        if exc.existing_id != envelope.id:
            logger.info("taskdedup: outbox row %s (%s) is a duplicate of %s: not sent",
                        envelope.id, envelope.target, exc.existing_id)
