"""What differs between the kombu and Celery releases taskdedup supports, and every private
detail of theirs it relies on — checked once, beside the public fallback.

The one-round-trip publish (:mod:`taskdedup.celery.transport`) subclasses kombu's Redis
``Channel`` and builds the push kombu would have sent: it needs the channel's ``_put`` and
``_put_fanout`` seams, how it names a queue per priority (``_q_for_pri``,
``_get_message_priority``, ``priority_steps``), its key prefix (``global_keyprefix``), its
connection pool (``pool``) and, where kombu has queue expiry (5.7: ``x-expires``), its expiry
map (``_expires``). :func:`fused_push_missing` says, when the app is configured, what of that
is missing; the app then reserves in a round trip of its own and publishes with kombu's own
code (one INFO line says why). Features are detected, never version strings compared:

- ``_expires`` / ``_get_queue_expire``: queue expiry, kombu 5.7 (not in 5.3 to 5.6).
- ``_get_publish_topics``: several fanout topics per message, kombu 5.7 (5.3 to 5.6:
  ``_get_publish_topic``, one).
- ``_publish_batch`` (a ``put`` keyword) / ``create_publish_batch``: ``producer.batch()``,
  kombu 5.7.

The gated publish with the locks apart (:class:`GatedProducer`) hands Celery's ``send_task``
a producer of its own, and relies on ``send_task`` publishing a task message through that
producer's ``publish`` once (again only to retry it); :func:`gated_publish_missing` checks it
once, and without it each gated publish reserves first, then publishes.

The reliable fetch (:mod:`taskdedup.celery.fetch`) overrides the channel's consuming seams:
``_brpop_start`` (send the wait for the next message on the event loop's connection) and
``_brpop_read`` (read its reply and ``connection._deliver`` it), which the channel's
``handlers['BRPOP']`` and the poller's ``_register_BRPOP`` call; it reads the channel's queue
cycle (``_queue_cycle.consume``/``rotate``), ``priority_steps``, ``_q_for_pri``, ``sep``,
``global_keyprefix``, ``active_queues`` and ``pool``, and subclasses its ``QoS`` (``append``,
``ack``, ``reject``, ``restore_unacked``). :func:`reliable_fetch_missing` says what of that is
missing when a worker starts; the worker then keeps kombu's fetch and logs a WARNING. Detected:

- ``brpop_timeout`` (the wait's server-side timeout): an attribute from kombu 5.6; before, the
  default of ``_brpop_start(timeout=1)``.
- ``_brpop_sent_at``: kombu 5.7's health check of the waiting connection.
- ``_flush_brpop_reauth``: kombu 5.7 re-authenticates the waiting connection after a reply.
- ``Channel.close`` reading a pending ``BRPOP`` reply: kombu 5.6+ (the reliable fetch reads its
  own pending reply before, on every release).

A stopping worker on kombu's fetch (:mod:`taskdedup.celery.stopping`) reads the messages its
Redis channel holds unacked from the QoS's ``_delivered`` less its ``_dirty``
(:func:`held_unacked`; the reliable fetch's QoS reads the first too), and acks one whose gated
body already ran as ``QoS.ack`` does, with a pipeline of its own given to
``_remove_from_indices`` (:func:`ack_held`); without those it does not look.

The claim sent ahead on a solo worker (:class:`~taskdedup.celery.ahead.ClaimAhead`) wraps one
channel's ``QoS.append(message, delivery_tag)`` (kombu's Redis ``QoS``, or the reliable
fetch's subclass), where kombu records a received message unacked before Celery sees it:
:func:`wrap_qos_append` checks it when the consumer starts; without it the claim goes out when
the pool accepts the task (Celery's public ``Task.Request``). Where the locks share the
broker's database, the record's own transaction carries the claim: for that one call the
QoS's ``pipe_or_acquire(pipe, client)`` yields kombu's pipeline with our command added at
``execute`` (redis-py's ``command_stack``, ``execute(raise_on_error)``,
``raise_first_error``); :func:`carry_missing` and :func:`same_database_missing` check it when
the consumer starts, and without it the claim goes out on a connection of its own.
"""

