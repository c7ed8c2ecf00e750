"""The reliable fetch: kombu's Redis channel consuming through per-worker processing lists
(SPEC §17; design: ``docs/explanation/fetch.md``).

kombu takes a message with ``BRPOP`` and records it unacked in a second round trip: a worker
killed in between loses it. Here a message moves from its queue into a processing list owned by
this worker in one server step (``fetch.lua``: ``LMOVE`` over the lists in kombu's order, or
``BLMOVE`` on the first of them while all are empty), leaves it on ack (``LREM``), and goes back
to the head of its queue on reject with requeue and on warm shutdown (``requeue.lua``,
``release.lua``). Each owner (one consuming channel of one process) holds a lease that its
fetches and a heartbeat thread renew; every heartbeat also puts back the messages of owners
whose lease lapsed. Nothing is written to kombu's unacked hash, so kombu never restores these
messages by time. Keys: :mod:`taskdedup.processing`.

The channel is :class:`ReliableFetch` mixed into kombu's Redis channel by
:mod:`taskdedup.celery.transport`; it is on when the transport option
``taskdedup_reliable_fetch`` is true (set for a worker by ``taskdedup_reliable_fetch = True``,
see :func:`taskdedup.celery.config.reliable_fetch`). What it relies on in kombu lives in
:mod:`taskdedup.celery._compat`.
"""

from __future__ import annotations

import hashlib
import json
import os
import socket
import threading
import time
import uuid
from collections.abc import Callable, Collection, Iterable, Sequence
from dataclasses import dataclass
from importlib.resources import files
from queue import Empty
from typing import Any

import redis
from kombu.utils.json import dumps as kombu_dumps
from kombu.utils.json import loads as kombu_loads
from redis.commands.core import Script
from redis.exceptions import NoScriptError

from .. import processing
from ..core import DEFAULT_PREFIX
from ..events import logger
from . import _compat

__all__ = [
    "DEFAULT_LEASE",
    "DEFAULT_POLL",
    "OPTIONS",
    "Fetcher",
    "ReliableFetch",
    "ReliableQoS",
    "fetcher_of",
    "requeue_orphans",
]

DEFAULT_LEASE = 30.0
"""Seconds a worker's lease lasts without renewal (``taskdedup_fetch_lease``): after a worker
dies, its messages are back in their queues within about this long (plus a heartbeat)."""
MIN_LEASE = 2.0
"""The shortest lease: four blocking waits must fit in it (see :attr:`Fetcher.wait`)."""
DEFAULT_POLL = 0.2
"""Seconds an idle worker consuming several lists waits on the first one before it looks at
all of them again (``taskdedup_fetch_poll``)."""
OPTIONS = (
    "taskdedup_reliable_fetch",
    "taskdedup_fetch_lease",
    "taskdedup_fetch_poll",
    "taskdedup_prefix",
    "taskdedup_worker",
)
"""The transport options of the reliable fetch (kombu sets them on the channel)."""

_CHUNK = 500  # messages per requeue script
SWEEP_EVERY = 0.5
"""Seconds between two looks, while a worker stops, for held messages whose body already
finished (:meth:`Fetcher.sweep`): well within the shortest tombstone worth having."""

Finished = Callable[[Sequence[bytes]], Collection[bytes]]
"""Which of the given held messages' gated bodies already finished (their lock says so by
their own task id): :func:`taskdedup.celery.stopping.finished_among`."""


def _lua(name: str) -> str:
    return files(__package__).joinpath("lua", f"{name}.lua").read_text(encoding="utf-8")


#: The Lua sources, read once at import (they ship as package data).
SCRIPTS: dict[str, str] = {name: _lua(name) for name in ("fetch", "requeue", "release")}
_FETCH_SHA = hashlib.sha1(SCRIPTS["fetch"].encode("utf-8")).hexdigest()


def redelivered(raw: bytes) -> bytes:
    """``raw`` marked redelivered, as kombu's ``_do_restore_message`` marks a restored message
    (a message that is not kombu's JSON goes back as it was)."""
    try:
        payload = kombu_loads(raw)  # type: ignore[no-untyped-call]
        payload["headers"]["redelivered"] = True
        payload["properties"]["delivery_info"]["redelivered"] = True
    except Exception:
        return raw
    return str(kombu_dumps(payload)).encode()  # type: ignore[no-untyped-call]


