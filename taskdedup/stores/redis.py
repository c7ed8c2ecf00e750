"""RedisStore: the lock state machine in Redis / Valkey, one Lua call per step (a worker's
claim and completion: one ``SET … IFEQ`` where the server compares and sets, :mod:`.cas`).

Each transition is one script in ``taskdedup/stores/lua/`` that reads and writes only its
``KEYS[1]`` (so it runs on Redis Cluster), compares the owner before it writes (fencing by
task id) and returns small integers that map to :class:`~taskdedup.stores.base.Outcome`
and :class:`~taskdedup.stores.base.LockState`. Scripts run with EVALSHA in one round
trip; a server that lost them (restart, failover, ``SCRIPT FLUSH``) answers NOSCRIPT and
the call is made again with EVAL, which also caches the script anew. Redis 6.2+ and
Valkey; only EVALSHA, EVAL, SCRIPT LOAD (bulk path), GET, SET (PX; IFEQ, NX and GET for the
swaps), PEXPIRE, PTTL, DEL and SCAN are used.

Stored value: ``<state>|<check>|<owner>`` (see :func:`~taskdedup.stores.memory.parse_value`).

Beside the store, :func:`reserve_and_run` (``enqueue.lua``) reserves and runs a broker's own
enqueue commands in one script, for integrations whose broker is this very (non-Cluster)
server: Celery's ``RedisTransport`` and RQ's ``DedupQueue``.
"""

from __future__ import annotations

import hashlib
import logging
import re
import time
from collections.abc import Callable, Iterator, Sequence
from types import TracebackType
from typing import Any, Self

import redis
from redis.cluster import RedisCluster
from redis.commands.core import Script
from redis.exceptions import (
    AuthenticationError,
    NoPermissionError,
    NoScriptError,
    ReadOnlyError,
    RedisClusterException,
    RedisError,
    ResponseError,
)
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

from ..approximate import Probe
from ..exceptions import ConfigurationError, StoreUnavailableError
from . import cas, scripts, server
from ._compat import NEVER_DECODE, as_sent, raw_exchange
from .base import LockInfo, LockResult, LockState, Outcome, Remembered
from .memory import check_check, check_ms, check_owner, parse_value
from .owners import compact_owner, owner_text
from .trail import Trails

logger = logging.getLogger("taskdedup")

__all__ = ["RedisStore", "SentClaim", "SentReserve"]

_hiredis_pack: Callable[[tuple[Any, ...]], bytes] | None
try:
    from hiredis import pack_command as _hiredis_pack
except ImportError:  # pragma: no cover - redis[hiredis] is a dependency
    _hiredis_pack = None

_SCRIPT_NAMES = (
    "reserve", "replace", "claim", "heartbeat", "complete", "release", "get", "enqueue",
    "limit_acquire", "limit_heartbeat", "limit_release", "rate_acquire",
)


#: The Lua sources, read once at import (they ship as package data), each with the shared
#: functions of ``_lib.lua`` it calls in front (:mod:`taskdedup.stores.scripts`).
SCRIPTS: dict[str, str] = {name: scripts.source(name) for name in _SCRIPT_NAMES}

# Replies are read undecoded, whatever the client's decode_responses, so an owner that is
# not UTF-8 (written by someone else) decodes with surrogateescape instead of raising.
_RAW: dict[str, Any] = {NEVER_DECODE: []}

_OUTCOMES = {int(outcome): outcome for outcome in Outcome}
_BARE = {int(outcome): LockResult(outcome) for outcome in Outcome}
_STATES: dict[bytes | str, LockState] = {}
for _state in LockState:
    _STATES[_state.value] = _state
    _STATES[_state.value.encode()] = _state

_SCHEMES = {
    "redis": "redis",
    "rediss": "rediss",
    "unix": "unix",
    "valkey": "redis",
    "valkeys": "rediss",
}
_URL_PASSWORD = re.compile(r"(://[^:@/]*):[^@/]*@")
_GLOB_SPECIAL = re.compile(r"([\\*?\[\]])")

_ALLOW_HINT = "to run without dedup while the store is down: on_store_error='allow'"

# Seconds before a server that could not be asked whether it swaps (:mod:`.cas`) is asked again:
# a store that is down must not pay a probe's timeout on every call.
_ASK_AGAIN = 30.0

# How many claimed locks' argument checks a store remembers for their completions.
_CHECKS_KEPT = 10_000

# reserve_many packs and sends this many commands per socket write.
_SEND_SLICE = 1000


def _pack(conn: Any, commands: list[tuple[Any, ...]]) -> list[bytes]:
    if _hiredis_pack is None:
        return list(conn.pack_commands(commands))
    return [b"".join([_hiredis_pack(command) for command in commands])]


def _text(value: bytes | str) -> str:
    if isinstance(value, bytes):
        return value.decode("utf-8", "surrogateescape")
    return value


def _result(reply: Any) -> LockResult:
    code, state, owner = reply
    if owner is None:
        if state is None:
            return _BARE[code]
        # an approximate window's filter remembers the identity: done, by an unknown id
        return LockResult(_OUTCOMES[code], None, _STATES[state])
    return LockResult(_OUTCOMES[code], owner_text(_text(owner)), _STATES[state])


def _now_ms() -> int:
    return int(time.time() * 1000)


# The server's clock minus this process's (ms), as a script last told it: approximate windows
# run on the server's clock, and a caller only has to pass slice keys around it.
_offset_ms = 0

# A call whose slice keys missed the server's clock is made again with keys around the time
# the server answered; this many tries in all (a slice passing during a round trip).
_WINDOW_TRIES = 3


def window_keys(key: str, window: Probe | None) -> tuple[list[str], list[str]]:
    """KEYS and the extra ARGV of a script on ``key`` under ``window`` (if any): the lock,
    then the slice keys of a span of indices around this process's idea of the server's
    clock; the window argument (``seen`` in ``_lib.lua``)."""
    if window is None:
        return [key], []
    first, keys = window.span(_now_ms() + _offset_ms)
    return [key, *keys], [window.argument(first)]


def _late(reply: Any) -> bool:
    """Whether ``reply`` is a script's ``{0, server ms}``: the slice keys it was given miss
    the server's clock (nothing was written). Learns the server's clock from it."""
    if type(reply) is not list or reply[0] != 0:
        return False
    global _offset_ms
    _offset_ms = int(reply[1]) - _now_ms()
    return True


def _clock_error(key: str) -> StoreUnavailableError:
    return StoreUnavailableError(
        f"taskdedup could not place {key!r} in its approximate window: the server's clock "
        f"moved by more than a slice during each of {_WINDOW_TRIES} calls; {_ALLOW_HINT}")


def redact_url(url: str) -> str:
    """``url`` with the password, if any, replaced by ``***``."""
    return _URL_PASSWORD.sub(r"\1:***@", url)


def describe_client(client: Any) -> str:
    """Where ``client`` connects, as a URL without the password (for error messages)."""
    pool = getattr(client, "connection_pool", None)
    service = getattr(pool, "service_name", None)
    if service:
        return f"Sentinel service {service!r}"
    kwargs: dict[str, Any] = getattr(pool, "connection_kwargs", None) or {}
    db = kwargs.get("db", 0)
    if kwargs.get("path"):
        return f"unix://{kwargs['path']}?db={db}"
    if "host" not in kwargs:
        return f"an unknown address ({type(client).__name__})"
    connection_class = getattr(pool, "connection_class", None)
    scheme = "rediss" if "SSL" in getattr(connection_class, "__name__", "") else "redis"
    username = kwargs.get("username") or ""
    if kwargs.get("password"):
        auth = f"{username}:***@"
    else:
        auth = f"{username}@" if username else ""
    return f"{scheme}://{auth}{kwargs['host']}:{kwargs.get('port', 6379)}/{db}"