from __future__ import annotations

import functools
import inspect
import time
from collections.abc import Callable, Mapping
from typing import Any, NamedTuple

from kombu.transport import redis as kombu_redis
from kombu.transport import virtual as kombu_virtual
from kombu.utils.scheduling import cycle_by_name
from redis.exceptions import ResponseError

from ..events import logger

__all__ = [
    "Channel",
    "GatedProducer",
    "RedisQoS",
    "SentinelChannel",
    "SentinelTransport",
    "Transport",
    "VirtualQoS",
    "active_copy",
    "pool_process_index",
    "after_poll_reply",
    "consume_order",
    "fetch_source_keys",
    "flush_publish_batch",
    "forget_pending",
    "fused_push_missing",
    "gated_publish_missing",
    "message_id",
    "priority_queue_keys",
    "publish_topic_keys",
    "queue_expiry_ms",
    "poll_timeout",
    "queue_list_key",
    "queue_of_source",
    "reliable_fetch_missing",
    "request_dict",
    "rotate",
    "send_poll",
    "transport_of",
]

Channel = kombu_redis.Channel
Transport = kombu_redis.Transport
SentinelChannel = kombu_redis.SentinelChannel
SentinelTransport = kombu_redis.SentinelTransport
RedisQoS = kombu_redis.QoS
VirtualQoS = kombu_virtual.QoS

# What the fused push calls or reads on kombu's Redis channel (class attributes or methods).
_CHANNEL_NEEDS = (
    ("_put", "method"),
    ("_put_fanout", "method"),
    ("_q_for_pri", "method"),
    ("_get_message_priority", "method"),
    ("conn_or_acquire", "method"),
    ("priority_steps", "value"),
    ("global_keyprefix", "value"),
    ("keyprefix_fanout", "value"),
    ("pool", "value"),
)


def fused_push_missing(channel: type[Any] = Channel) -> str | None:
    """What of kombu's Redis channel the one-round-trip publish needs and cannot find, or None.

    Checked when a ``DedupTask`` is bound to its app: a kombu release that renamed one of
    these gets the public path (a reservation round trip, then kombu's own publish) instead
    of an error after the message was published.
    """
    for name, kind in _CHANNEL_NEEDS:
        if not hasattr(channel, name):
            return f"kombu's Redis channel has no {name}"
        if kind == "method" and not callable(getattr(channel, name)):
            return f"kombu's Redis channel's {name} is not a method"
    try:
        put = inspect.signature(channel._put).parameters
        fanout = inspect.signature(channel._put_fanout).parameters
    except (TypeError, ValueError) as exc:
        return f"kombu's Redis channel's _put cannot be inspected ({exc})"
    if list(put)[1:3] != ["queue", "message"]:
        return f"kombu's Redis channel's _put takes ({', '.join(put)}), not (queue, message)"
    if list(fanout)[1:4] != ["exchange", "message", "routing_key"]:
        return (f"kombu's Redis channel's _put_fanout takes ({', '.join(fanout)}), "
                "not (exchange, message, routing_key)")
    if not (hasattr(channel, "_get_publish_topics") or hasattr(channel, "_get_publish_topic")):
        return "kombu's Redis channel has no _get_publish_topic(s)"
    if hasattr(channel, "_get_queue_expire") and not _expires_is_a_map(channel):
        return "kombu's Redis channel has queue expiry but no _expires map"
    return None


def _expires_is_a_map(channel: type[Any]) -> bool:
    """Whether kombu keeps its queue expiry in ``self._expires`` (kombu 5.7 sets it in
    ``__init__``): read from the source, as a channel needs a connection to be made."""
    try:
        source = inspect.getsource(channel.__init__)
    except (OSError, TypeError):
        return False
    return "self._expires" in source