@dataclass(frozen=True, eq=False)
class Held:
    """A message in a processing list, as this process holds it: the exact bytes (what
    ``LREM`` compares) and the list it came from."""

    fetcher: Fetcher
    source: str
    raw: bytes


class Fetcher:
    """One owner of processing lists: one consuming channel of one process.

    Its name is ``{worker}/{pid}/{random}`` (the worker's Celery name, else the host name), so
    an operator sees whose messages a list holds; its registry entry says the same as JSON.
    """

    def __init__(self, channel: Any) -> None:
        self.channel = channel
        self.pid = os.getpid()
        self.prefix = str(channel.taskdedup_prefix or DEFAULT_PREFIX)
        lease = max(float(channel.taskdedup_fetch_lease or DEFAULT_LEASE), MIN_LEASE)
        self.lease_ms = int(lease * 1000)
        worker = str(channel.taskdedup_worker or socket.gethostname())
        self.owner = f"{worker}/{self.pid}/{uuid.uuid4().hex[:8]}"
        self.entry = json.dumps({"worker": worker, "host": socket.gethostname(),
                                 "pid": self.pid, "lease_ms": self.lease_ms,
                                 "since": int(time.time())})
        # A blocking wait must end well within the lease: a fetch renews the lease just before
        # it, so nothing lands in a processing list after its owner was put back.
        self.wait = min(_compat.poll_timeout(channel), lease / 4)
        self.poll = min(float(channel.taskdedup_fetch_poll or DEFAULT_POLL), lease / 4)
        self.lease_key = processing.lease_key(self.prefix, self.owner)
        self.owners_key = processing.owners_key(self.prefix)
        self.sources_key = processing.sources_key(self.prefix, self.owner)
        self._lists: dict[str, str] = {}
        self.pending: tuple[str, list[str]] | None = None
        """The command whose reply the waiting connection owes: ``("fetch", sources)`` (the
        script), ``("block", [source])`` (``BLMOVE``)."""
        self.closed = False
        self._leaving = threading.Lock()
        """Held by a renewal and by :meth:`release`: no renewal writes after the owner left."""
        self._client: redis.Redis | None = None
        self._scripts: dict[str, Script] = {}
        self.finished: Finished | None = None
        """Set while the worker stops (:mod:`taskdedup.celery.stopping`): :meth:`sweep` asks
        it, every look and once more as the channel closes."""

    def list_key(self, source: str) -> str:
        key = self._lists.get(source)
        if key is None:
            key = self._lists[source] = processing.list_key(self.prefix, self.owner, source)
        return key

    def client(self) -> redis.Redis:
        """A client over the channel's pool (made again if the channel replaced its pool).
        Not kombu's client: that one would prefix the first key of a script with kombu's
        ``global_keyprefix``; these keys carry what they need."""
        pool = self.channel.pool
        client = self._client
        if client is None or client.connection_pool is not pool:
            client = redis.Redis(connection_pool=pool)
            self._scripts = {name: client.register_script(source)
                             for name, source in SCRIPTS.items()}
            self._client = client
        return client

    def script(self, name: str) -> Script:
        self.client()
        return self._scripts[name]

    # -- the wait, on the channel's event-loop connection -------------------------------------

    def send_fetch(self, sources: list[str], load: bool = False) -> None:
        """Send ``fetch.lua`` for ``sources`` (kombu's order) without reading the reply;
        ``load``: as EVAL (the server lost the script)."""
        keys = [self.lease_key, self.owners_key, self.sources_key, *sources,
                *(self.list_key(source) for source in sources)]
        head = ("EVAL", SCRIPTS["fetch"]) if load else ("EVALSHA", _FETCH_SHA)
        self.pending = ("fetch", sources)
        _compat.send_poll(self.channel, *head, len(keys), *keys, self.lease_ms, self.owner,
                          self.entry)

    def send_block(self, sources: list[str]) -> None:
        """Every list was empty: wait on the first with ``BLMOVE`` (into its processing list),
        for ``wait`` when it is the only list, else ``poll`` before looking at all again."""
        source = sources[0]
        timeout = self.wait if len(sources) == 1 else self.poll
        self.pending = ("block", [source])
        _compat.send_poll(self.channel, "BLMOVE", source, self.list_key(source), "RIGHT",
                          "LEFT", f"{timeout:.3f}")

    # -- what happens to a held message ---------------------------------------------------------

    def remove(self, held: Held) -> None:
        """Acked (or consumed without ack): out of the processing list."""
        # from the head, where the latest taken are: an ETA held for long sits further in
        self.client().lrem(self.list_key(held.source), 1, held.raw)  # type: ignore[arg-type]

    def requeue(self, held: Sequence[Held]) -> int:
        """Put ``held`` (in the order they were taken) back at the head of their sources, the
        first taken nearest the head, each marked redelivered; only those still held."""
        by_source: dict[str, list[Held]] = {}
        for item in held:
            by_source.setdefault(item.source, []).append(item)
        moved = 0
        for source, items in by_source.items():
            raws = [item.raw for item in reversed(items)]  # newest first: the oldest last
            moved += max(0, _requeue(self.script("requeue"), self.list_key(source), source,
                                     self.lease_key, raws, check_lease=False))
        return moved

    def sweep(self) -> int:
        """While the worker stops: take out of this owner's processing lists the messages whose
        gated body already finished (:attr:`finished` says which), as their ack would have.
        Celery's prefork pool, closing, drops a job it had not yet seen start and never acks
        its message; put back once the worker has stopped, after the lock's tombstone lapsed,
        it would run again (:mod:`taskdedup.celery.stopping`). Looks at the newest
        :data:`_CHUNK` of each list (what was fetched last: what was running). Returns how
        many it took out."""
        finished = self.finished
        if finished is None:
            return 0
        client = self.client()
        taken = 0
        for source in list(self._lists):
            key = self.list_key(source)
            raws: list[bytes] = client.lrange(key, 0, _CHUNK - 1)  # type: ignore[assignment]
            for raw in finished(raws) if raws else ():
                taken += int(client.lrem(key, 1, raw))  # type: ignore[arg-type]
        if taken:
            logger.info("taskdedup: %d held message(s) whose gated body already ran, not acked "
                        "yet as the worker stops, taken out of %s's processing lists as their "
                        "ack would (Celery's closing pool can leave one unacked; put back, it "
                        "would run again once its lock's tombstone lapsed)", taken, self.owner)
        return taken

    def beat(self) -> None:
        """Renew the lease, and the registry entry (a live worker may have cleared it while
        this process did not answer for a whole lease); nothing once this owner left (the
        heartbeat thread may hold a list of owners made before the close)."""
        with self._leaving:
            if self.closed:
                return
            pipe = self.client().pipeline(transaction=False)
            pipe.set(self.lease_key, "1", px=self.lease_ms)
            pipe.hset(self.owners_key, self.owner, self.entry)
            pipe.execute()

    def release(self) -> int:
        """This owner leaves (warm shutdown): whatever is left in its lists goes back to the
        head of their sources, and it leaves the registry (after a renewal under way, never
        before one)."""
        with self._leaving:
            self.closed = True
        return _release(self.client(), self.script("release"), self.prefix, self.owner,
                        check_lease=False)

    def gone(self) -> bool:
        """The channel closed (or was dropped): nothing more to renew."""
        channel = self.channel
        return self.closed or bool(channel.closed) or channel.connection is None