def unavailable(
    client: Any, action: str, exc: RedisError | RedisClusterException
) -> StoreUnavailableError:
    """The :class:`~taskdedup.StoreUnavailableError` for ``exc``, raised by ``client`` while
    taskdedup tried to ``action``: where, what happened and what to change, without the
    password."""
    where = describe_client(client)
    detail = f"{type(exc).__name__}: {exc}"
    if isinstance(exc, AuthenticationError):
        what = (
            f"Redis at {where} refused the credentials ({detail}); check the user and "
            "password"
        )
    elif isinstance(exc, (RedisConnectionError, RedisTimeoutError)):
        what = (
            f"Redis at {where} is unreachable ({detail}); is Redis running at {where}? The "
            "locks live where the store points: DedupQueue(dedup_store=...) or the "
            "taskdedup_store / taskdedup_url setting (in tests without a server: a "
            "MemoryStore, fakeredis[lua], or the taskdedup_redis_url fixture)"
        )
    elif isinstance(exc, ReadOnlyError):
        what = (
            f"Redis at {where} is a read-only replica ({detail}); point taskdedup at the "
            "primary"
        )
    elif isinstance(exc, NoPermissionError):
        what = (
            f"the Redis user at {where} lacks a permission ({detail}); allow EVALSHA, "
            "EVAL, SCRIPT LOAD, SCAN and the lock key prefix"
        )
    else:
        what = f"Redis at {where} answered with an error ({detail})"
    message = f"taskdedup could not {action}: {what}; {_ALLOW_HINT}"
    pool = getattr(client, "connection_pool", None)
    password = (getattr(pool, "connection_kwargs", None) or {}).get("password")
    if password:
        message = message.replace(str(password), "***")
    return StoreUnavailableError(message)