def message_id(message: Mapping[str, Any]) -> Any:
    """The task id of a message as kombu's virtual transport holds it (Celery's protocol 2
    puts it in the headers, protocol 1 in the body's properties)."""
    headers = message.get("headers") or {}
    if "id" in headers:
        return headers["id"]
    return (message.get("properties") or {}).get("correlation_id")


def queue_list_key(channel: Any, queue: str, message: Mapping[str, Any]) -> str:
    """The Redis list a message for ``queue`` goes to, with kombu's global key prefix (kombu's
    client prefixes the commands it knows; a script's keys it cannot)."""
    priority = channel._get_message_priority(message, reverse=False)
    return str(channel.global_keyprefix + channel._q_for_pri(queue, priority))


def priority_queue_keys(channel: Any, queue: str) -> list[str]:
    """Every priority list of ``queue``, prefixed (what kombu's expiry refreshes)."""
    prefix = channel.global_keyprefix
    return [prefix + channel._q_for_pri(queue, step) for step in channel.priority_steps]


def queue_expiry_ms(channel: Any, queue: str) -> int | None:
    """The ``x-expires`` of ``queue`` in milliseconds, on a kombu with queue expiry; else None."""
    expires = getattr(channel, "_expires", None)  # kombu 5.7; absent before
    if not expires or queue not in expires:
        return None
    return int(expires[queue])


def publish_topic_keys(channel: Any, exchange: str, routing_key: str) -> list[str]:
    """The PUB/SUB topics a fanout message goes to, prefixed as kombu's client would."""
    many = getattr(channel, "_get_publish_topics", None)  # kombu 5.7
    topics = many(exchange, routing_key) if many else [
        channel._get_publish_topic(exchange, routing_key)]
    return [channel.global_keyprefix + str(topic) for topic in topics]


def flush_publish_batch(kwargs: dict[str, Any]) -> None:
    """Take kombu 5.7's ``_publish_batch`` out of a put's keywords and send what it holds.

    A gated message cannot wait for the batch (its caller needs the gate's answer now), so it
    is pushed at once — after the messages buffered before it, to keep their order.
    """
    batch = kwargs.pop("_publish_batch", None)
    if batch is not None:
        batch.flush()


def transport_of(producer: Any) -> Any:
    """The kombu transport of a producer's connection (None when it has none yet)."""
    connection = getattr(producer, "connection", None)
    return getattr(connection, "transport", None)


def active_copy(task_id: str) -> bool:
    """Whether a pool process of this worker is running a request of ``task_id`` now (the
    worker's main process). Celery's worker state (``celery.worker.state.active_requests``,
    what ``celery inspect active`` reports) drops a request before its failure handlers run,
    so a request found there is another copy of the same message. False where the worker
    state has no such set."""
    try:
        from celery.worker import state
    except ImportError:  # pragma: no cover - part of every Celery release taskdedup supports
        return False
    active = getattr(state, "active_requests", None)
    try:
        return any(getattr(request, "id", None) == task_id for request in list(active or ()))
    except TypeError:
        return False


def pool_process_index() -> int | None:
    """This prefork pool process's index (0 to concurrency - 1, reused by a process that
    replaces it): billiard sets ``index`` on each pool process before it starts, what Celery's
    ``%I`` log-file format reads. None outside a pool process, or where billiard has none."""
    try:
        from billiard.process import current_process
    except ImportError:  # pragma: no cover - billiard comes with Celery
        return None
    index = getattr(current_process(), "index", None)
    return index if isinstance(index, int) and not isinstance(index, bool) else None


