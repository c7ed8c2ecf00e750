"""What taskdedup uses of redis-py beyond its public API, in one place, checked once.

* :func:`as_sent`: text as redis-py's encoder sends it, made before the call where that does
  not depend on the client's encoding (ASCII): the encoder returns bytes as they are and asks
  five ``isinstance`` questions of anything else (a publish's or a claim's arguments:
  microseconds per call).
* ``NEVER_DECODE``: the ``execute_command`` option that returns a reply undecoded, whatever
  the client's ``decode_responses``. Same name and value in redis-py 5.0 to 8.x.
* The raw pipelined exchange of :meth:`RedisStore.reserve_many`: one pooled connection,
  commands packed and sent in slices, replies read undecoded (``send_packed_command``,
  ``read_response(disable_decoding=True)``, the connection's ``retry``). About a third of the
  CPU of a redis-py pipeline per command. ``ConnectionPool.get_connection`` takes a command
  name up to redis-py 5.x and warns about it from 6.0 on.

Where the raw exchange is not available (a client class without a pool, a connection without
these methods) the store uses a plain non-transactional pipeline, and says so once at INFO.
"""

from __future__ import annotations

import inspect
import logging
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, cast

if TYPE_CHECKING:
    from redis.connection import Connection

__all__ = ["NEVER_DECODE", "as_sent", "raw_exchange"]

try:
    from redis.client import NEVER_DECODE
except ImportError:  # pragma: no cover - every supported redis-py has it
    NEVER_DECODE = "NEVER_DECODE"

logger = logging.getLogger("taskdedup")

_CONNECTION_METHODS = ("send_packed_command", "read_response", "disconnect", "pack_commands")
_explained: set[str] = set()

def as_sent(text: str, encoded: bytes | None = None) -> bytes | str:
    """``text`` as redis-py sends it when it is ASCII (``encoded``: those bytes, already
    made), else ``text`` itself: its bytes are then the client's encoding's to make."""
    if not text.isascii():
        return text
    return encoded if encoded is not None else text.encode()


def raw_exchange(client: Any) -> Callable[[], Connection] | None:
    """How to take a connection from ``client``'s pool for the raw exchange, or None (then
    use a pipeline): checked once per store, from the pool and one connection's class."""
    if getattr(client, "connection", None) is not None:
        return None  # a single-connection client: nothing to take from a pool
    pool = getattr(client, "connection_pool", None)
    get = getattr(pool, "get_connection", None)
    if get is None:
        _explain("the client has no connection pool")
        return None
    connection_class = getattr(pool, "connection_class", None)
    missing = [name for name in _CONNECTION_METHODS if not hasattr(connection_class, name)]
    if missing:
        _explain(f"{getattr(connection_class, '__name__', connection_class)} lacks "
                 f"{', '.join(missing)}")
        return None
    try:
        parameter = inspect.signature(get).parameters.get("command_name")
    except (TypeError, ValueError):
        parameter = None
    if parameter is not None and parameter.default is inspect.Parameter.empty:
        return lambda: cast("Connection", get("EVALSHA"))  # redis-py < 6: required
    return cast("Callable[[], Connection]", get)


def _explain(reason: str) -> None:
    if reason not in _explained:
        _explained.add(reason)
        logger.info("taskdedup: reserve_many uses a redis-py pipeline (%s)", reason)