class RedisStore:
    """A :class:`~taskdedup.stores.Store` over Redis or Valkey, through a ``redis.Redis`` client.

    Works with any ``redis.Redis`` client, with or without ``decode_responses``. Every
    transition is one EVALSHA round trip; every ``redis.exceptions.RedisError`` is raised as
    :class:`~taskdedup.StoreUnavailableError` (chained), saying where and what to do.

    Args:
        client: the connection to use; :meth:`close` closes it.

    Example::

        store = RedisStore.from_url("redis://localhost:6379/0")
        store.reserve("taskdedup:charge:1f0c...", owner="task-id", ttl_ms=600_000)
    """

    #: reserve_many sends at most this many items per pipeline round trip.
    bulk_chunk = 10_000

    #: :meth:`claim` and :meth:`send_claim` take the hints ``reserved=`` and ``check=`` (the
    #: deduplicator passes them to a store that says so).
    claim_takes_reserved = True

    def __init__(self, client: redis.Redis, *, compact_owners: bool = False,
                 compare_and_set: bool = True) -> None:
        self.client = client
        self.compact_owners = compact_owners
        """Write UUID owners compact (:mod:`.owners`); both forms are read either way."""
        self._stored: Callable[[str], str] = compact_owner if compact_owners else str
        # register_script is local (it only hashes the source); nothing is sent until used.
        self._scripts: dict[str, Script] = {
            name: client.register_script(source) for name, source in SCRIPTS.items()
        }
        self._reserve = self._scripts["reserve"]
        self._replace = self._scripts["replace"]
        self._claim = self._scripts["claim"]
        self._heartbeat = self._scripts["heartbeat"]
        self._complete = self._scripts["complete"]
        self._release = self._scripts["release"]
        self._get = self._scripts["get"]
        # Whether reserve_many may assume the server has the reserve script.
        self._bulk_ready = False
        # How reserve_many takes a pooled connection for its raw exchange (None: a pipeline).
        self._take_connection = raw_exchange(client)
        # Completions sent at once whose replies are read later (complete_later).
        self._loaded: set[str] = set()  # scripts sent on trails that the server has
        self._trails = None if self._take_connection is None else Trails(
            self._take_connection, self._give_back, _pack, self._redo)
        # Whether the worker's claim and completion go as one SET IFEQ (:mod:`.cas`): None
        # until the server is asked (:meth:`_swaps`), False when it cannot or must not.
        self._cas: bool | None = None if compare_and_set and self._trails else False
        self._ask_after = 0.0  # monotonic time before which an unanswered probe is not redone
        self._probe_prefix = "taskdedup"  # the probe's key goes under it (check_server)
        # The argument check (an explicit key's digest) of locks this process claimed holding
        # one, by (key, stored owner): their completion swaps at once (``cas.held_check``).
        self._checks: dict[tuple[str, str], str] = {}

    @classmethod
    def from_url(cls, url: str, *, compact_owners: bool = False, compare_and_set: bool = True,
                 **client_kwargs: Any) -> RedisStore:
        """A store on a new client for ``url``.

        Accepts ``redis://``, ``rediss://`` (TLS), ``unix://``, and ``valkey://`` /
        ``valkeys://`` (rewritten to ``redis://`` / ``rediss://``). ``client_kwargs`` go to
        ``redis.Redis.from_url``; unless given, ``socket_timeout=5``,
        ``socket_connect_timeout=5`` and ``health_check_interval=30`` so a dead server is
        reported in seconds rather than hanging a producer. ``compact_owners``: write UUID
        owners compact (:mod:`taskdedup.stores.owners`); ``compare_and_set``: see
        :attr:`compare_and_set`.

        Raises:
            ConfigurationError: the URL has another scheme or cannot be parsed.
        """
        scheme, sep, rest = url.partition("://")
        target = _SCHEMES.get(scheme.lower()) if sep else None
        if target is None:
            raise ConfigurationError(
                f"unsupported store URL {redact_url(url)!r}: use redis://, rediss://, unix://, "
                "valkey:// or valkeys://, e.g. redis://localhost:6379/0"
            )
        client_kwargs.setdefault("socket_timeout", 5)
        client_kwargs.setdefault("socket_connect_timeout", 5)
        client_kwargs.setdefault("health_check_interval", 30)
        try:
            client = redis.Redis.from_url(f"{target}://{rest}", **client_kwargs)
        except ValueError as exc:
            raise ConfigurationError(f"invalid store URL {redact_url(url)!r}: {exc}") from exc
        return cls(client, compact_owners=compact_owners, compare_and_set=compare_and_set)

    @property
    def compare_and_set(self) -> bool:
        """Whether a worker's claim and completion go as one ``SET … IFEQ`` (Valkey 8.1+:
        :mod:`taskdedup.stores.cas`) instead of a script. The server is asked once (here,
        or on the first claim); False on servers without it, for a client without its own
        pool, or when the store was made with ``compare_and_set=False``."""
        return self._swaps()

    def swaps(self, prefix: str) -> bool:
        """:attr:`compare_and_set`, the server asked (if it was not yet) with its probe key
        under ``prefix``: the locks' prefix, which a least-privilege user's ACL reaches."""
        self._probe_prefix = prefix
        return self._swaps()

    def _swaps(self) -> bool:
        """Whether to send the worker's transitions as a swap (asks the server once)."""
        if self._cas is None:
            if time.monotonic() < self._ask_after:
                return False
            try:
                self._cas = cas.probe(self._exchange, self._probe_prefix)
            except RedisError:  # not reachable now: the scripts meanwhile, asked again later
                self._ask_after = time.monotonic() + _ASK_AGAIN
                return False
            logger.debug("taskdedup: %s: claims and completions %s", describe_client(
                self.client), "swap with SET IFEQ" if self._cas else "run their scripts")
        return self._cas

    def _held(self, key: str, stored: str, check: str) -> None:
        """Remember the check of a lock this process now runs (its completion expects it)."""
        checks = self._checks
        if len(checks) >= _CHECKS_KEPT:  # completions never made (a lost process's): oldest
            try:
                del checks[next(iter(checks))]
            except (RuntimeError, StopIteration, KeyError):  # another thread changed it
                pass
        checks[key, stored] = check

    def _swap_refused(self, exc: ResponseError) -> None:
        """A swap answered an error (the script makes the step, and reports any error that is
        not about the swap). A syntax error means the server no longer takes ``IFEQ`` (a
        failover to an older server): the scripts make every step from now on. Others (a
        foreign key's type, OOM, READONLY) say nothing about the swap and change nothing."""
        text = str(exc).lower()
        if self._cas and ("syntax" in text or "ifeq" in text):
            self._cas = False
            logger.warning("taskdedup: %s refused SET IFEQ (%s): claims and completions run "
                           "their scripts from now on", describe_client(self.client), exc)

    def stored_owner(self, owner: str) -> str:
        """``owner`` as this store writes it into a lock (compact or as given), for callers
        that send a lock script themselves (:func:`reserve_and_run`, :mod:`taskdedup.flow`)."""
        return self._stored(owner)

    def __repr__(self) -> str:
        return f"<RedisStore {describe_client(self.client)}>"

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    # -- plumbing ---------------------------------------------------------------------------

    def _unavailable(
        self, action: str, exc: RedisError | RedisClusterException
    ) -> StoreUnavailableError:
        return unavailable(self.client, action, exc)

    def _eval(self, script: Script, action: str, key: str, *args: str | int) -> Any:
        """EVALSHA ``script`` on ``key`` in one round trip; EVAL it on NOSCRIPT.

        EVAL both runs the script and puts it back in the server's script cache, so the
        next EVALSHA finds it: recovering costs one extra round trip, once.
        """
        client = self.client
        try:
            try:
                return client.execute_command(  # type: ignore[no-untyped-call]
                    "EVALSHA", script.sha, 1, key, *args, **_RAW
                )
            except NoScriptError:
                return client.execute_command(  # type: ignore[no-untyped-call]
                    "EVAL", script.script, 1, key, *args, **_RAW
                )
        except RedisError as exc:
            raise self._unavailable(f"{action} {key!r}", exc) from exc

    def _redo(self, command: tuple[Any, ...]) -> Any:
        """An ``EVALSHA`` (or a swap) sent on a trail (:meth:`complete_later`, a claim) made
        again as an ordinary call."""
        if command[0] == "SET":  # a swap: idempotent for its owner, as the scripts are
            try:
                return self._exchange([command])[0]
            except RedisError as exc:
                raise self._unavailable(f"{command[0]} {command[1]!r}", exc) from exc
        _, sha, _, key, *args = command
        name = next(name for name, s in self._scripts.items() if s.sha == sha)
        self._loaded.discard(name)  # NOSCRIPT, or a new connection: load it first
        return self._eval(self._scripts[name], name, key, *args)

    def _eval_window(self, script: Script, action: str, key: str, window: Probe | None,
                     *args: str | int) -> Any:
        """:meth:`_eval` of ``script`` on ``key`` and, under ``window``, the slice keys around
        the server's clock and the window argument after ``args``. A reply telling that the
        keys missed the server's clock (a caller off by more than a slice; nothing was
        written) is followed by the same call with keys around the server's time."""
        if window is None:
            return self._eval(script, action, key, *args)
        for _ in range(_WINDOW_TRIES):
            keys, extra = window_keys(key, window)
            reply = self._eval_keys(script, action, keys, *args, *extra)
            if not _late(reply):
                return reply
        raise _clock_error(key)

    def _eval_keys(self, script: Script, action: str, keys: list[str], *args: str | int) -> Any:
        """:meth:`_eval` with several keys (an approximate window's lock and its slices, all
        of one hash tag: one slot)."""
        if len(keys) == 1:
            return self._eval(script, action, keys[0], *args)
        client = self.client
        try:
            try:
                return client.execute_command(  # type: ignore[no-untyped-call]
                    "EVALSHA", script.sha, len(keys), *keys, *args, **_RAW
                )
            except NoScriptError:
                return client.execute_command(  # type: ignore[no-untyped-call]
                    "EVAL", script.script, len(keys), *keys, *args, **_RAW
                )
        except RedisError as exc:
            raise self._unavailable(f"{action} {keys[0]!r}", exc) from exc

    # -- the Store protocol -----------------------------------------------------------------

    def reserve(
        self, key: str, owner: str, ttl_ms: int, check: str = "", *, fresh: bool = False,
        window: Probe | None = None,
    ) -> LockResult:
        """See :meth:`taskdedup.stores.Store.reserve`; ``window``: an approximate window's
        probe of this identity (its live slices are checked in the same script)."""
        check_owner(owner)
        check_ms("ttl_ms", ttl_ms)
        check_check(check)
        return _result(self._eval_window(self._reserve, "reserve", key, window,
                                         self._stored(owner), ttl_ms, check,
                                         "1" if fresh else "0"))

    def send_reserve(
        self, key: str, owner: str, ttl_ms: int, check: str = "", *, fresh: bool = False,
        replace: bool = False,
    ) -> SentReserve | None:
        """Send :meth:`reserve` (or :meth:`replace`) without waiting for its reply, so the
        caller can do other work (build its message) while Redis runs the script; read the
        answer with :meth:`SentReserve.read`. None when this client lends no connection of
        its own (a single-connection client, Cluster, a redis-py without what the raw
        exchange needs): then call :meth:`reserve`.

        The command goes out on a connection taken from the pool for this call alone
        (thread safe), which goes back once the reply is read; a connection error while
        sending falls back to :meth:`reserve` through the client (its retries, its errors).
        """
        if self._take_connection is None:
            return None
        check_owner(owner)
        check_ms("ttl_ms", ttl_ms)
        if check:  # "" (no explicit key) needs no pattern
            check_check(check)
        script = self._replace if replace else self._reserve
        return self._send(script, "replace" if replace else "reserve", key,
                          self._stored(owner), ttl_ms, check, "1" if fresh else "0")

    def send_claim(self, key: str, owner: str, lease_ms: int, *, reserved: bool = True,
                   check: str = "") -> SentClaim | SentReserve | None:
        """Send :meth:`claim` (no approximate window) without waiting for its reply, so the
        worker can do other work (kombu's own round trip) while Redis runs the script; its
        ``read()`` answers as :meth:`claim` does. It goes out on this thread's connection
        for completions (:mod:`.trail`), after the completions sent before it (the server
        runs them first: the same identity may follow at once), and its reply is read with
        theirs, often in the same socket read. None as for :meth:`send_reserve`.
        ``reserved``, ``check``: as in :meth:`claim`."""
        if self._take_connection is None:
            return None
        check_owner(owner)
        check_ms("lease_ms", lease_ms)
        if self._trails is None:  # completions wait for their replies: nothing owed
            return self._send(self._claim, "claim", key, self._stored(owner), lease_ms)
        return self._trail_claim(key, owner, lease_ms, reserved, check)  # unsent: read() calls

    def carry_claim(self, key: str, owner: str, lease_ms: int, *, reserved: bool = True,
                    check: str = "") -> SentClaim | None:
        """:meth:`send_claim` for a transaction another client sends anyway, on this store's
        server and database, to carry (kombu's unacked record of the message:
        :mod:`taskdedup.celery.ahead`): no command of its own. The carrier adds
        ``sent.command`` to its transaction and passes that command's reply, undecoded, to
        ``sent.reply``; a claim whose reply never came is made by ``read()`` as an ordinary
        call. None as for :meth:`send_claim`."""
        if self._take_connection is None:
            return None
        check_owner(owner)
        check_ms("lease_ms", lease_ms)
        sent = SentClaim(self, key, owner, lease_ms)
        sent.command = self._claim_command(sent, reserved, check)
        return sent

    def handed_claim(self, key: str, owner: str, check: str = "") -> HandedClaim:
        """A claim of ``key`` for ``owner`` that another process of this worker made on this
        store's server and handed to this one (:mod:`taskdedup.celery.handover`), for
        ``Deduplicator.start(..., sent=...)``: it reads as acquired, with no command; the
        completion then expects ``check`` (an explicit key's argument check, as the claim's
        swap did)."""
        check_owner(owner)
        return HandedClaim(self, key, owner, check if _CHECK.fullmatch(check) else "")

    def _trail_claim(self, key: str, owner: str, lease_ms: int, reserved: bool = True,
                     check: str = "") -> SentClaim:
        """A claim sent on this thread's trail, behind its completions."""
        sent = SentClaim(self, key, owner, lease_ms)
        command = self._claim_command(sent, reserved, check)
        sent.trail = self._trails.send(command, sent.reply)  # type: ignore[union-attr]
        return sent

    def _claim_command(self, sent: SentClaim, reserved: bool, check: str) -> tuple[Any, ...]:
        """The first command of ``sent``'s claim: a swap where the server takes one
        (:mod:`.cas`, the reply it expects kept on ``sent``), else the script."""
        stored = self._stored(sent._owner)
        if not self._swaps():
            return ("EVALSHA", self._claim.sha, 1, sent.key, stored, sent._lease_ms)
        if not _CHECK.fullmatch(check):
            check = ""  # a hint from a message: only ever a digest, else none
        command, sent.expect = cas.claim_command(sent.key, stored, sent._lease_ms,
                                                 reserved=reserved, check=check)
        sent.check = check
        return command

    def _claim_script(self, key: str, owner: str, lease_ms: int) -> LockResult:
        """The claim by its script (``claim.lua``): every case of the state machine."""
        return _result(self._eval(self._claim, "claim", key, self._stored(owner), lease_ms))

    def _send(self, script: Script, action: str, key: str, *args: str | int) -> SentReserve:
        """``EVALSHA script 1 key *args`` written on a lent connection, its reply unread."""
        sent = SentReserve(self, script, action, key, args)
        try:
            conn = self._lend()
        except RedisError:
            return sent  # read() makes the call through the client
        try:
            conn.send_packed_command(_pack(conn, [("EVALSHA", script.sha, 1, key, *args)]))
        except BaseException as exc:
            self._drop(conn)
            if not isinstance(exc, RedisError):
                raise
            return sent
        sent.conn = conn
        return sent

    def _lend(self) -> Any:
        """A connection of the client's pool for one send and its read (thread safe)."""
        return self._take_connection()  # type: ignore[misc]

    def _give_back(self, conn: Any) -> None:
        """Return a connection whose reply was read to the pool."""
        self.client.connection_pool.release(conn)

    def _drop(self, conn: Any) -> None:
        """Close ``conn`` (whatever it holds unread) and give it back to the pool."""
        try:
            conn.disconnect()
        finally:
            self.client.connection_pool.release(conn)

    def replace(
        self, key: str, owner: str, ttl_ms: int, check: str = "", *, fresh: bool = False,
        window: Probe | None = None,
    ) -> LockResult:
        """See :meth:`taskdedup.stores.Store.replace` (``window`` as in :meth:`reserve`)."""
        check_owner(owner)
        check_ms("ttl_ms", ttl_ms)
        check_check(check)
        return _result(self._eval_window(self._replace, "replace", key, window,
                                         self._stored(owner), ttl_ms, check,
                                         "1" if fresh else "0"))

    def claim(
        self, key: str, owner: str, lease_ms: int, *, window: Probe | None = None,
        reserved: bool = True, check: str = "",
    ) -> LockResult:
        """See :meth:`taskdedup.stores.Store.claim` (``window`` as in :meth:`reserve`).
        ``reserved``: whether the caller's own QUEUED lock is expected (False for
        ``while_executing``, which reserves nothing); ``check``: the argument check it is
        expected to hold (an explicit key's digest). Both pick the swap tried first, never
        the outcome."""
        check_owner(owner)
        check_ms("lease_ms", lease_ms)
        if self._trails is not None:
            if window is None:  # on the completions' connection, behind them: one read
                sent = self._trail_claim(key, owner, lease_ms, reserved, check)
                if sent.trail is not None:
                    return sent.read()
            self._trails.settle_mine()  # the last completion's reply, arrived meanwhile
        return _result(self._eval_window(self._claim, "claim", key, window,
                                         self._stored(owner), lease_ms))

    def remember(
        self, key: str, owner: str, window: Probe, *, finished_ms: int = 0
    ) -> Remembered:
        """Success under an approximate window: the owner's RUNNING lock is deleted (or left
        as the FINISHED tombstone for ``finished_ms``) and the identity added to the current
        slice on the server's clock (with the pair of the identity and its argument check,
        for an explicit key), in one script (``complete.lua``)."""
        check_owner(owner)
        check_ms("finished_ms", finished_ms, allow_zero=True)
        reply = self._eval_window(self._complete, "complete", key, window,
                                  self._stored(owner), finished_ms)
        if isinstance(reply, list):
            return Remembered(_OUTCOMES[reply[0]], int(reply[1]), bool(reply[2]),
                              int(reply[3]))
        return Remembered(_OUTCOMES[reply])

    def heartbeat(self, key: str, owner: str, lease_ms: int) -> Outcome:
        """See :meth:`taskdedup.stores.Store.heartbeat`."""
        check_owner(owner)
        check_ms("lease_ms", lease_ms)
        return _OUTCOMES[self._eval(self._heartbeat, "renew the lease of", key,
                                    self._stored(owner), lease_ms)]

    def complete(self, key: str, owner: str, ttl_ms: int, *, finished_ms: int = 0) -> Outcome:
        """See :meth:`taskdedup.stores.Store.complete`."""
        owner, swap = self._completion(key, owner, ttl_ms, finished_ms)
        if swap is not None:
            try:
                reply = self._exchange([swap[0]])[0]
            except RedisError as exc:
                raise self._unavailable(f"complete {key!r}", exc) from exc
            if reply == swap[1]:
                return Outcome.OK
            if isinstance(reply, ResponseError):
                self._swap_refused(reply)
        return self._complete_script(key, owner, ttl_ms, finished_ms)

    def _completion(self, key: str, owner: str, ttl_ms: int, finished_ms: int
                    ) -> tuple[str, tuple[tuple[Any, ...], bytes] | None]:
        """A completion's arguments checked, the owner as stored, and its swap (:mod:`.cas`:
        with the check remembered from the claim), or None where the script makes it."""
        check_owner(owner)
        check_ms("ttl_ms", ttl_ms, allow_zero=True)
        if finished_ms:
            check_ms("finished_ms", finished_ms)
        stored = self._stored(owner)
        check = self._checks.pop((key, stored), "")
        if not self._swaps():
            return stored, None
        return stored, cas.complete_command(key, stored, ttl_ms, finished_ms, check)

    def _complete_script(self, key: str, stored: str, ttl_ms: int, finished_ms: int) -> Outcome:
        """The completion by its script (``complete.lua``): every case of the state
        machine. ``stored``: the owner as this store writes it."""
        if finished_ms:
            return _OUTCOMES[self._eval(self._complete, "complete", key, stored, ttl_ms,
                                        finished_ms)]
        return _OUTCOMES[self._eval(self._complete, "complete", key, stored, ttl_ms)]

    def complete_later(
        self, key: str, owner: str, ttl_ms: int, on_outcome: Callable[[Any], None], *,
        finished_ms: int = 0, hold: bool = False,
    ) -> bool:
        """:meth:`complete`, sent at once, its reply read later (:mod:`.trail`): the
        worker's next task does not wait a round trip for it. ``on_outcome`` gets the
        :class:`Outcome`, or the :class:`StoreUnavailableError`, when the reply is read (on
        this thread's next claim, from the heartbeat thread soon after, or at exit). False:
        nothing was sent (no raw connection here, or the send failed); call :meth:`complete`.
        ``hold``: no copy of this call can follow it (the caller says so), so the completion
        may wait up to :data:`~.trail.HOLD_FOR` for a transaction this thread sends anyway,
        where this thread holds (:meth:`carry_held`)."""
        if self._trails is None:
            check_owner(owner)
            check_ms("ttl_ms", ttl_ms, allow_zero=True)
            return False
        stored, swap = self._completion(key, owner, ttl_ms, finished_ms)
        if swap is not None:
            command, expect = swap

            def swapped(reply: Any) -> None:
                if reply == expect:
                    on_outcome(Outcome.OK)
                    return
                if isinstance(reply, ResponseError):
                    self._swap_refused(reply)
                elif isinstance(reply, RedisError):  # the redo failed: unreachable
                    on_outcome(self._unavailable(f"complete {key!r}", reply))
                    return
                elif isinstance(reply, Exception):
                    on_outcome(reply)
                    return
                try:  # not swapped: the script says what the lock was (one more round trip)
                    outcome: Any = self._complete_script(key, stored, ttl_ms, finished_ms)
                except StoreUnavailableError as exc:
                    outcome = exc
                on_outcome(outcome)

            if hold and self._trails.hold(command, swapped):
                return True
            return self._trails.send(command, swapped) is not None
        args: tuple[Any, ...] = (stored, ttl_ms, finished_ms) if finished_ms else (stored, ttl_ms)

        def outcome(reply: Any) -> None:
            if isinstance(reply, RedisError):
                reply = self._unavailable(f"complete {key!r}", reply)
            on_outcome(reply if isinstance(reply, Exception) else _OUTCOMES[reply])

        return self._eval_later("complete", key, args, outcome, hold=hold) is not None

    def hold_here(self, wake: Callable[[], None] | None) -> bool:
        """Let this thread hold its completions for a transaction it sends anyway on this
        store's server and database (kombu's record of the next message:
        :mod:`taskdedup.celery.ahead`), which takes them with :meth:`carry_held`. ``wake``
        is called as a first one is held, to have :meth:`flush_held` called on this thread
        within :data:`~.trail.HOLD_FOR`; None: this thread sends at once again. False: this
        store cannot hold (its completions wait for their replies)."""
        if self._trails is None:
            return False
        self._trails.hold_here(wake)
        return True

    def carry_held(self) -> list[tuple[tuple[Any, ...], Callable[[Any], None]]]:
        """The completions this thread holds, ``(command, on_reply)``, for its transaction
        to carry; it passes their replies (undecoded, errors as exceptions) to
        :meth:`held_replies`, or None when it was refused (they then go out on their own)."""
        return [] if self._trails is None else self._trails.take_held()

    def held_replies(self, held: list[tuple[tuple[Any, ...], Callable[[Any], None]]],
                     replies: list[Any] | None) -> None:
        """Report what the transaction that carried ``held`` (:meth:`carry_held`) answered."""
        if self._trails is not None:
            self._trails.carried(held, replies)

    def flush_held(self) -> float | None:
        """Send the completions this thread has held for :data:`~.trail.HOLD_FOR`; seconds
        until the rest are due, or None when none are held."""
        return None if self._trails is None else self._trails.flush_mine()

    def slot_release_later(self, key: str, holder: str,
                           on_outcome: Callable[[Any], None]) -> bool:
        """:meth:`slot_release`, sent at once, its reply read later (:mod:`.trail`), as a
        completion is: the slot is free as soon as the server reads the command, and the
        worker's next task does not wait a round trip for the reply. ``on_outcome`` gets the
        :class:`Outcome`, or the :class:`StoreUnavailableError`. False: nothing was sent;
        call :meth:`slot_release`."""
        check_owner(holder)
        if self._trails is None:
            return False

        def outcome(reply: Any) -> None:
            if isinstance(reply, RedisError):
                reply = self._unavailable(f"give back the slot of {key!r}", reply)
            on_outcome(reply if isinstance(reply, Exception) else _OUTCOMES[reply])

        return self._eval_later("limit_release", key, (holder,), outcome) is not None

    def _eval_later(self, name: str, key: str, args: tuple[Any, ...],
                    on_reply: Callable[[Any], None], *, hold: bool = False) -> Any:
        """``EVALSHA`` of script ``name`` sent on this thread's trail, its reply (or the
        error of its redo) to ``on_reply`` when read: the trail, or None when nothing was
        sent. The script is loaded first, once (else the first would be NOSCRIPT, made again
        only at settle)."""
        trails = self._trails
        if trails is None:
            return None
        script = self._scripts[name]
        if name not in self._loaded:
            try:
                self.client.script_load(script.script)
            except (NoPermissionError, ResponseError):  # a user without SCRIPT LOAD
                self._trails = None  # replies are waited for, as before
                trails.settle()
                return None
            except RedisError:
                return None
            self._loaded.add(name)
        command = ("EVALSHA", script.sha, 1, key, *args)
        if hold and trails.hold(command, on_reply):
            return True
        return trails.send(command, on_reply)

    def _eval_behind(self, name: str, action: str, key: str, *args: str | int) -> Any:
        """:meth:`_eval` of script ``name``, sent on this thread's trail behind the
        commands it went out with before (the server runs them first: a slot given back
        is free for this thread's next acquire) and read with their replies. Only for a
        script that is idempotent for its arguments: a connection that breaks before the
        reply is read has it made again."""
        got: list[Any] = []
        trails = self._trails  # the trail belongs to it, whatever this store turns to meanwhile
        trail = None if trails is None else self._eval_later(name, key, args, got.append)
        if trails is None or trail is None:
            return self._eval(self._scripts[name], action, key, *args)
        trails.settle_trail(trail)
        reply = got[0]
        if isinstance(reply, RedisError):
            raise self._unavailable(f"{action} {key!r}", reply) from reply
        if isinstance(reply, Exception):
            raise reply
        return reply

    def settle(self, older_than: float | None = None) -> bool:
        """Read the replies :meth:`complete_later` left unread (all of them, or those older
        than ``older_than`` seconds); whether some are still owed."""
        if self._trails is None:
            return False
        if older_than is None:
            self._trails.settle()
            return False
        return self._trails.settle_idle(older_than)

    def release(self, key: str, owner: str, *, only_queued: bool = False) -> Outcome:
        """See :meth:`taskdedup.stores.Store.release`."""
        check_owner(owner)
        only = "Q" if only_queued else ""
        stored = self._stored(owner)
        if not only_queued:
            self._checks.pop((key, stored), None)
        return _OUTCOMES[self._eval(self._release, "release", key, stored, only)]

    # -- per-key limits (SPEC §16: taskdedup.limits) -----------------------------------------

    def slot_acquire(self, key: str, holder: str, limit: int, lease_ms: int) -> tuple[bool, int]:
        """Take a slot of a concurrency limit (``limit_acquire.lua``): ``(True, holders)``,
        or ``(False, ms until the earliest holder's lease ends)``."""
        check_owner(holder)
        check_ms("lease_ms", lease_ms)
        taken, figure = self._eval_behind("limit_acquire", "take a slot of", key, holder,
                                          limit, lease_ms)
        return bool(taken), int(figure)

    def slot_heartbeat(self, key: str, holder: str, lease_ms: int) -> Outcome:
        """Renew a slot's lease (``limit_heartbeat.lua``): OK, or NOT_OWNER when it lapsed."""
        check_owner(holder)
        check_ms("lease_ms", lease_ms)
        return _OUTCOMES[self._eval(self._scripts["limit_heartbeat"], "renew the slot of",
                                    key, holder, lease_ms)]

    def slot_release(self, key: str, holder: str) -> Outcome:
        """Give back a slot, or take back a rate limit's start (``limit_release.lua``)."""
        check_owner(holder)
        return _OUTCOMES[self._eval(self._scripts["limit_release"], "give back the slot of",
                                    key, holder)]

    def rate_acquire(self, key: str, member: str, limit: int, per_ms: int) -> tuple[bool, int]:
        """Record a start under a rate limit (``rate_acquire.lua``): ``(True, starts in the
        window)``, or ``(False, ms until the window has room)``, nothing written."""
        check_owner(member)
        check_ms("per_ms", per_ms)
        allowed, figure = self._eval(self._scripts["rate_acquire"], "count a start in", key,
                                     member, limit, per_ms)
        return bool(allowed), int(figure)

    def get(self, key: str) -> LockInfo | None:
        """Read one lock (value and PTTL atomically, one round trip).

        Returns None when the key is absent, and also when it holds something taskdedup
        did not write (another type, or a string that does not parse): such a key still
        blocks :meth:`reserve` and :meth:`claim` (DUPLICATE, unknown owner). ``ttl_ms`` is
        -1 when the key has no expiry.
        """
        value, pttl = self._eval(self._get, "read", key)
        parsed = parse_value(value)
        if parsed is None:
            return None
        state, check, owner = parsed
        return LockInfo(key, state, owner, check, int(pttl))

    # -- beyond the protocol ---------------------------------------------------------------

    def check_server(self, prefix: str | None = None) -> None:
        """Warn once per process if this server may evict locks (``stores/server.py``), and
        ask it whether it swaps (:mod:`.cas`), so that forked workers know without asking;
        ``prefix``: the locks' key prefix, under which the probe writes its key (a user
        whose ACL reaches only those keys)."""
        server.warn_once(self.client, describe_client(self.client))
        self.swaps(prefix or self._probe_prefix)

    def reserve_many(
        self, items: Sequence[tuple[str, str, int, str]], *, fresh: bool = False,
        windows: Sequence[Probe | None] | None = None,
    ) -> list[LockResult]:
        """:meth:`reserve` each ``(key, owner, ttl_ms, check)`` in one pipeline round trip;
        ``fresh`` applies to every item (see :meth:`taskdedup.stores.Store.reserve`);
        ``windows``, one per item where given: its approximate window's probe, or None.

        Returns one result per item, in order. Each item is atomic on its own; the batch is
        not a transaction. Batches larger than :attr:`bulk_chunk` take one round trip per
        chunk. (Tested on standalone Redis/Valkey; a ``RedisCluster`` client is untested.)

        NOSCRIPT: the first call (and the first after a NOSCRIPT) puts ``SCRIPT LOAD``
        ahead of the EVALSHAs in the same pipeline; items answered NOSCRIPT anyway (the
        server lost its scripts since) are sent again once, with the load in front.

        Raises:
            StoreUnavailableError: Redis could not be reached or answered an error; items
                before the failure may be reserved (they expire with their ``ttl_ms``).
        """
        for _, owner, ttl_ms, check in items:
            check_owner(owner)
            check_ms("ttl_ms", ttl_ms)
            check_check(check)
        if windows is not None and len(windows) != len(items):
            raise ValueError("reserve_many: one window (or None) per item")
        results: list[LockResult] = []
        chunk = self.bulk_chunk
        for start in range(0, len(items), chunk):
            results.extend(self._reserve_chunk(
                items[start : start + chunk], fresh,
                None if windows is None else windows[start : start + chunk]))
        return results

    def _reserve_chunk(
        self, items: Sequence[tuple[str, str, int, str]], fresh: bool = False,
        windows: Sequence[Probe | None] | None = None,
    ) -> list[LockResult]:
        script = self._reserve
        flag = "1" if fresh else "0"
        results: list[LockResult | None] = [None] * len(items)
        pending: Sequence[int] = range(len(items))
        # KEYS and ARGV per item: the lock (and a window's slice keys), then the arguments
        stored = self._stored
        calls: list[tuple[Any, ...]] = [(1, key, stored(owner), ttl_ms, check, flag)
                                        for key, owner, ttl_ms, check in items]

        def windowed(index: int, window: Probe) -> tuple[Any, ...]:
            key, owner, ttl_ms, check = items[index]
            keys, extra = window_keys(key, window)
            return (len(keys), *keys, stored(owner), ttl_ms, check, flag, *extra)

        for index, window in enumerate(windows or ()):
            if window is not None:
                calls[index] = windowed(index, window)
        lost = late = 0
        try:
            while True:
                load = not self._bulk_ready
                if load and isinstance(self.client, RedisCluster):
                    # SCRIPT LOAD cannot ride in a cluster pipeline (it has no key); the
                    # client sends it to every primary.
                    self.client.script_load(script.script)
                    self._bulk_ready, load = True, False
                sha = script.sha
                commands: list[tuple[Any, ...]] = [("EVALSHA", sha, *calls[index])
                                                   for index in pending]
                if load:
                    commands.insert(0, ("SCRIPT", "LOAD", script.script))
                replies = self._exchange(commands)
                if load:
                    if isinstance(replies[0], RedisError):
                        raise replies[0]
                    del replies[0]
                self._bulk_ready = True
                missing = []
                behind = []  # a window's keys missed the server's clock: again around it
                for index, reply in zip(pending, replies, strict=True):
                    if isinstance(reply, NoScriptError):
                        missing.append(index)
                    elif isinstance(reply, RedisError):
                        raise reply
                    elif reply[0] == 0 and windows is not None and _late(reply):
                        behind.append(index)
                    else:
                        results[index] = _result(reply)
                if not missing and not behind:
                    return results  # type: ignore[return-value]  # every slot is filled
                if missing:
                    lost += 1
                    if lost == 2:
                        raise NoScriptError("the server lost the reserve script twice in a row")
                    self._bulk_ready = False
                if behind:
                    late += 1
                    if late == _WINDOW_TRIES:
                        raise _clock_error(items[behind[0]][0])
                    for index in behind:
                        calls[index] = windowed(index, windows[index])  # type: ignore[index,arg-type]
                pending = sorted(missing + behind)
        except (RedisError, RedisClusterException) as exc:
            raise self._unavailable(f"reserve {len(items)} keys", exc) from exc

    def _exchange(self, commands: list[tuple[Any, ...]]) -> list[Any]:
        """Send ``commands`` pipelined on one connection; their replies, errors as values.

        This is what a non-transactional redis-py pipeline does, minus its per-command
        bookkeeping (about 3x the CPU per command): packed with hiredis when available, sent
        in slices so the server starts while later slices are packed, read undecoded. Uses
        the client's retry policy on connection errors (every command here is idempotent
        for its owner). A client without its own pool (single-connection), or a redis-py
        whose connections lack what this needs (``stores/_compat.py``), uses a pipeline.
        """
        client = self.client
        if self._take_connection is None:
            pipe = client.pipeline(transaction=False)
            for command in commands:
                pipe.execute_command(*command, **_RAW)  # type: ignore[no-untyped-call]
            return pipe.execute(raise_on_error=False)
        pool = client.connection_pool
        conn = self._take_connection()

        def send_and_read() -> list[Any]:
            for start in range(0, len(commands), _SEND_SLICE):
                conn.send_packed_command(  # type: ignore[no-untyped-call]
                    _pack(conn, commands[start : start + _SEND_SLICE]), check_health=start == 0
                )
            replies: list[Any] = []
            read = conn.read_response
            for _ in commands:
                try:
                    replies.append(read(disable_decoding=True))
                except ResponseError as exc:
                    replies.append(exc)
            return replies

        try:
            return conn.retry.call_with_retry(
                send_and_read,
                lambda _error: conn.disconnect(),  # type: ignore[no-untyped-call]
            )
        except BaseException:
            # Replies may be left unread on the socket: never hand it back in that state.
            conn.disconnect()  # type: ignore[no-untyped-call]
            raise
        finally:
            pool.release(conn)

    def scan(self, match_prefix: str, count: int = 1000) -> Iterator[str]:
        """Yield every key that starts with ``match_prefix``, with SCAN (never KEYS).

        ``count`` is SCAN's batch hint. As with SCAN, a key may be yielded twice, and keys
        added or removed meanwhile may be missed. Glob characters in the prefix match
        literally.
        """
        pattern = _GLOB_SPECIAL.sub(r"\\\1", match_prefix) + "*"
        try:
            for key in self.client.scan_iter(match=pattern, count=count, **_RAW):
                yield _text(key)
        except RedisError as exc:
            raise self._unavailable(f"scan {pattern!r}", exc) from exc

    def close(self) -> None:
        """Close the client (its connections are returned and disconnected)."""
        self.client.close()