def forget_pending(task: Any, task_id: str) -> None:
    """Undo what Celery's publish set up for a message that was never sent: the parent's
    ``request.children`` entry (published from a running task: ``AsyncResult(parent)
    .children``, ``collect()`` and ``join()`` would wait for it forever), and the result
    subscription of a backend that subscribes per task id (Redis pub/sub: ``cancel_for``)."""
    parent = task.app.current_worker_task
    children = getattr(parent.request, "children", None) if parent is not None else None
    if children:
        children[:] = [child for child in children if getattr(child, "id", None) != task_id]
    consumer = getattr(task.backend, "result_consumer", None)
    cancel = getattr(consumer, "cancel_for", None)
    if cancel is not None:
        try:
            cancel(task_id)
        except Exception:  # best effort: it only frees a subscription
            logger.debug("taskdedup: could not cancel the result subscription of %s", task_id)


class GatedProducer:
    """The producer handed to Celery's ``send_task`` (its public ``producer=``) for a gated
    publish whose reservation is on its way (:meth:`taskdedup.core.Deduplicator.gate_send`):
    Celery builds the message meanwhile, and its one ``producer.publish`` asks ``decide``
    first (which reads the reservation's reply): the message goes out only when the gate let
    it through. Everything else is the wrapped producer's (``connection``, ``channel``,
    ``revive``, …). Celery calls ``publish`` again only to retry a failed publish (a worker's
    callback, kombu 5.7's retry loop): the decision is taken once.

    Private detail relied on: Celery's ``send_task`` publishes a task message with the given
    producer's ``publish`` (checked by :func:`gated_publish_missing`); the caller only uses
    this where nothing listens to Celery's publish signals, so a message refused here is never
    announced as sent.
    """

    __slots__ = ("_decide", "_producer", "state")

    PENDING, REFUSED, PUBLISHING = 0, 1, 2

    def __init__(self, producer: Any, decide: Any) -> None:
        self._producer = producer
        self._decide = decide
        self.state = GatedProducer.PENDING
        """PENDING until Celery publishes; REFUSED when ``decide`` said no (or raised: the
        error reaches the caller through Celery); PUBLISHING once the message was handed to
        the wrapped producer."""

    def publish(self, body: Any, *args: Any, **kwargs: Any) -> Any:
        state = self.state
        if state == GatedProducer.PENDING:
            self.state = state = GatedProducer.REFUSED
            if self._decide():
                self.state = state = GatedProducer.PUBLISHING
        if state == GatedProducer.REFUSED:
            return None
        return self._producer.publish(body, *args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._producer, name)


_GATED_PUBLISH_MISSING: list[str | None] = []


def gated_publish_missing() -> str | None:
    """What of Celery :class:`GatedProducer` relies on is missing, or None (checked once):
    ``send_task`` publishing through ``amqp.send_task_message`` with the producer it was
    given, whose ``publish`` sends the message."""
    if not _GATED_PUBLISH_MISSING:
        missing: str | None = None
        try:
            from celery.app import amqp, base

            send_task = inspect.getsource(base.Celery.send_task)
            sender = inspect.getsource(amqp.AMQP._create_task_sender)
        except (AttributeError, ImportError, OSError, TypeError) as exc:
            missing = f"Celery's send_task cannot be inspected ({exc})"
        else:
            if "producer_or_acquire(producer)" not in send_task or (
                    "send_task_message(P," not in send_task):
                missing = "Celery's send_task does not publish with the producer it is given"
            elif "producer.publish" not in sender:
                missing = "Celery's send_task_message does not call producer.publish"
        _GATED_PUBLISH_MISSING.append(missing)
        if missing:
            logger.info("taskdedup: each gated publish with the locks apart reserves, then "
                        "publishes (%s)", missing)
    return _GATED_PUBLISH_MISSING[0]


def request_dict(request: Any) -> Mapping[str, Any]:
    """The message fields of a worker's ``Request`` (``task_revoked`` gets the request)."""
    return getattr(request, "request_dict", None) or {}


# -- the reliable fetch (the consuming side) --------------------------------------------------

