"""The taskdedup exception tree.

Every error the library raises on purpose derives from :class:`TaskDedupError`, so callers
can catch one class. Bad arguments to :func:`taskdedup.fingerprint` raise the built-in
``TypeError`` (they are a programming error, like passing the wrong type to ``json.dumps``),
and bad configuration raises :class:`ConfigurationError`, which is also a ``ValueError``.
This module imports nothing else of the package.
"""

from __future__ import annotations

__all__ = [
    "BusyTimeoutError",
    "ConfigurationError",
    "DuplicateTaskError",
    "IdempotencyKeyMismatch",
    "StoreUnavailableError",
    "TaskDedupError",
]


class TaskDedupError(Exception):
    """Root of every error raised by taskdedup."""


class DuplicateTaskError(TaskDedupError):
    """A call was refused because the same task identity is already held.

    Attributes:
        key: the Redis key of the identity.
        existing_id: the task/job id that holds it (the original).
    """

    def __init__(
        self, key: str, existing_id: str | None = None, message: str | None = None
    ) -> None:
        self.key = key
        self.existing_id = existing_id
        self.message = message or (
            f"duplicate task: {key} is already held by task id {existing_id!r}")
        # All three in args: a result backend rebuilds the error as cls(*args) (Celery's JSON).
        super().__init__(key, existing_id, self.message)

    def __str__(self) -> str:
        return self.message


class StoreUnavailableError(TaskDedupError):
    """The lock store (Redis) could not be reached or answered with an error.

    Raised instead of enqueueing when ``on_store_error="raise"``: nothing was enqueued.
    The underlying redis error is chained as ``__cause__``.
    """


class IdempotencyKeyMismatch(TaskDedupError):
    """An explicit ``dedup_key`` was reused with different arguments.

    Like Stripe's idempotency keys, reusing a key for a different request is a client bug:
    returning the other call's result would be silently wrong.
    """

    def __init__(self, key: str, existing_id: str | None = None) -> None:
        self.key = key
        self.existing_id = existing_id
        super().__init__(key, existing_id)  # rebuilt as cls(*args), as above

    def __str__(self) -> str:
        if self.existing_id is None:  # an approximate window remembers it: it keeps no id
            held = "is remembered by its approximate window with other arguments"
        else:
            held = f"is held by task id {self.existing_id!r}, whose arguments differ"
        return (
            f"idempotency key reused with different arguments: {self.key} {held}. "
            "Use a new dedup_key for a new request."
        )


class ConfigurationError(TaskDedupError, ValueError):
    """A policy or integration was configured in a way that cannot work.

    Raised at declaration time (task decorator, queue constructor), never mid-flight.
    """


class BusyTimeoutError(TaskDedupError):
    """A call that waited for a busy identity (``on_busy="wait"``) gave up at
    ``busy_timeout``; its body did not run.

    Attributes:
        key: the Redis key of the identity.
        holder_id: the task/job id that held it when the wait ended.
        waited: seconds the call waited.
    """

    def __init__(self, key: str, holder_id: str | None = None, waited: float = 0.0,
                 message: str | None = None) -> None:
        self.key = key
        self.holder_id = holder_id
        self.waited = waited
        self.message = message or (
            f"waited {waited:.1f}s for the busy identity {key}, held by task id "
            f"{holder_id!r}, and gave up (busy_timeout); this call did not run")
        super().__init__(key, holder_id, waited, self.message)  # rebuilt as cls(*args)

    def __str__(self) -> str:
        return self.message