_UNREAD: Any = object()
_CHECK = re.compile(r"(?:[0-9a-f]{32})?")  # an argument check, or none
_SCRIPT: Any = object()  # SentClaim.expect of a claim sent as its script
_ACQUIRED = LockResult(Outcome.ACQUIRED)


class SentClaim:
    """A claim sent by :meth:`RedisStore.send_claim` on a trail, or carried by another
    client's transaction (:meth:`RedisStore.carry_claim`), its reply not read yet.

    Read it once with :meth:`read`, from any thread; :meth:`discard` reads and drops it.
    """

    __slots__ = ("_lease_ms", "_owner", "_reply", "_store", "check", "command", "expect", "key",
                 "trail")

    def __init__(self, store: RedisStore, key: str, owner: str, lease_ms: int) -> None:
        self._store = store
        self.expect: Any = _SCRIPT
        """For a swap (:mod:`.cas`): the reply that says it was made; else the claim ran
        its script."""
        self.check = ""
        """The argument check the swap expected (remembered for the completion)."""
        self.key = key
        """The lock key the claim is about."""
        self._owner = owner
        self._lease_ms = lease_ms
        self._reply: Any = _UNREAD
        self.trail: Any = None
        """The trail it went out on (None: it could not be sent; :meth:`read` claims)."""
        self.command: tuple[Any, ...] | None = None
        """The command for a carrier to send (:meth:`RedisStore.carry_claim`), else None."""

    def reply(self, reply: Any) -> None:
        """The trail's callback: the reply, or the error the call ended with."""
        self._reply = reply

    def read(self) -> LockResult:
        """The store's answer, as :meth:`RedisStore.claim` gives it. A claim that could not
        be sent is made now; a connection that broke before the reply was read has it made
        again through the client (``complete`` and ``claim`` are the owner's own: a claim
        that had run answers as a copy of this very call).

        Raises:
            StoreUnavailableError: the store answered an error or cannot be reached.
        """
        store, trail, self.trail = self._store, self.trail, None
        if trail is None and self._reply is _UNREAD:  # never sent: the ordinary call
            return store.claim(self.key, self._owner, self._lease_ms)
        if trail is not None and self._reply is _UNREAD:
            store._trails.settle_trail(trail)  # type: ignore[union-attr]
        reply, self._reply = self._reply, _UNREAD
        if reply is _UNREAD:  # cannot be: a second claim would answer as a copy of this one
            raise StoreUnavailableError(f"claim {self.key!r}: its reply was not read")
        if isinstance(reply, StoreUnavailableError):
            raise reply
        if self.expect is not _SCRIPT:  # a swap
            if reply == self.expect:
                if self.check:
                    store._held(self.key, store._stored(self._owner), self.check)
                return _ACQUIRED
            if isinstance(reply, ResponseError):
                store._swap_refused(reply)
            elif isinstance(reply, RedisError):
                raise store._unavailable(f"claim {self.key!r}", reply) from reply
            elif isinstance(reply, BaseException):
                raise reply
            # not swapped: the script applies the whole state machine (one more round trip)
            result = store._claim_script(self.key, self._owner, self._lease_ms)
            stored = store._stored(self._owner)
            check = cas.held_check(reply, stored)  # an explicit key's lock: remembered, so
            if check and result.outcome is Outcome.ACQUIRED:  # its completion swaps at once
                store._held(self.key, stored, check)
            return result
        if isinstance(reply, NoScriptError):  # carried (a trail makes it again itself):
            return store._claim_script(self.key, self._owner, self._lease_ms)  # loads it
        if isinstance(reply, RedisError):
            raise store._unavailable(f"claim {self.key!r}", reply) from reply
        if isinstance(reply, BaseException):
            raise reply
        return _result(reply)

    def discard(self) -> None:
        """Read the reply and drop it (never raises)."""
        trail, self.trail = self.trail, None
        if trail is not None and self._reply is _UNREAD:
            try:
                self._store._trails.settle_trail(trail)  # type: ignore[union-attr]
            except Exception:
                logger.debug("taskdedup: a claim's reply could not be read", exc_info=True)
        self._reply = _UNREAD