# What the reliable fetch calls, reads or overrides on kombu's Redis channel.
_FETCH_NEEDS = (
    ("_brpop_start", "method"),
    ("_brpop_read", "method"),
    ("basic_consume", "method"),
    ("close", "method"),
    ("_q_for_pri", "method"),
    ("conn_or_acquire", "method"),
    ("priority_steps", "value"),
    ("sep", "value"),
    ("global_keyprefix", "value"),
    ("queue_order_strategy", "value"),
    ("active_queues", "value"),
    ("pool", "value"),
    ("from_transport_options", "value"),
    ("_in_poll", "value"),
    ("ack_emulation", "value"),
)
_QOS_NEEDS = ("append", "ack", "reject", "restore_unacked", "restore_unacked_once", "_flush")


def reliable_fetch_missing(channel: type[Any] = Channel) -> str | None:
    """What of kombu's Redis channel the reliable fetch needs and cannot find, or None.

    Checked when a worker with ``taskdedup_reliable_fetch`` starts: a kombu release that moved
    one of these keeps kombu's own fetch (with a WARNING that it is not reliable) instead of
    failing while it consumes.
    """
    for name, kind in _FETCH_NEEDS:
        if not hasattr(channel, name):
            return f"kombu's Redis channel has no {name}"
        if kind == "method" and not callable(getattr(channel, name)):
            return f"kombu's Redis channel's {name} is not a method"
    for name in _QOS_NEEDS:
        if not callable(getattr(RedisQoS, name, None)) or not callable(
                getattr(VirtualQoS, name, None)):
            return f"kombu's QoS has no {name}"
    if not callable(getattr(Transport, "_deliver", None)):
        return "kombu's virtual transport has no _deliver"
    cycle = _cycle_class(channel)
    if cycle is None or not (callable(getattr(cycle, "consume", None))
                             and callable(getattr(cycle, "rotate", None))):
        return "kombu's queue cycle has no consume/rotate"
    try:
        init = inspect.getsource(Channel.__init__)  # where the handlers are set
        register = inspect.getsource(kombu_redis.MultiChannelPoller._register_BRPOP)
    except (OSError, TypeError):
        return "kombu's Redis channel's source cannot be read"
    if "self._brpop_read" not in init or "_queue_cycle" not in init:
        return "kombu's Redis channel does not read BRPOP replies with its _brpop_read"
    if "_brpop_start" not in register:
        return "kombu's poller does not start a BRPOP with the channel's _brpop_start"
    return None


def held_unacked(channel: Any) -> Callable[[], list[tuple[str, Any]]] | None:
    """What a kombu Redis channel holds unacked, for a stopping worker to look at
    (:mod:`.stopping`): a callable that lists ``(delivery tag, message)`` now, from its virtual
    QoS's ``_delivered`` (what kombu's fetch restores as the channel closes) less ``_dirty``
    (acked, not yet dropped from it). None for any other channel, or where kombu keeps no such
    record (the look is then skipped)."""
    if not isinstance(channel, Channel) or not callable(
            getattr(RedisQoS, "_remove_from_indices", None)):
        return None
    qos = getattr(channel, "qos", None)
    delivered, dirty = getattr(qos, "_delivered", None), getattr(qos, "_dirty", None)
    if not isinstance(delivered, Mapping) or not isinstance(dirty, set):
        return None

    def unacked() -> list[tuple[str, Any]]:
        return [(tag, message) for tag, message in list(delivered.items())
                if tag not in dirty]

    return unacked


def ack_held(channel: Any, delivery_tag: str) -> None:
    """Ack a message kombu's Redis fetch holds (:func:`held_unacked`), from a thread other
    than the consumer's: its unacked record removed in a pipeline of its own (never the QoS's
    ``pipe_or_acquire``, on which the consumer's thread may be carrying a claim), then kombu's
    bookkeeping (``QoS.ack``'s own two steps)."""
    qos = channel.qos
    with channel.conn_or_acquire() as client:
        RedisQoS._remove_from_indices(  # type: ignore[no-untyped-call]
            qos, delivery_tag, client.pipeline()).execute()
    VirtualQoS.ack(qos, delivery_tag)  # type: ignore[no-untyped-call]