def _requeue(script: Script, list_key: str, source: str, lease_key: str, raws: list[bytes],
             check_lease: bool) -> int:
    moved = 0
    for start in range(0, len(raws), _CHUNK):
        pairs: list[bytes] = []
        for raw in raws[start:start + _CHUNK]:
            pairs += [raw, redelivered(raw)]
        done = int(script(keys=[list_key, source, lease_key],
                          args=["1" if check_lease else "0", *pairs]))
        if done < 0:
            return done
        moved += done
    return moved


def _release(client: redis.Redis, script: Script, prefix: str, owner: str,
             check_lease: bool) -> int:
    """``release.lua`` for ``owner``: every processing list it has back to its source, and out
    of the registry (again if it named a source read too late)."""
    sources_key = processing.sources_key(prefix, owner)
    for _ in range(3):
        sources: list[bytes] = sorted(client.smembers(sources_key))  # type: ignore[arg-type]
        keys = [processing.lease_key(prefix, owner), processing.owners_key(prefix), sources_key]
        for source in sources:
            keys += [processing.list_key(prefix, owner, _text(source)), _text(source)]
        done = int(script(keys=keys, args=[owner, "1" if check_lease else "0"]))
        if done != -2:
            return done
    return 0


def _text(value: bytes | str) -> str:
    return value.decode("utf-8", "surrogateescape") if isinstance(value, bytes) else value


