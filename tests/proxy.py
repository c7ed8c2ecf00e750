"""A small threaded TCP proxy on 127.0.0.1 that can cut connections on command.

Used by the fault tests to put a network fault *between* a client and Redis::

    with Proxy(("127.0.0.1", redis_port)) as proxy:
        store = RedisStore.from_url(proxy.url)
        proxy.cut_next_reply()      # the server executes the next command; its reply is lost
        store.reserve(...)          # -> the connection drops mid-call

Faults it can inject:

* :meth:`cut` — close every open connection at once (both sides), as a network blip or a
  load balancer reset does; new connections are accepted again right away.
* :meth:`cut_next_reply` — one shot: the next bytes the server sends back on any connection
  are dropped and that connection is closed, *after* the server ran the command. This is the
  nasty case: the write happened, the client cannot know.
* :meth:`cut_after` — one shot: forward ``n`` more bytes in one direction, then close.

Optionally the listening side speaks TLS (``ssl_context=``) and forwards plain TCP, like a
TLS terminator (stunnel, a cloud load balancer) in front of a server without TLS support.

Everything runs in daemon threads; :meth:`close` (or leaving the ``with`` block) stops them.
"""

from __future__ import annotations

import contextlib
import select
import socket
import ssl
import threading
from types import TracebackType

__all__ = ["Proxy"]

_CHUNK = 65536


class _Pair:
    """One client connection and its upstream connection."""

    def __init__(self, client: socket.socket, upstream: socket.socket) -> None:
        self.client = client
        self.upstream = upstream
        self.closed = threading.Event()

    def close(self) -> None:
        if self.closed.is_set():
            return
        self.closed.set()
        for sock in (self.client, self.upstream):
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)
            with contextlib.suppress(OSError):
                sock.close()


class Proxy:
    """Forward 127.0.0.1:``port`` to ``target``; cut connections when told to.

    Args:
        target: ``(host, port)`` of the real server.
        ssl_context: when given, accept TLS on the listening side (a server context).

    Counters (read them for the figures): ``connections`` accepted, ``cuts`` (connections
    closed by a fault).
    """

    def __init__(
        self, target: tuple[str, int], *, ssl_context: ssl.SSLContext | None = None
    ) -> None:
        self.target = target
        self.ssl_context = ssl_context
        self._listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._listener.bind(("127.0.0.1", 0))
        self._listener.listen(128)
        self.port: int = self._listener.getsockname()[1]
        self._lock = threading.Lock()
        self._pairs: set[_Pair] = set()
        # one-shot faults: direction ("up" client->server, "down" server->client) -> bytes left
        self._armed: dict[str, int] = {}
        self._stopped = threading.Event()
        self.connections = 0
        self.cuts = 0
        self._thread = threading.Thread(target=self._accept_loop, name="proxy-accept", daemon=True)
        self._thread.start()

    @property
    def url(self) -> str:
        scheme = "rediss" if self.ssl_context is not None else "redis"
        return f"{scheme}://127.0.0.1:{self.port}/0"

    # -- faults ---------------------------------------------------------------------------

    def cut(self) -> int:
        """Close every open connection now; returns how many were cut."""
        with self._lock:
            pairs = list(self._pairs)
            self._pairs.clear()
        for pair in pairs:
            pair.close()
        with self._lock:
            self.cuts += len(pairs)
        return len(pairs)

    def cut_next_reply(self) -> None:
        """One shot: drop the next reply from the server and close that connection."""
        self.cut_after(0, "down")

    def cut_after(self, n: int, direction: str = "down") -> None:
        """One shot: forward ``n`` more bytes ``direction`` ("up"/"down"), then close."""
        if direction not in ("up", "down"):
            raise ValueError("direction is 'up' (client to server) or 'down' (server to client)")
        with self._lock:
            self._armed[direction] = n

    def disarm(self) -> None:
        """Cancel one-shot faults that have not fired."""
        with self._lock:
            self._armed.clear()

    def armed(self) -> bool:
        """Whether a one-shot fault is still waiting to fire."""
        with self._lock:
            return bool(self._armed)

    # -- plumbing -------------------------------------------------------------------------

    def _accept_loop(self) -> None:
        while not self._stopped.is_set():
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            threading.Thread(
                target=self._serve, args=(client,), name="proxy-conn", daemon=True
            ).start()

    def _serve(self, client: socket.socket) -> None:
        try:
            if self.ssl_context is not None:
                client.settimeout(10)
                client = self.ssl_context.wrap_socket(client, server_side=True)
                client.settimeout(None)
            upstream = socket.create_connection(self.target, timeout=10)
            upstream.settimeout(None)
        except (OSError, ssl.SSLError):
            with contextlib.suppress(OSError):
                client.close()
            return
        pair = _Pair(client, upstream)
        with self._lock:
            self._pairs.add(pair)
            self.connections += 1
        try:
            self._pump(pair)
        finally:
            with self._lock:
                self._pairs.discard(pair)
            pair.close()

    def _pump(self, pair: _Pair) -> None:
        ends = {pair.client: (pair.upstream, "up"), pair.upstream: (pair.client, "down")}
        while not pair.closed.is_set():
            ready = [s for s in ends if isinstance(s, ssl.SSLSocket) and s.pending()]
            if not ready:
                try:
                    ready, _, _ = select.select(list(ends), [], [], 0.2)
                except (OSError, ValueError):
                    return
            for source in ready:
                try:
                    data = source.recv(_CHUNK)
                except (OSError, ssl.SSLError):
                    return
                if not data:
                    return
                sink, direction = ends[source]
                data, fire = self._take(direction, data)
                try:
                    if data:
                        sink.sendall(data)
                except OSError:
                    return
                if fire:
                    with self._lock:
                        self.cuts += 1
                    return

    def _take(self, direction: str, data: bytes) -> tuple[bytes, bool]:
        """What to forward of ``data``, and whether a one-shot fault fires on it."""
        with self._lock:
            left = self._armed.get(direction)
            if left is None:
                return data, False
            if len(data) <= left:
                self._armed[direction] = left - len(data)
                return data, False
            del self._armed[direction]
            return data[:left], True

    def close(self) -> None:
        self._stopped.set()
        with contextlib.suppress(OSError):
            self._listener.shutdown(socket.SHUT_RDWR)  # wakes the blocked accept()
        with contextlib.suppress(OSError):
            self._listener.close()
        self.cut()
        self._thread.join(timeout=5)

    def __enter__(self) -> Proxy:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()