def _cycle_class(channel: type[Any]) -> Any:
    try:
        return cycle_by_name(channel.queue_order_strategy)  # type: ignore[no-untyped-call]
    except Exception:  # an unknown strategy name: kombu itself would fail
        return None


def consume_order(channel: Any) -> list[str]:
    """The queues to look at, in kombu's order (round robin unless the channel's
    ``queue_order_strategy`` says otherwise): what kombu's ``_brpop_start`` would wait on."""
    return list(channel._queue_cycle.consume(len(channel.active_queues)))


def fetch_source_keys(channel: Any, queues: list[str]) -> list[str]:
    """The lists kombu's ``BRPOP`` would wait on for ``queues``, in its order (every queue's
    list of one priority before the next priority), with kombu's global key prefix."""
    prefix = channel.global_keyprefix
    return [prefix + channel._q_for_pri(queue, pri) for pri in channel.priority_steps
            for queue in queues]


def queue_of_source(channel: Any, source: str) -> str:
    """The queue a source list belongs to (its priority suffix and key prefix removed), as
    kombu's ``_brpop_read`` names the destination of a message."""
    prefix = channel.global_keyprefix
    if prefix and source.startswith(prefix):
        source = source[len(prefix):]
    return str(source.rsplit(channel.sep, 1)[0])


def rotate(channel: Any, queue: str) -> None:
    """Move ``queue`` to the end of the round robin, as kombu does after a delivery."""
    channel._queue_cycle.rotate(queue)


def poll_timeout(channel: Any) -> float:
    """The server-side timeout of kombu's wait: ``brpop_timeout`` (kombu 5.6+), else the
    default of ``_brpop_start`` (1 s)."""
    timeout = getattr(channel, "brpop_timeout", None)
    if timeout is None:
        default = inspect.signature(Channel._brpop_start).parameters.get("timeout")
        timeout = default.default if default is not None else None
    return float(timeout) if isinstance(timeout, (int, float)) and timeout > 0 else 1.0


def send_poll(channel: Any, *args: Any) -> None:
    """Send a command on the channel's waiting connection without reading its reply (the
    event loop reads it when the socket is readable), and mark the wait as kombu does."""
    connection = channel.client.connection
    channel._in_poll = connection
    if hasattr(type(channel), "_brpop_sent_at"):  # kombu 5.7: the wait's health check
        channel._brpop_sent_at = time.monotonic()
    connection.send_command(*args)


def after_poll_reply(channel: Any) -> None:
    """What kombu does once a wait's reply is read and no wait is pending: kombu 5.7 sends a
    pending re-authentication on that connection."""
    channel._in_poll = None
    flush = getattr(channel, "_flush_brpop_reauth", None)
    if flush is not None:
        flush()



# -- the claim sent ahead (the consuming side) ------------------------------------------------


def wrap_qos_append(channel: Any, before: Callable[[Any, bool], Any],
                    carry: bool = False, held: Held | None = None) -> str | None:
    """Have ``before(message, carry)`` called as kombu's Redis ``QoS.append`` records a
    received message unacked (its round trip), on this one channel
    (:class:`~.ahead.ClaimAhead`); ``before`` must not block, and its errors are logged, never
    raised. With ``carry`` (:func:`carry_missing` and :func:`same_database_missing` said
    None), ``before`` may return a claim for the record's transaction to carry (a
    ``command``, and ``reply`` for its reply), and the transaction carries the completions
    ``held`` gives (sent ahead of the claim): ``carry`` is then true until the server
    refuses one, and ``held.stop()`` is called then. None when done (or done already), else
    what is missing: the claim then goes out later, as before."""
    qos = getattr(channel, "qos", None) if channel is not None else None
    if not isinstance(qos, kombu_redis.QoS):
        return "the worker does not consume from Redis through kombu's QoS"
    append = getattr(qos, "append", None)
    if getattr(append, "taskdedup_ahead", False):
        return None
    if not callable(append) or "delivery_tag" not in inspect.signature(append).parameters:
        return "kombu's QoS.append is not append(message, delivery_tag)"

    carrying = [carry]  # until a transaction refuses a claim it carried
    take = held.take if held is not None and carry else None

    def wrapped(message: Any, delivery_tag: Any) -> Any:
        claim = None
        try:
            claim = before(message, carrying[0])
        except Exception:
            logger.debug("taskdedup: could not send a claim ahead", exc_info=True)
        completions = take() if take is not None and carrying[0] else None
        if claim is None and not completions:
            return append(message, delivery_tag)
        load = _Load(claim, completions or [], held)
        return _append_carrying(qos, append, message, delivery_tag, load, carrying)

    wrapped.taskdedup_ahead = True  # type: ignore[attr-defined]
    qos.append = wrapped  # type: ignore[method-assign]
    return None


