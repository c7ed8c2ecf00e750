"""What one outbox row holds (:class:`Envelope`) and how a call becomes one (:func:`pack`).

An envelope is built and checked when the call is added, in the caller's transaction: the
arguments are serialized then (with the framework's own serializer) and a call that cannot be
published later — an unserializable argument, a target without a dedup policy, a function that
cannot be imported by name — is refused there, never at publish time. The adapter that packs
and publishes a call lives beside its framework (:mod:`taskdedup.celery.outbox`,
:mod:`taskdedup.rq.outbox`); this module imports it only when a call targets that framework.
"""

from __future__ import annotations

import base64
import importlib
import json
import uuid
from dataclasses import dataclass
from typing import Any, Final

from ..exceptions import ConfigurationError

__all__ = ["CELERY", "KINDS", "RQ", "Envelope", "adapter", "b64decode", "b64encode", "new_id",
           "pack"]

CELERY: Final = "celery"
RQ: Final = "rq"
KINDS: Final = (CELERY, RQ)

_ADAPTERS: Final = {CELERY: "taskdedup.celery.outbox", RQ: "taskdedup.rq.outbox"}
MAX_TARGET: Final = 255
"""``taskdedup_outbox.target`` is VARCHAR(255)."""


@dataclass(frozen=True, slots=True)
class Envelope:
    """One call, as a row of ``taskdedup_outbox`` stores it.

    Attributes:
        id: the Celery task id / RQ job id the call runs under (its identity: published twice,
            it still runs once).
        kind: ``"celery"`` or ``"rq"``: which adapter publishes it.
        target: the Celery task name or the RQ queue name (what ``status`` groups by).
        body: JSON text: everything the adapter needs to rebuild and publish the call, its
            arguments already serialized by the framework's serializer.
    """

    id: str
    kind: str
    target: str
    body: str

    def data(self) -> dict[str, Any]:
        """The body, parsed (a dict)."""
        value = json.loads(self.body)
        if not isinstance(value, dict):
            raise ValueError("an outbox body is a JSON object")
        return value


def new_id() -> str:
    """A fresh task/job id (what Celery and RQ would pick themselves)."""
    return str(uuid.uuid4())


def b64encode(data: bytes) -> str:
    return base64.b64encode(data).decode("ascii")


def b64decode(text: str) -> bytes:
    return base64.b64decode(text.encode("ascii"), validate=True)


def adapter(kind: str) -> Any:
    """The adapter module of ``kind`` (imported now: it imports its framework)."""
    path = _ADAPTERS.get(kind)
    if path is None:
        raise ConfigurationError(f"an outbox row of kind {kind!r}: known kinds are "
                                 f"{', '.join(KINDS)}")
    return importlib.import_module(path)


def _kind_of(target: Any) -> str | None:
    """Which framework ``target`` comes from, by its class's modules (never importing one)."""
    for cls in type(target).__mro__:
        root = cls.__module__.split(".", 1)[0]
        if root in ("celery", "rq"):
            return root
        if cls.__module__.startswith("taskdedup.celery"):
            return CELERY
        if cls.__module__.startswith("taskdedup.rq"):
            return RQ
    return None


def pack(target: Any, *args: Any, **kwargs: Any) -> Envelope:
    """The envelope of ``target`` called with ``args``/``kwargs``.

    ``target``: a Celery task or signature (its options travel with it; ``args``/``kwargs``
    are appended as ``.delay`` would), or an RQ ``DedupQueue`` (then ``args[0]`` is the
    function and the rest its arguments, RQ's enqueue options among ``kwargs``, as
    ``Queue.enqueue`` takes them). The id is a new uuid4 unless the call names one (a
    signature's ``task_id``, RQ's ``job_id=``).

    Raises:
        ConfigurationError: a target of another kind, a target without a dedup policy, an
            argument or option its serializer refuses, a function not importable by name.
        TypeError: arguments without an identity (as at enqueue).
    """
    kind = _kind_of(target)
    if kind is None:
        raise ConfigurationError(
            f"outbox.add(target, ...) takes a Celery task or signature, or an RQ DedupQueue "
            f"(then the function and its arguments), not {type(target).__name__}"
        )
    envelope: Envelope = adapter(kind).pack(target, args, kwargs)
    return envelope
