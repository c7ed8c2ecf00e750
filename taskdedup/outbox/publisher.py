"""Publish envelopes through taskdedup's gated path, whichever process does it.

The committing process publishes its own rows right after the commit; the relay publishes
what was left. Both go through :class:`Publisher`, which hands an envelope to its framework's
adapter. Every failure — no app or connection for that kind, a task the app does not know, a
queue that cannot be rebuilt, a broker or lock store that refuses — is one
:class:`PublishError`: the row stays and is tried again later.
"""

from __future__ import annotations

from typing import Any

from ..exceptions import TaskDedupError
from .envelope import CELERY, RQ, Envelope, adapter

__all__ = ["PublishError", "Publisher", "describe"]


def describe(exc: BaseException) -> str:
    """An error as a row records it: its type and the first line of its message (a message
    never holds argument values: taskdedup's own errors name paths, not values)."""
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0]}"[:500] if text else type(exc).__name__


class PublishError(TaskDedupError):
    """An envelope could not be published now; its row stays for a later attempt.

    Attributes:
        envelope_id: the row's id (the task/job id).
        reason: what went wrong (:func:`describe` of the cause).
    """

    def __init__(self, envelope_id: str, reason: str) -> None:
        super().__init__(f"outbox row {envelope_id}: {reason}")
        self.envelope_id = envelope_id
        self.reason = reason


class Publisher:
    """Publishes envelopes: Celery ones through ``celery_app``, RQ ones on ``rq_connection``.

    Either may be None when no row of that kind is expected (a row of that kind then fails
    with :class:`PublishError`, and stays).
    """

    def __init__(self, *, celery_app: Any = None, rq_connection: Any = None) -> None:
        self.celery_app = celery_app
        self.rq_connection = rq_connection

    def publish(self, envelope: Envelope, target: Any = None) -> None:
        """Publish ``envelope`` under its own id (as a republish: a second publish of a row
        runs once). ``target``: the producer's own RQ queue, used instead of rebuilding it.

        Raises:
            PublishError: nothing was published; the row must stay.
        """
        try:
            if envelope.kind == CELERY:
                if self.celery_app is None:
                    raise LookupError("no Celery app to publish it with (relay: -A/--app or "
                                      "CELERY_APP)")
                adapter(CELERY).publish(self.celery_app, envelope)
            elif envelope.kind == RQ:
                connection = self.rq_connection
                if connection is None and target is not None:
                    connection = target.connection
                if connection is None:
                    raise LookupError("no RQ connection to publish it on (relay: RQ_REDIS_URL)")
                adapter(RQ).publish(connection, envelope, target)
            else:
                raise LookupError(f"unknown kind {envelope.kind!r}")
        except PublishError:
            raise
        except Exception as exc:
            raise PublishError(envelope.id, describe(exc)) from exc