class Held(NamedTuple):
    """The completions a thread holds for kombu's next record to carry (the store's
    ``carry_held``, ``held_replies``, and ``hold_here(None)`` to stop holding)."""

    take: Callable[[], list[tuple[tuple[Any, ...], Callable[[Any], None]]]]
    answer: Callable[[list[Any], list[Any] | None], None]
    stop: Callable[[], None]


class _Load:
    """What one record's transaction carries: held completions, then a claim."""

    __slots__ = ("claim", "completions", "held")

    def __init__(self, claim: Any, completions: list[Any], held: Held | None) -> None:
        self.claim, self.completions, self.held = claim, completions, held

    def commands(self) -> list[tuple[Any, ...]]:
        commands = [command for command, _ in self.completions]
        if self.claim is not None:
            commands.append(self.claim.command)
        return commands

    def answer(self, replies: list[Any]) -> None:
        """The carried commands' replies, in order."""
        if self.claim is not None:
            self.claim.reply(replies.pop())
        completions, self.completions = self.completions, []
        if completions and self.held is not None:
            self.held.answer(completions, replies)

    def refused(self) -> None:
        """Nothing carried ran: the completions go out on their own; the claim is made when
        it is read."""
        if self.completions and self.held is not None:
            completions, self.completions = self.completions, []
            self.held.answer(completions, None)


def carry_missing(channel: Any) -> str | None:
    """Why kombu's unacked record on ``channel`` cannot carry a claim in its transaction, or
    None: its QoS is kombu's own ``append`` writing through ``pipe_or_acquire(pipe, client)``
    (not the reliable fetch's, which writes no record), keys unprefixed, replies undecoded."""
    qos = getattr(channel, "qos", None) if channel is not None else None
    if not isinstance(qos, kombu_redis.QoS) or type(qos).append is not kombu_redis.QoS.append:
        return "the messages are not recorded by kombu's own QoS.append"
    kind = type(qos)
    pipe_or_acquire = getattr(kind, "pipe_or_acquire", None)
    if "pipe_or_acquire" in vars(qos) or not callable(pipe_or_acquire) or list(
            inspect.signature(pipe_or_acquire).parameters) != ["self", "pipe", "client"]:
        return "kombu's QoS has no pipe_or_acquire(pipe, client)"
    if getattr(channel, "global_keyprefix", ""):
        return "kombu prefixes its keys (global_keyprefix)"
    return None


_SAME = ("host", "port", "path", "db", "username", "password")


def same_database_missing(channel: Any, client: Any) -> str | None:
    """None when ``client`` (the locks') connects where ``channel``'s pool does: the same
    server, database and user, replies undecoded; else how they differ."""
    try:
        theirs = channel.pool.connection_kwargs
        mine = client.connection_pool.connection_kwargs
    except Exception:
        return "the locks' client or the channel has no plain connection pool"
    if type(client.connection_pool) is not type(channel.pool):
        return "the locks' client pools its connections another way than the broker's"
    if theirs.get("decode_responses") or mine.get("decode_responses"):
        return "the broker's client decodes its replies"
    if any(theirs.get(name) != mine.get(name) for name in _SAME):
        return "the locks are not in the broker's database"
    return None