def requeue_orphans(client: redis.Redis, prefix: str, alive: Iterable[str] = ()) -> int:
    """Put back the messages of every owner whose lease lapsed (a worker that died), one owner
    at a time, each message marked redelivered and moved only if it is still there (two live
    workers never requeue one twice); then the owner leaves the registry. ``alive``: owners of
    this process (renewed just before). Returns the number of messages put back."""
    owners_key = processing.owners_key(prefix)
    ours = set(alive)
    owners = [_text(owner) for owner in client.hkeys(owners_key)]
    owners = [owner for owner in owners if owner not in ours]
    if not owners:
        return 0
    pipe = client.pipeline(transaction=False)
    for owner in owners:
        pipe.exists(processing.lease_key(prefix, owner))
    lapsed = [owner for owner, exists in zip(owners, pipe.execute(), strict=True) if not exists]
    requeue = client.register_script(SCRIPTS["requeue"])
    release = client.register_script(SCRIPTS["release"])
    total = 0
    for owner in lapsed:
        moved = _requeue_owner(client, requeue, prefix, owner)
        if moved < 0:
            continue  # it renewed its lease meanwhile: alive after all
        left = _release(client, release, prefix, owner, check_lease=True)
        moved += max(0, left)
        total += moved
        if moved:
            logger.warning(
                "taskdedup: the reliable fetch's owner %s stopped renewing its lease (a worker "
                "that died): %d message(s) it held are back at the head of their queues",
                owner, moved)
        else:
            logger.info("taskdedup: the reliable fetch's owner %s stopped renewing its lease; "
                        "it held nothing", owner)
    return total


def _requeue_owner(client: redis.Redis, script: Script, prefix: str, owner: str) -> int:
    lease_key = processing.lease_key(prefix, owner)
    moved = 0
    for member in sorted(client.smembers(processing.sources_key(prefix, owner))):
        source = _text(member)
        list_key = processing.list_key(prefix, owner, source)
        while True:
            raws: list[bytes] = client.lrange(list_key, 0, _CHUNK - 1)  # type: ignore[assignment]
            if not raws:
                break
            # the newest first: the oldest is pushed last, nearest the head
            done = _requeue(script, list_key, source, lease_key, raws, check_lease=True)
            if done < 0:
                return done
            moved += done  # 0: another worker took these; what is left is read again
    return moved


# -- the heartbeat -----------------------------------------------------------------------------