class HandedClaim:
    """A claim made by another process and handed over (:meth:`RedisStore.handed_claim`)."""

    __slots__ = ("_check", "_owner", "_store", "key")

    def __init__(self, store: RedisStore, key: str, owner: str, check: str) -> None:
        self._store, self.key, self._owner, self._check = store, key, owner, check

    def read(self) -> LockResult:
        """Acquired: the lock is this owner's, running (the check remembered)."""
        if self._check:
            self._store._held(self.key, self._store._stored(self._owner), self._check)
        return _ACQUIRED

    def discard(self) -> None:
        """Nothing to read."""


class SentReserve:
    """A reservation (or a claim) sent by :meth:`RedisStore.send_reserve` (or
    :meth:`RedisStore.send_claim`) whose reply is not read yet.

    Read it once with :meth:`read`. Its connection is never handed back with a reply left
    on it: :meth:`read` consumes the reply (or drops the connection on any error), and so
    does :meth:`discard`, for a caller that no longer wants the answer.
    """

    __slots__ = ("_action", "_args", "_script", "_store", "conn", "key")

    def __init__(self, store: RedisStore, script: Script, action: str, key: str,
                 args: tuple[str | int, ...]) -> None:
        self._store = store
        self._script = script
        self._action = action
        self.key = key
        """The lock key the command is about."""
        self._args = args
        self.conn: Any = None
        """The connection the command went out on; None once read (or when it could not be
        sent: then :meth:`read` makes the call through the client)."""

    def read(self) -> LockResult:
        """The store's answer, as :meth:`RedisStore.reserve` (or :meth:`RedisStore.claim`)
        gives it.

        A connection that broke before the reply came is dropped; the call is made again
        through the client only when the client retries that error (``retry_on_error``),
        as its own call would (the lost command may have run: a caller whose owner is an id
        made for this call passes ``fresh=False``, so its own reservation is then accepted
        again); else it is a :class:`StoreUnavailableError`, as from :meth:`reserve`. NOSCRIPT is
        answered with EVAL through the client.

        Raises:
            StoreUnavailableError: the store answered an error or cannot be reached.
        """
        conn, self.conn = self.conn, None
        store, key, action, args = self._store, self.key, self._action, self._args
        command = "EVALSHA"
        if conn is not None:
            try:
                reply = conn.read_response(disable_decoding=True)
            except NoScriptError:
                store._give_back(conn)  # the reply is read: clean
                command = "EVAL"  # runs it and caches it again: one more round trip, once
            except ResponseError as exc:
                store._give_back(conn)
                raise store._unavailable(f"{action} {key!r}", exc) from exc
            except (RedisConnectionError, RedisTimeoutError) as exc:
                store._drop(conn)
                # sent again below only where the client's own call would retry it
                if not isinstance(exc, tuple(getattr(conn, "retry_on_error", None) or ())):
                    raise store._unavailable(f"{action} {key!r}", exc) from exc
            except BaseException:
                store._drop(conn)
                raise
            else:
                store._give_back(conn)
                return _result(reply)
        # not sent, or a reply lost: the client's own call (EVAL on NOSCRIPT)
        if command == "EVALSHA":
            return _result(store._eval(self._script, action, key, *args))
        try:
            reply = store.client.execute_command(  # type: ignore[no-untyped-call]
                "EVAL", self._script.script, 1, key, *args, **_RAW)
        except RedisError as exc:
            raise store._unavailable(f"{action} {key!r}", exc) from exc
        return _result(reply)

    def discard(self) -> None:
        """Give the connection back without the answer: read and dropped when it is there
        (the connection closed on any error), so nothing is left unread on it."""
        conn, self.conn = self.conn, None
        if conn is None:
            return
        try:
            conn.read_response(disable_decoding=True)
        except ResponseError:
            pass
        except BaseException:
            self._store._drop(conn)
            return
        self._store._give_back(conn)


