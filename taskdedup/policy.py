"""Policy: how a task's identity is gated — the lock mode, windows and conflict strategies.

A :class:`Policy` is immutable and validated when it is built, so a mistake surfaces when the
task or queue is declared, not when the first message is processed. A ``dict`` with the same
field names is accepted wherever a Policy is (:meth:`Policy.coerce`).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Collection, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field, fields
from datetime import timedelta
from enum import Enum, StrEnum
from typing import Any, Final

from .approximate import Approximate
from .exceptions import ConfigurationError

__all__ = [
    "MAX_DURATION_MS",
    "Debounce",
    "Mode",
    "OnBusy",
    "OnDuplicate",
    "OnStoreError",
    "Policy",
    "PolicyLike",
    "disable",
    "disabled",
    "enable",
    "is_disabled",
]


class Mode(StrEnum):
    """When the identity is gated and when its lock is released (docs/reference/policy.md)."""

    UNTIL_EXECUTING = "until_executing"
    """Enqueue gated; released when a worker starts the task."""
    UNTIL_EXECUTED = "until_executed"
    """Enqueue and execution gated; released when the task finishes."""
    UNTIL_EXPIRED = "until_expired"
    """Enqueue and execution gated; kept ``ttl`` after success, released on final failure."""
    WHILE_EXECUTING = "while_executing"
    """Only execution gated: at most one body runs at a time per identity."""

    @property
    def gates_enqueue(self) -> bool:
        return self is not Mode.WHILE_EXECUTING

    @property
    def gates_execution(self) -> bool:
        return self is not Mode.UNTIL_EXECUTING


class OnDuplicate(StrEnum):
    """What the caller gets when its call is a duplicate."""

    RETURN = "return"
    """The original's handle (Celery AsyncResult / RQ Job with the original id)."""
    RAISE = "raise"
    """:class:`~taskdedup.DuplicateTaskError` with ``.key`` and ``.existing_id``."""
    DROP = "drop"
    """``None``; logged at DEBUG (it is counted: ``taskdedup stats``)."""
    REPLACE = "replace"
    """Debounce: the queued original is revoked and the new call takes its place."""
    COALESCE = "coalesce"
    """A duplicate of a queued call gets the original's handle (as ``return``); a duplicate
    of a running call becomes the one follow-up that runs after it, with the latest call's
    arguments (SPEC §15)."""


class OnBusy(StrEnum):
    """What an execution does when it finds another run of its identity in progress
    (SPEC §15)."""

    SKIP = "skip"
    """End without running, as a skipped duplicate (the default)."""
    WAIT = "wait"
    """Put off (republished later, not a retry, no worker slot held) until the other run
    has finished, then run with its own arguments."""


class OnStoreError(StrEnum):
    """What happens when Redis cannot be reached."""

    RAISE = "raise"
    """Refuse at enqueue (nothing enqueued); on a worker, retry the task later."""
    ALLOW = "allow"
    """Fail open: proceed without dedup, log a WARNING and count it."""


Duration = float | int | timedelta
KeyFunc = Callable[..., Any]

MAX_DURATION_MS: Final = 100 * 365 * 24 * 3600 * 1000
"""The longest duration taskdedup accepts, in milliseconds: 100 years.

Redis stores an expiry as milliseconds since the epoch in a signed 64-bit integer and refuses a
``PX``/``PEXPIRE`` that overflows once added to its clock ("invalid expire time"): a policy
beyond that would fail every reservation, which a worker would take for "store unavailable"
and retry forever. 100 years (3.2e12 ms) is far longer than any window needs and far below
that limit (2**63 / 1000 ≈ 9.2e15 ms) even with the clock and a countdown or ETA added: the
integrations clamp ttl + countdown to a multiple of this cap."""

_MAX_SECONDS: Final = MAX_DURATION_MS / 1000


def duration_seconds(owner: str, value: Duration) -> float:
    """``value`` (seconds or a timedelta) as positive, finite seconds within the cap.

    ``owner`` names the field in the message (``"Policy.ttl"``). Shared by every duration of
    the public API, so all are refused alike when the task or queue is declared.

    Raises:
        ConfigurationError: not a number or timedelta, not positive, NaN, infinite, or longer
            than :data:`MAX_DURATION_MS`.
    """
    if isinstance(value, timedelta):
        seconds = value.total_seconds()
    elif isinstance(value, (int, float)) and not isinstance(value, bool):
        try:
            seconds = float(value)
        except OverflowError:  # an int beyond any float: too long, not infinite
            seconds = 2 * _MAX_SECONDS
    else:
        raise ConfigurationError(
            f"{owner} must be seconds (int/float) or a timedelta, got {type(value).__name__}"
        )
    if not seconds > 0 or seconds == float("inf"):
        raise ConfigurationError(
            f"{owner} must be a positive, finite number of seconds, got {value!r}"
        )
    if seconds > _MAX_SECONDS:
        raise ConfigurationError(
            f"{owner}={_shown(value)} is more than Redis can keep: give at most "
            f"{_MAX_SECONDS:.0f} "
            "seconds (100 years, taskdedup.policy.MAX_DURATION_MS)"
        )
    return seconds