class _Heartbeat:
    """One daemon thread per process: renews the lease of every live owner of this process
    every third of the shortest lease, then puts back the messages of lapsed owners. A thread,
    so a long task on the solo pool (which blocks the event loop) keeps its lease."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.fetchers: list[Fetcher] = []
        self.wake = threading.Event()
        self.thread: threading.Thread | None = None
        self.failing = False

    def add(self, fetcher: Fetcher) -> None:
        with self.lock:
            self.fetchers.append(fetcher)
            if self.thread is None:
                self.thread = threading.Thread(target=self.run, name="taskdedup-fetch-lease",
                                               daemon=True)
                self.thread.start()
        self.wake.set()

    def forget(self, fetcher: Fetcher) -> None:
        with self.lock:
            if fetcher in self.fetchers:
                self.fetchers.remove(fetcher)

    def run(self) -> None:
        while True:
            self.wake.clear()
            with self.lock:
                self.fetchers = [f for f in self.fetchers if not f.gone()]
                fetchers = list(self.fetchers)
            interval = min((f.lease_ms for f in fetchers), default=DEFAULT_LEASE * 1000) / 3000
            self.beat(fetchers)
            self.wake.wait(interval)

    def beat(self, fetchers: list[Fetcher]) -> None:
        """Renew every owner's lease (each on its own: one broker away stops no other), then
        put back lapsed owners' messages, once per server and prefix."""
        failed: Exception | None = None
        renewed = []
        for fetcher in fetchers:
            try:
                fetcher.beat()
                renewed.append(fetcher)
            except Exception as exc:  # the broker is away: kombu's reconnection deals with it
                failed = exc
        reaped: set[tuple[int, str]] = set()
        for fetcher in renewed:
            client = fetcher.client()
            where = (id(client.connection_pool), fetcher.prefix)
            if where in reaped:
                continue
            reaped.add(where)
            try:
                requeue_orphans(client, fetcher.prefix,
                                [f.owner for f in fetchers if f.prefix == fetcher.prefix])
            except Exception as exc:
                failed = exc
        if failed is not None and not self.failing:
            logger.warning("taskdedup: the reliable fetch could not renew its lease or put back "
                           "a lapsed worker's messages (%s); retrying every heartbeat", failed)
        elif failed is None and self.failing:
            logger.info("taskdedup: the reliable fetch renews its lease again")
        self.failing = failed is not None


_HEARTBEATS: dict[int, _Heartbeat] = {}


def heartbeat() -> _Heartbeat:
    """This process's heartbeat (a forked child gets its own: the parent's thread is not in
    it, and the parent's owners are not the child's)."""
    pid = os.getpid()
    beat = _HEARTBEATS.get(pid)
    if beat is None:
        beat = _HEARTBEATS[pid] = _Heartbeat()
    return beat


def fetcher_of(channel: Any) -> Fetcher | None:
    """The reliable fetch's owner of ``channel`` in this process, if it has fetched."""
    fetcher = getattr(channel, "_taskdedup_fetcher", None)
    return fetcher if isinstance(fetcher, Fetcher) and fetcher.pid == os.getpid() else None


def _sweep_at_close(fetcher: Fetcher) -> None:
    try:
        fetcher.sweep()
    except Exception as exc:  # the broker or the lock store is away: the claim still decides
        logger.warning("taskdedup: the reliable fetch could not look for held messages whose "
                       "body already ran as it closed (%s)", exc)


# -- kombu's channel and QoS -------------------------------------------------------------------


def _stash(channel: Any) -> dict[str, Held]:
    """Messages fetched and being delivered, by delivery tag, on the channel's transport: the
    QoS that appends one (any channel's: kombu rejects a message for a queue without a consumer
    through the transport's first channel) takes it from here."""
    transport = channel.connection
    stash: dict[str, Held] | None = transport.__dict__.get("_taskdedup_fetched")
    if stash is None:
        stash = transport.__dict__["_taskdedup_fetched"] = {}
    return stash