def may_have_run(exc: StoreUnavailableError) -> bool:
    """Whether the call that failed with ``exc`` may have run on the server all the same:
    the connection broke or timed out after the command could have been sent (a lost reply),
    as opposed to an error the server answered with (nothing ran)."""
    return isinstance(exc.__cause__, (RedisConnectionError, RedisTimeoutError))


_TRANSIENT_REPLIES = ("OOM", "BUSY", "LOADING", "MASTERDOWN", "TRYAGAIN", "CLUSTERDOWN",
                      "NOSCRIPT", "READONLY")


def refused(exc: StoreUnavailableError) -> bool:
    """Whether Redis refused the call for what it was, not for its state: a missing ACL
    permission (a key outside the user's pattern), a value out of range. Retrying that
    message later would fail the same way forever, so it is the message's error (SPEC §8),
    while a connection error, a failover or OOM is worth a retry."""
    cause = exc.__cause__
    if isinstance(cause, NoPermissionError):
        return True
    if isinstance(cause, ResponseError) and not isinstance(cause, (ReadOnlyError,
                                                                   NoScriptError)):
        return not str(cause).lstrip("-").startswith(_TRANSIENT_REPLIES)
    return False


_ENQUEUE_SHA = hashlib.sha1(SCRIPTS["enqueue"].encode()).hexdigest()
_ENQUEUE_SHA_BYTES = _ENQUEUE_SHA.encode()
_RESENT = "="  # enqueue.lua's ARGV[5] for a call sent again