def _shown(value: Duration) -> str:
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


def _seconds(name: str, value: Duration) -> float:
    return duration_seconds(f"Policy.{name}", value)


def _enum(enum: type[Enum], name: str, value: Any) -> Any:
    try:
        return enum(value)
    except ValueError:
        choices = ", ".join(repr(m.value) for m in enum)
        raise ConfigurationError(f"Policy.{name}={value!r} is not one of {choices}") from None


def _names(name: str, value: Collection[str] | str | None) -> frozenset[str] | None:
    if value is None:
        return None
    if isinstance(value, str):
        return frozenset((value,))
    try:
        names = frozenset(value)
    except TypeError:
        raise ConfigurationError(f"Policy.{name} must be a list of argument names") from None
    if not all(isinstance(n, str) for n in names):
        raise ConfigurationError(f"Policy.{name} must contain argument names (str)")
    return names


def _known_fields(kind: str, value: Mapping[str, Any], known: set[str]) -> None:
    """A dict given for a ``kind`` names only its fields, or a clear error says which."""
    unknown = sorted(set(value) - known)
    if unknown:
        raise ConfigurationError(
            f"unknown {kind} field(s) {', '.join(map(repr, unknown))}; "
            f"known: {', '.join(sorted(known))}"
        )


def _busy_timeout(value: Duration | None) -> float | None:
    if value is None:
        return None
    return _seconds("busy_timeout", value)


@dataclass(frozen=True)
class Debounce:
    """``Policy(debounce=Debounce(wait, max_wait=None))`` (SPEC §15): a burst of calls of one
    identity runs once, ``wait`` seconds after its last call, with that call's arguments;
    with ``max_wait``, never later than ``max_wait`` after the burst's first call.

    Args:
        wait: seconds (or timedelta) of quiet after the last call before the run.
        max_wait: seconds (or timedelta), at least ``wait``: a burst longer than this runs
            every ``max_wait`` with the latest arguments (None: only after the burst ends).
    """

    wait: float
    max_wait: float | None = None

    def __init__(self, wait: Duration, max_wait: Duration | None = None) -> None:
        set_ = object.__setattr__
        set_(self, "wait", duration_seconds("Debounce.wait", wait))
        set_(self, "max_wait", None if max_wait is None
             else duration_seconds("Debounce.max_wait", max_wait))
        if self.max_wait is not None and self.max_wait < self.wait:
            raise ConfigurationError(
                f"Debounce(wait={self.wait:g}, max_wait={self.max_wait:g}): max_wait bounds "
                "how late a burst runs, so it cannot be shorter than wait; raise max_wait or "
                "drop it")

    @property
    def wait_ms(self) -> int:
        return max(1, int(self.wait * 1000))

    @property
    def max_wait_ms(self) -> int:
        """0 without ``max_wait``."""
        return 0 if self.max_wait is None else max(1, int(self.max_wait * 1000))


def _debounce(value: Any) -> Debounce | None:
    if value is None or isinstance(value, Debounce):
        return value
    if isinstance(value, Mapping):
        _known_fields("Debounce", value, {"wait", "max_wait"})
        return Debounce(**value)
    raise ConfigurationError(
        f"Policy.debounce must be None or taskdedup.Debounce(wait, max_wait=None), got "
        f"{type(value).__name__}"
    )


def _window(value: Any) -> Approximate | None:
    if value is None or isinstance(value, Approximate):
        return value
    if isinstance(value, Mapping):
        _known_fields("Approximate", value, {"capacity", "error_rate", "slices", "partitions"})
        return Approximate(**value)
    raise ConfigurationError(
        f"Policy.window must be None or taskdedup.Approximate(capacity, error_rate), got "
        f"{type(value).__name__}"
    )