class ReliableQoS(_compat.RedisQoS):
    """kombu's Redis QoS for messages of the reliable fetch: held in memory for prefetch as
    kombu holds them, never written to kombu's unacked hash (so never restored by time); ack
    removes from the processing list, reject with requeue and the restore at shutdown put back
    at the head of the queue. Any other message (``basic_get``, a channel without the reliable
    fetch) goes kombu's way."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)  # type: ignore[no-untyped-call]
        self._held: dict[str, Held] = {}

    def append(self, message: Any, delivery_tag: str) -> None:
        connection = self.channel.connection
        stash = connection.__dict__.get("_taskdedup_fetched") if connection is not None else None
        held = stash.pop(delivery_tag, None) if stash else None
        if held is None:
            super().append(message, delivery_tag)  # type: ignore[no-untyped-call]
            return
        self._held[delivery_tag] = held
        _compat.VirtualQoS.append(self, message, delivery_tag)  # type: ignore[no-untyped-call]

    def ack(self, delivery_tag: str) -> None:
        held = self._held.pop(delivery_tag, None)
        if held is None:
            super().ack(delivery_tag)  # type: ignore[no-untyped-call]
            return
        held.fetcher.remove(held)
        _compat.VirtualQoS.ack(self, delivery_tag)  # type: ignore[no-untyped-call]

    def reject(self, delivery_tag: str, requeue: bool = False) -> None:
        held = self._held.pop(delivery_tag, None)
        if held is None:
            super().reject(delivery_tag, requeue=requeue)  # type: ignore[no-untyped-call]
            return
        if requeue:
            held.fetcher.requeue([held])
        else:
            held.fetcher.remove(held)
        _compat.VirtualQoS.ack(self, delivery_tag)  # type: ignore[no-untyped-call]

    def restore_unacked(self, client: Any = None) -> None:
        """Put back every message held and not acked (``Channel.close``, ``basic_recover``):
        the reliable fetch's at the head of their queues, in the order they were taken;
        kombu's from its unacked hash."""
        self.requeue_held()
        super().restore_unacked(client)  # type: ignore[no-untyped-call]

    def requeue_held(self) -> None:
        """Put back the reliable fetch's messages held and not acked, at the head of their
        queues, in the order they were taken (the first taken is the next out)."""
        held = [(tag, self._held.pop(tag)) for tag in list(self._delivered)
                if tag in self._held]
        self._held.clear()  # what is left was acked meanwhile by another thread
        by_fetcher: dict[Fetcher, list[Held]] = {}
        for tag, item in held:
            self._delivered.pop(tag, None)
            by_fetcher.setdefault(item.fetcher, []).append(item)
        for fetcher, items in by_fetcher.items():
            fetcher.requeue(items)


