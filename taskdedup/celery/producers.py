"""The producers of taskdedup's gated publishes: kombu's, with a declare that costs a lookup.

Celery passes every publish the queue to declare (``declare=[queue]``), and kombu's
``Producer.maybe_declare`` binds a copy of it to the channel, wraps the declare in
``Connection.ensure`` and only then finds it in the connection's cache of declared entities:
about 25 µs of Python per publish on this project's machine, more than the rest of the
gate's own client work. :class:`DeclaredProducer` looks in that cache first (kombu's
public ``Connection.declared_entities``, keyed as kombu keys it) and leaves everything else
— the first declare on a connection, a closed channel, a retry — to kombu.
"""

from __future__ import annotations

from typing import Any

from kombu import pools
from kombu.connection import Connection
from kombu.messaging import Producer
from kombu.pools import ProducerPool

__all__ = ["DeclaredProducer", "producer_pool"]


class DeclaredProducer(Producer):
    """kombu's ``Producer``; an entity its connection has declared already is not declared
    again (kombu's own answer, ``False``, without kombu's bind-and-ensure on the way)."""

    def maybe_declare(self, entity: Any, retry: bool = False, **retry_policy: Any) -> Any:
        if entity:
            try:
                declared = self.channel.connection.client.declared_entities
                if entity.can_cache_declaration and hash(entity) in declared:
                    return False
            except AttributeError:  # no channel, or one closed since: kombu's way below
                pass
        return super().maybe_declare(entity, retry, **retry_policy)  # type: ignore[no-untyped-call]


def producer_pool(connection: Connection, limit: int | None) -> ProducerPool:
    """A pool of :class:`DeclaredProducer` over kombu's shared pool of ``connection``'s
    connections (``pools.connections``), as ``pools.producers[connection]`` makes one."""
    return ProducerPool(  # type: ignore[no-untyped-call]
        pools.connections[connection], limit=limit, Producer=DeclaredProducer)