def reserve_and_run(
    client: redis.Redis, key: str, owner: str, ttl_ms: int, check: str, replace: bool,
    commands: Sequence[Sequence[Any]], peek: str = "", *, resent: bool = False,
    fresh: bool = False, window: Probe | None = None, follow_up: str | None = None,
    guard: bool = False, compact_owners: bool = False,
) -> tuple[LockResult, list[Any] | None]:
    """Reserve ``key`` (or replace, as :meth:`RedisStore.replace`) and, when the gate lets the
    call through, run ``commands`` (the broker's own enqueue: a push, a job write) —
    atomically, in one round trip (``enqueue.lua``).

    For a broker on this very Redis (Celery's ``RedisTransport``, RQ's ``DedupQueue``), called
    with the broker's own client, so it keeps no per-client state: the job is never queued
    without its reservation, nor reserved without being queued, and a duplicate writes
    nothing. All keys must live on one server (not Cluster). With ``peek`` (a key prefix), a
    duplicate's answer also carries ``HGETALL peek + holder`` as a flat list (empty when that
    hash does not exist); otherwise the second item is None. With ``resent`` (this very call
    sent again after a connection error, e.g. kombu's publish retry), a queued lock of this
    owner means the first script ran: it is accepted and ``commands`` do not run a second time.
    With ``fresh`` (a new call, not a retry or a republish of the owner's message, reusing an
    explicit id), the owner's own lock in any state is a duplicate of itself, as in
    :meth:`RedisStore.reserve`. With ``window`` (an approximate window's probe), the live
    slices are checked in the same script, on the server's clock, as in
    :meth:`RedisStore.reserve` (a caller off by more than a slice calls once more, nothing
    having run). With ``follow_up`` (``on_duplicate="coalesce"``: the follow-up record's key,
    in the lock's slot), a call that joins a waiting follow-up or finds the lock running by
    another id runs no command and is answered ``COALESCED`` with the follow-up's id, the
    second item then ``[its generation]`` (:mod:`taskdedup.flow`). With ``guard`` (RQ's
    explicit job id; needs ``peek``), a job ``peek + owner`` that exists and has not ended is
    answered ``ALIVE`` (owner: that id) with its hash, before any gate or command: the check
    an HGET of its status would make first, in the same round trip. ``compact_owners``: the
    lock store's option (:attr:`RedisStore.compact_owners`): ``owner`` is written compact.

    Raises:
        StoreUnavailableError: the script could not run, or one of ``commands`` failed (then
            nothing of this call's reservation is left); the redis error is chained.
    """
    check_owner(owner)
    check_ms("ttl_ms", ttl_ms)
    if check != "":
        check_check(check)
    if compact_owners:
        owner = compact_owner(owner)
    if resent:
        if peek:
            raise ValueError("reserve_and_run: peek and resent exclude each other")
        peek = _RESENT
    if guard and (not peek or peek == _RESENT):
        raise ValueError("reserve_and_run: guard needs peek (the job hash prefix)")
    flags = ("1" if replace else "0") + ("1" if fresh else "0") + ("1" if follow_up else "")
    if guard:
        flags = flags.ljust(3, "0") + "1"
    # numbers and ASCII text go as the bytes redis-py would send (as_sent): a dozen arguments
    head = (as_sent(owner), b"%d" % ttl_ms, check.encode(), flags.encode(), as_sent(peek))
    tail: list[Any] = []
    for command in commands:
        tail.append(b"%d" % len(command))
        tail.extend(as_sent(part) if type(part) is str else part for part in command)
    for _ in range(_WINDOW_TRIES):
        keys, extra = window_keys(key, window)
        if follow_up:
            keys = [*keys, follow_up]  # coalesce takes no window: KEYS[2]
        args: list[Any] = [b"%d" % len(keys), *keys, *head,
                           extra[0] if extra else b"", *tail]
        try:
            try:
                reply = client.execute_command(  # type: ignore[no-untyped-call]
                    "EVALSHA", _ENQUEUE_SHA_BYTES, *args, **_RAW
                )
            except NoScriptError:
                reply = client.execute_command(  # type: ignore[no-untyped-call]
                    "EVAL", SCRIPTS["enqueue"], *args, **_RAW
                )
        except RedisError as exc:
            raise unavailable(client, f"reserve {key!r} and enqueue", exc) from exc
        if window is None or not _late(reply):
            break
    else:
        raise _clock_error(key)
    if reply[0] == Outcome.COALESCED:
        return LockResult(Outcome.COALESCED, owner_text(_text(reply[2]))), [int(reply[3])]
    if reply[0] == Outcome.ALIVE:
        return LockResult(Outcome.ALIVE, owner_text(_text(reply[2]))), reply[3]
    peeked = reply[3] if len(reply) > 3 else None
    return _result(reply[:3]), peeked