@dataclass(frozen=True)
class Policy:
    """How one task (or queue) is deduplicated.

    Args:
        mode: ``until_executing``, ``until_executed``, ``until_expired`` (default) or
            ``while_executing`` (see :class:`Mode`).
        ttl: seconds (or timedelta) a reservation lives while queued, and the window kept after
            success in ``until_expired``. A countdown/ETA is added to the reservation.
        lease: seconds a running lock lives without a heartbeat; the worker renews it every
            ``lease / 3`` while the body runs, so a dead worker's lock frees itself within it.
        include: only these argument names make the identity.
        exclude: these argument names do not count.
        key: a callable taking the task's arguments and returning the identity value.
        scope: a namespace inserted in the Redis key (e.g. a tenant or an environment).
        on_duplicate: ``return`` (default), ``raise``, ``drop`` or ``replace``.
        on_store_error: ``raise`` (default) or ``allow`` (fail open).
        window: ``None`` (default: the window after success is an exact ``done`` lock) or
            :class:`~taskdedup.Approximate` (only with ``mode="until_expired"``): the window
            is remembered in rotating Bloom filters, ~1-2 bytes per identity, with a bounded
            false-positive rate (a dict of its fields is accepted too).
        on_busy: ``skip`` (default) or ``wait``: an execution that finds another run of
            its identity in progress waits for it instead of being skipped (SPEC §15; not
            with ``until_executing``, which gates no execution).
        busy_timeout: with ``on_busy="wait"``, seconds (or timedelta) after which a waiting
            call ends FAILURE with :class:`~taskdedup.BusyTimeoutError`, without running.
        debounce: :class:`~taskdedup.Debounce` (or a dict of its fields): every call is
            published with a countdown; a burst of one identity runs once, with its last
            call's arguments (SPEC §15).
    """

    mode: Mode = Mode.UNTIL_EXPIRED
    ttl: float = 600.0
    lease: float = 60.0
    include: frozenset[str] | None = None
    exclude: frozenset[str] | None = None
    key: KeyFunc | None = field(default=None, compare=False)
    scope: str | None = None
    on_duplicate: OnDuplicate = OnDuplicate.RETURN
    on_store_error: OnStoreError = OnStoreError.RAISE
    window: Approximate | None = None
    on_busy: OnBusy = OnBusy.SKIP
    busy_timeout: float | None = None
    debounce: Debounce | None = None

    def __init__(
        self,
        mode: Mode | str = Mode.UNTIL_EXPIRED,
        ttl: Duration = 600.0,
        lease: Duration = 60.0,
        include: Collection[str] | None = None,
        exclude: Collection[str] | None = None,
        key: KeyFunc | None = None,
        scope: str | None = None,
        on_duplicate: OnDuplicate | str = OnDuplicate.RETURN,
        on_store_error: OnStoreError | str = OnStoreError.RAISE,
        window: Approximate | Mapping[str, Any] | None = None,
        on_busy: OnBusy | str = OnBusy.SKIP,
        busy_timeout: Duration | None = None,
        debounce: Debounce | Mapping[str, Any] | None = None,
    ) -> None:
        set_ = object.__setattr__
        set_(self, "mode", _enum(Mode, "mode", mode))
        set_(self, "ttl", _seconds("ttl", ttl))
        set_(self, "lease", _seconds("lease", lease))
        set_(self, "include", _names("include", include))
        set_(self, "exclude", _names("exclude", exclude))
        set_(self, "key", key)
        if scope is not None and not isinstance(scope, str):
            raise ConfigurationError(f"Policy.scope must be a string, got {type(scope).__name__}")
        set_(self, "scope", scope or None)
        set_(self, "on_duplicate", _enum(OnDuplicate, "on_duplicate", on_duplicate))
        set_(self, "on_store_error", _enum(OnStoreError, "on_store_error", on_store_error))
        set_(self, "window", _window(window))
        set_(self, "on_busy", _enum(OnBusy, "on_busy", on_busy))
        set_(self, "busy_timeout", _busy_timeout(busy_timeout))
        set_(self, "debounce", _debounce(debounce))
        self._validate()

    def _validate(self) -> None:
        if self.include is not None and self.exclude is not None:
            raise ConfigurationError("Policy: give include or exclude, not both")
        if self.key is not None and (self.include is not None or self.exclude is not None):
            raise ConfigurationError(
                "Policy: key= replaces the whole identity; drop include/exclude or drop key"
            )
        if self.key is not None and not callable(self.key):
            raise ConfigurationError("Policy.key must be a callable taking the task's arguments")
        if self.scope is not None and ":" in self.scope:
            raise ConfigurationError("Policy.scope must be a string without ':'")
        if self.window is not None and self.mode is not Mode.UNTIL_EXPIRED:
            raise ConfigurationError(
                f"Policy(mode={self.mode.value!r}, window=Approximate(...)): an approximate "
                "window remembers identities for ttl after success, which only "
                "mode='until_expired' does; use mode='until_expired' or drop window="
            )
        if self.mode is Mode.WHILE_EXECUTING and self.on_duplicate is not OnDuplicate.RETURN:
            raise ConfigurationError(
                f"Policy(mode='while_executing', on_duplicate={self.on_duplicate.value!r}): "
                "while_executing does not gate the enqueue, so on_duplicate never applies; "
                "use mode='until_executed' (or 'until_executing' for replace) instead"
            )

        self._validate_busy()
        self._validate_flow()

    def _validate_flow(self) -> None:
        """coalesce and debounce (SPEC §15): their follow-up and generation records sit beside
        the lock, so they need an exact lock, and a mode whose claim they can take."""
        coalesce = self.on_duplicate is OnDuplicate.COALESCE
        if coalesce and self.mode not in (Mode.UNTIL_EXECUTED, Mode.UNTIL_EXPIRED):
            raise ConfigurationError(
                f"Policy(mode={self.mode.value!r}, on_duplicate='coalesce'): a follow-up runs "
                "after the running call, which needs the enqueue and the execution gated; use "
                "mode='until_executed' or 'until_expired'")
        if self.debounce is not None:
            if not self.mode.gates_execution:
                raise ConfigurationError(
                    "Policy(mode='until_executing', debounce=...): a debounced call is told "
                    "superseded at its claim, which this mode does not take; use "
                    "mode='until_executed', 'until_expired' or 'while_executing'")
            if self.on_duplicate not in (OnDuplicate.RETURN,):
                raise ConfigurationError(
                    f"Policy(debounce=..., on_duplicate={self.on_duplicate.value!r}): a "
                    "debounced call is never a duplicate at enqueue (every call is published "
                    "and the burst's last one runs); drop on_duplicate")
            if self.on_busy is not OnBusy.SKIP:
                raise ConfigurationError(
                    "Policy(debounce=..., on_busy='wait'): the burst's run already waits for "
                    "a previous run of its identity; drop on_busy")
        if (coalesce or self.debounce is not None) and self.window is not None:
            raise ConfigurationError(
                "Policy(window=Approximate(...)) with coalesce or debounce: their records "
                "sit beside an exact lock; drop window=")

    def _validate_busy(self) -> None:
        if self.on_busy is OnBusy.WAIT and not self.mode.gates_execution:
            raise ConfigurationError(
                f"Policy(mode={self.mode.value!r}, on_busy='wait'): this mode gates no "
                "execution, so no call ever finds its identity busy; use "
                "mode='while_executing' or 'until_executed', or drop on_busy"
            )
        if self.busy_timeout is not None and self.on_busy is not OnBusy.WAIT:
            raise ConfigurationError(
                "Policy(busy_timeout=...): only a waiting call times out; give "
                "on_busy='wait' or drop busy_timeout"
            )

    @property
    def ttl_ms(self) -> int:
        return max(1, int(self.ttl * 1000))

    @property
    def lease_ms(self) -> int:
        return max(1, int(self.lease * 1000))

    @classmethod
    def coerce(cls, value: PolicyLike) -> Policy | None:
        """A Policy from a Policy, a dict of its fields, ``True`` (defaults), ``None``/``False``."""
        if value is None or value is False:
            return None
        if value is True:
            return cls()
        if isinstance(value, Policy):
            return value
        if isinstance(value, Mapping):
            _known_fields("Policy", value, {f.name for f in fields(cls)})
            return cls(**value)
        raise ConfigurationError(
            f"dedup= must be a taskdedup.Policy, a dict of its fields, True or False; "
            f"got {type(value).__name__}"
        )


PolicyLike = Policy | Mapping[str, Any] | bool | None

_disabled = False


def disable() -> None:
    """Turn all gating off in this process (for tests): every call goes straight through."""
    global _disabled
    _disabled = True


def enable() -> None:
    """Undo :func:`disable`."""
    global _disabled
    _disabled = False


@contextmanager
def disabled() -> Iterator[None]:
    """Turn gating off inside a ``with`` block, then put back what was there before.

    The previous state of the switch (:func:`disable` / :func:`enable`) is restored on the way
    out, also when the block raises; nested blocks restore their own entry state.
    ``TASKDEDUP_DISABLED=1`` in the environment keeps gating off regardless.

    Example::

        with taskdedup.disabled():
            charge.delay(42)   # enqueued with no lock, as if taskdedup were not there
    """
    global _disabled
    previous = _disabled
    _disabled = True
    try:
        yield
    finally:
        _disabled = previous


def is_disabled() -> bool:
    """True when gating is off, by :func:`disable` or ``TASKDEDUP_DISABLED=1``."""
    flag = os.environ.get("TASKDEDUP_DISABLED", "").strip().lower()
    return _disabled or flag not in ("", "0", "false", "no", "off")