class ReliableFetch(_compat.Channel):
    """kombu's Redis channel, consuming through the reliable fetch when its transport option
    ``taskdedup_reliable_fetch`` is true (else kombu's own fetch, untouched).

    kombu's event loop stays: its poller sends the wait with :meth:`_brpop_start` and reads the
    reply with :meth:`_brpop_read` when the socket is readable. The wait is ``fetch.lua`` (a
    message from the first non-empty list, in kombu's ``BRPOP`` order, moved into this owner's
    processing list), then, if every list was empty, ``BLMOVE`` on the first list. A channel
    whose consumers all take messages without acks (``no_ack``: Celery's reply queues) keeps
    kombu's fetch.
    """

    QoS = ReliableQoS
    taskdedup_reliable_fetch = False
    taskdedup_fetch_lease = DEFAULT_LEASE
    taskdedup_fetch_poll = DEFAULT_POLL
    taskdedup_prefix: str | None = None
    taskdedup_worker: str | None = None
    _taskdedup_fetcher: Fetcher | None = None

    def basic_consume(self, queue: str, *args: Any, **kwargs: Any) -> Any:
        no_ack = kwargs.get("no_ack", args[0] if args else False)
        if not no_ack:
            self.__dict__.setdefault("_taskdedup_acked", set()).add(queue)
        return super().basic_consume(queue, *args, **kwargs)  # type: ignore[no-untyped-call]

    def _fetcher(self) -> Fetcher | None:
        """This channel's owner of processing lists, made on its first reliable fetch; None:
        kombu's fetch (the option is off, no acks, only ``no_ack`` consumers, or a forked
        child of the process that owns the lists)."""
        if not self.taskdedup_reliable_fetch or not self.ack_emulation:
            return None
        fetcher = self._taskdedup_fetcher
        if fetcher is None:
            acked = self.__dict__.get("_taskdedup_acked", ())
            if not any(queue in acked for queue in self.active_queues):
                return None
            fetcher = self._taskdedup_fetcher = Fetcher(self)
            heartbeat().add(fetcher)
            logger.debug("taskdedup: reliable fetch on, owner %s", fetcher.owner)
        return fetcher if fetcher.pid == os.getpid() and not fetcher.closed else None

    def _brpop_start(self, *args: Any, **kwargs: Any) -> None:
        fetcher = self._fetcher()
        if fetcher is None:
            super()._brpop_start(*args, **kwargs)  # type: ignore[no-untyped-call]
            return
        queues = _compat.consume_order(self)
        if queues:
            fetcher.send_fetch(_compat.fetch_source_keys(self, queues))

    def _brpop_read(self, **options: Any) -> bool:
        fetcher = self._taskdedup_fetcher
        if fetcher is None or fetcher.pending is None:
            return bool(super()._brpop_read(**options))  # type: ignore[no-untyped-call]
        kind, sources = fetcher.pending
        fetcher.pending = None
        client = self.client
        waiting = False  # a further command was sent: its reply is the one owed now
        try:
            try:
                reply = client.parse_response(
                    client.connection, "BLMOVE" if kind == "block" else "EVALSHA", **options)
            except NoScriptError:  # the server lost the script (a restart, SCRIPT FLUSH)
                fetcher.send_fetch(sources, load=True)
                waiting = True
                raise Empty() from None
            except self.connection_errors:
                # as kombu: disconnect, so the next poll reconnects
                client.connection.disconnect()
                raise
            if kind == "block":
                source, raw = sources[0], reply
            else:
                index = int(reply[0])
                source, raw = (sources[index - 1], reply[1]) if index else (sources[0], None)
            if raw is None:
                if kind == "fetch" and not self._closing and self.active_queues:
                    fetcher.send_block(sources)
                    waiting = True
                raise Empty()
            if self._closing:
                raise Empty()  # closing: it stays in the processing list, which release empties
            return self._deliver_held(Held(fetcher, source, raw))
        finally:
            if not waiting:
                _compat.after_poll_reply(self)

    def _deliver_held(self, held: Held) -> bool:
        """Hand a fetched message to its consumer as kombu's ``_brpop_read`` does; the QoS
        that appends it takes it from the stash. A message nobody appended was consumed without
        ack (or could not be read): out of the processing list, as kombu's pop would leave it."""
        queue = _compat.queue_of_source(self, held.source)
        _compat.rotate(self, queue)
        try:
            message = kombu_loads(held.raw)  # type: ignore[no-untyped-call]
            tag = message["properties"]["delivery_tag"]
        except Exception:
            logger.error("taskdedup: a message in %r is not kombu's (no JSON with a delivery "
                         "tag): dropped, as kombu drops it: %r", held.source, held.raw[:4096])
            held.fetcher.remove(held)
            raise Empty() from None
        stash = _stash(self)
        stash[tag] = held
        try:
            self.connection._deliver(message, queue)
        except BaseException:
            if stash.pop(tag, None) is held:
                logger.error("taskdedup: a message from %r failed before its consumer took "
                             "it: dropped, as kombu drops it", held.source)
                held.fetcher.remove(held)
            raise
        if stash.pop(tag, None) is held:  # a no_ack consumer took it
            held.fetcher.remove(held)
        return True

    def close(self) -> None:
        """Warm shutdown: read a pending wait's reply (a message it moved stays in the
        processing list), take out what already ran (:meth:`Fetcher.sweep`, while the worker
        stops), put back what the worker holds (at the head of its queue, marked
        redelivered) and whatever is left in its processing lists, leave the registry; then
        kombu's close (which restores what kombu's own fetch holds)."""
        fetcher = self._taskdedup_fetcher
        if fetcher is None or fetcher.pid != os.getpid() or self.closed or fetcher.closed:
            super().close()  # type: ignore[no-untyped-call]
            return
        heartbeat().forget(fetcher)
        self._closing = True
        if self._in_poll and fetcher.pending is not None:
            try:
                self._brpop_read()
            except Empty:
                pass
            except Exception as exc:  # the broker went away: the lease will lapse
                logger.debug("taskdedup: pending fetch unread at close: %s", exc)
        try:
            _sweep_at_close(fetcher)  # a body that finished after the last look
            qos = self._qos
            if qos is not None:
                qos.requeue_held()
            fetcher.release()
        except Exception as exc:
            logger.warning("taskdedup: the reliable fetch could not put back what %s held at "
                           "shutdown (%s): a live worker will, once its lease (%.0fs) lapses",
                           fetcher.owner, exc, fetcher.lease_ms / 1000)
        super().close()  # type: ignore[no-untyped-call]