def _append_carrying(qos: Any, append: Callable[[Any, Any], Any], message: Any,
                     delivery_tag: Any, load: _Load, carrying: list[bool]) -> Any:
    """kombu's ``append``, with ``load``'s commands (held completions, a claim) added to the
    transaction of its unacked record: one round trip for all. Their replies go to ``load``.
    A transaction that is refused as a whole (a command refused as it is queued) is sent
    again without them, kombu's commands as kombu wrote them, and nothing more is carried
    on this channel; the claim then goes out when it is read, the completions at once."""
    # a partial of one module-level class: a decorated closure per message would cost a
    # functools.wraps per task
    qos.pipe_or_acquire = functools.partial(_PipeCarrying, qos, load, carrying, [])
    try:
        return append(message, delivery_tag)
    finally:
        del qos.pipe_or_acquire
        load.refused()  # carried nothing (kombu failed first): the completions go out


class _PipeCarrying:
    """kombu's ``pipe_or_acquire(pipe, client)`` for one :func:`_append_carrying`: the first
    pipeline it makes (``taken``) carries ``load``. A class rather than a generator context
    manager: it is entered once per message."""

    __slots__ = ("_carrier", "_carrying", "_inner", "_load", "_taken")

    def __init__(self, qos: Any, load: _Load, carrying: list[bool], taken: list[Any],
                 pipe: Any = None, client: Any = None) -> None:
        self._carrier = pipe is None and not taken
        if self._carrier and client is None:
            client = _kept_client(qos.channel)
        self._inner = type(qos).pipe_or_acquire(qos, pipe, client)
        self._load, self._carrying, self._taken = load, carrying, taken

    def __enter__(self) -> Any:
        made = self._inner.__enter__()
        if self._carrier:
            self._taken.append(made)
            made.execute = _carrier(made, self._load, self._carrying)
        return made

    def __exit__(self, *exc_info: Any) -> Any:
        return self._inner.__exit__(*exc_info)


def _kept_client(channel: Any) -> Any:
    """A client over ``channel``'s pool, made as kombu makes one (``_create_client``) and kept
    on the channel while its pool stays: kombu builds a new ``redis.Redis`` for every record
    (on redis-py 8, a dict of ~170 reply callbacks each time); None: kombu makes its own."""
    kept = channel.__dict__.get("_taskdedup_client")
    try:
        pool = channel.pool
        if kept is None or kept.connection_pool is not pool:
            kept = channel._create_client()
            if kept.connection_pool is not pool:
                return None
            channel.__dict__["_taskdedup_client"] = kept
    except Exception:
        return None
    return kept


def _carrier(pipe: Any, load: _Load, carrying: list[bool]) -> Callable[..., Any]:
    """``pipe.execute`` for a pipeline that carries ``load``'s commands last."""
    execute = pipe.execute

    def execute_carrying(raise_on_error: bool = True) -> Any:
        own = list(pipe.command_stack)
        # get=True: redis-py hands a SET ... GET reply back as the server sent it
        for command in load.commands():
            pipe.execute_command(*command, get=True)
        try:
            replies = execute(raise_on_error=False)
        except ResponseError as exc:  # refused as queued (EXECABORT): nothing of it ran
            pipe.command_stack = own  # kombu's alone: its own error, if it is kombu's, raised
            replies = execute(raise_on_error=raise_on_error)
            carrying[0] = False
            load.refused()
            if load.held is not None:
                load.held.stop()
            logger.warning("taskdedup: kombu's unacked record no longer carries the claim "
                           "(%s): it goes out on its own", exc)
            return replies
        load.answer(replies[len(own):])
        del replies[len(own):]
        if raise_on_error:
            pipe.raise_first_error(own, replies)
        return replies

    return execute_carrying
