"""Approximate windows: the ``until_expired`` window kept in rotating Bloom filters (SPEC §12).

With ``Policy(window=Approximate(...))`` queued and running stay exact locks; when a call
succeeds its identity goes into the current *slice* of a Bloom filter (a Redis bitmap driven
by Lua) and its exact lock is deleted, so a remembered identity costs ~1-2 bytes instead of a
key. A new call checks the live slices and the exact lock in the same script as the
reservation (one round trip).

Sizing (docs/how-to/approximate-windows.md):

* ``slices`` = S: time is cut in slices of ``ttl / S``; an identity added in slice ``i`` stays
  checkable while slices ``i .. i + S`` are current, so it is remembered at least ``ttl`` and
  at most ``ttl + ttl / S`` after its success. Up to S + 1 slices are live at once.
* ``capacity`` counts the identities all live slices hold **together**; each slice is sized
  for ``capacity / (S + 1)`` identities at ``error_rate / (S + 1)``, so a check against the
  S + 1 live slices, each filled to its share, is a false positive with probability at most
  ``1 - (1 - error_rate / (S + 1)) ** (S + 1) <= error_rate``. For a steady rate of ``r``
  successes per second, ``capacity = r * ttl * (S + 1) / S`` keeps every slice within its
  share.
* Each slice is split by digest prefix over ``partitions`` keys (Redis Cluster spreads them
  over slots); per key ``m = ceil(-n ln p / (ln 2)^2)`` bits (rounded up to a byte) and
  ``k = round((m / n) ln 2)`` positions, with ``p = error_rate / (S + 1)`` and ``n`` the
  mean share ``capacity / ((S + 1) * partitions)`` plus one standard deviation of it (the
  identities fall on the partitions at random).

Keys (``{prefix}:{scope}:{task}`` as for exact locks; the braces are a Cluster hash tag)::

    lock    taskdedup:charge:{5f1c09e2.7}3fa9...         exact lock while queued / running
    slice   taskdedup:bloom:charge:{5f1c09e2.7}:2880123  partition 7's bitmap, slice 2880123

The hash tag is a CRC-32 of ``scope:task`` and the partition. The lock of an identity and
the slices of its partition share it, hence a slot: the reservation script touches only
keys of one slot, and a task's partitions spread over as many slots. Each slice bitmap ends
with a tail after its ``m`` bits: identities added (u32), ``k`` (u8), ``slices`` (u8) and the
index of the first slice of this partition still counted (i64), read by ``taskdedup stats``.

The server's clock (``TIME`` in the scripts) decides which slice a success goes into, which
slices a call checks and when a slice expires; a caller only passes the slice keys of a span
of indices around its own clock (:meth:`Probe.span`). A caller whose clock is off by more
than a slice is told the server's time and calls again (the Redis store then keeps that
offset), so no clock opens a gap in the window.

An explicit ``dedup_key`` (a non-empty argument digest, ``check``) also adds, at success, a
second filter identity derived from the digest and ``check``: a later call with the key
whose own pair is not remembered is ``IdempotencyKeyMismatch``, as on the exact tier (SPEC
§3). Such a success takes two identities' room in the filter.
"""

from __future__ import annotations

import functools
import hashlib
import math
import threading
import zlib
from dataclasses import dataclass, field
from typing import Final

from .exceptions import ConfigurationError

__all__ = ["Approximate", "Probe", "TAIL_BYTES", "probe_for", "register", "split_lock_key"]

TAIL_BYTES: Final = 14
"""Bytes after the ``m`` bits of a slice bitmap: count u32, k u8, slices u8, origin i64."""

_MAX_BITS: Final = 2**32 - 8 * (TAIL_BYTES + 1)  # a Redis string holds at most 2^32 bits
_BLOOM: Final = "bloom"


@dataclass(frozen=True)
class Approximate:
    """Remember ``until_expired``'s window in rotating Bloom filters instead of exact locks.

    Args:
        capacity: identities the live slices hold together at ``error_rate`` (see the module
            docstring: for ``r`` successes per second, ``r * ttl * (slices + 1) / slices``).
        error_rate: the false-positive rate at capacity: the probability that a new call is
            taken for a duplicate (0 < error_rate < 1).
        slices: how many slices of ``ttl / slices`` the window rotates through (>= 1).
        partitions: keys each slice is split over by digest prefix (spread over Cluster
            slots; no single hot key per task).

    Example::

        Policy(mode="until_expired", ttl=86400,
               window=Approximate(capacity=10_000_000, error_rate=0.001))
    """

    capacity: int
    error_rate: float
    slices: int = 4
    partitions: int = 16
    bits: int = field(init=False, repr=False)
    """``m``: bits of one slice bitmap of one partition (a multiple of 8)."""
    hashes: int = field(init=False, repr=False)
    """``k``: bit positions per identity."""
    share: int = field(init=False, repr=False)
    """Identities one slice of one partition is sized for (the WARNING threshold)."""

    def __post_init__(self) -> None:
        capacity, error_rate = self.capacity, self.error_rate
        if not isinstance(capacity, int) or isinstance(capacity, bool) or capacity <= 0:
            raise ConfigurationError(
                f"Approximate(capacity={capacity!r}): capacity must be a positive int, the "
                "identities the window remembers at once"
            )
        if (not isinstance(error_rate, (int, float)) or isinstance(error_rate, bool)
                or not 0 < error_rate < 1):
            raise ConfigurationError(
                f"Approximate(error_rate={error_rate!r}): error_rate must be a number between "
                "0 and 1 (exclusive), e.g. 0.001"
            )
        for name in ("slices", "partitions"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or not 1 <= value <= 255:
                raise ConfigurationError(
                    f"Approximate({name}={value!r}): {name} must be an int from 1 to 255"
                )
        live = self.slices + 1
        mean = max(1.0, capacity / (live * self.partitions))
        # Identities fall on partitions at random, and a fuller partition costs more false
        # positives than an emptier one saves: size each key for one standard deviation
        # above its mean share (+0.3% memory at 125,000 identities per key, +6% at 250).
        n = mean + math.sqrt(mean * (1 - 1 / self.partitions))
        p = error_rate / live
        bits = math.ceil(-n * math.log(p) / math.log(2) ** 2)
        bits = max(64, (bits + 7) // 8 * 8)
        if bits > _MAX_BITS:
            raise ConfigurationError(
                f"Approximate(capacity={capacity}): one slice key would need {bits} bits, "
                f"more than a Redis string holds; raise partitions (now {self.partitions})"
            )
        hashes = max(1, round(bits / n * math.log(2)))
        object.__setattr__(self, "bits", bits)
        object.__setattr__(self, "hashes", hashes)
        object.__setattr__(self, "share", max(1, math.ceil(mean)))

    @property
    def bytes(self) -> int:
        """Redis memory of the bitmaps when every live slice exists (values only)."""
        return (self.slices + 1) * self.partitions * (self.bits // 8 + TAIL_BYTES)

    def positions(self, digest: str) -> tuple[int, list[int]]:
        """The partition and the ``k`` bit positions of a 32-hex ``digest``: the partition
        from its first 32 bits, the positions by enhanced double hashing (Dillinger and
        Manolios) of the other 96 — plain double hashing measured ~20% above the rate."""
        partition = int(digest[:8], 16) % self.partitions
        m = self.bits
        # position i = h1 + i * h2 + (i^3 - i) / 6 (mod m), by its differences h2 + i(i+1)/2
        x = int(digest[8:20], 16) % m
        y = int(digest[20:32], 16) % m
        out = []
        for i in range(1, self.hashes + 1):
            out.append(x)
            x = (x + y) % m
            y = (y + i) % m
        return partition, out

    def fpr(self, fill: float) -> float:
        """The false-positive rate of one slice whose bits are ``fill`` set (0..1)."""
        return fill ** self.hashes


@functools.lru_cache(maxsize=1024)
def _task_tag(scope: str | None, name: str) -> str:
    """8 hex digits naming the task (and scope) in hash tags: no ``:`` in a tag, so the
    readable part of a key still splits on ``:`` as for exact locks."""
    text = f"{scope}:{name}" if scope else f":{name}"
    return f"{zlib.crc32(text.encode()):08x}"


def lock_key(prefix: str, scope: str | None, name: str, digest: str,
             window: Approximate) -> str:
    """The exact lock key of an identity under ``window``: the readable
    ``{prefix}:{scope}:{task}:`` then the hash tag of its partition, then the digest."""
    for part, what in ((prefix, "key prefix"), (scope or "", "scope"), (name, "task name")):
        if "{" in part or "}" in part:
            raise ConfigurationError(
                f"an approximate window needs a {what} without braces (they make the Redis "
                f"Cluster hash tag), got {part!r}"
            )
    partition = int(digest[:8], 16) % window.partitions
    base = f"{prefix}:{scope}:{name}" if scope else f"{prefix}:{name}"
    return f"{base}:{{{_task_tag(scope, name)}.{partition}}}{digest}"


def split_lock_key(key: str) -> tuple[str, str, str, str] | None:
    """``(prefix, scope:task or task, tag, digest)`` of an approximate lock key, or None."""
    if len(key) < 36 or key[-33] != "}":
        return None
    opening = key.rfind(":{", 0, len(key) - 33)
    if opening < 0:
        return None
    prefix, sep, task = key[:opening].partition(":")
    if not sep:
        return None
    return prefix, task, key[opening + 2 : len(key) - 33], key[-32:]


@dataclass(slots=True)
class Probe:
    """What the scripts need to check, or add, one identity under an approximate window.

    The server's clock decides which slices are live and which one is current (SPEC §12):
    a call passes the slice keys of a span of indices around its own clock (:meth:`span`)
    and the script takes the live ones on the server's ``TIME``, so a client clock off by
    up to a slice either way changes nothing.
    """

    window: Approximate
    slice_prefix: str
    """``{prefix}:bloom:{scope}:{task}:{tag}:``; a slice key is this and its time index."""
    positions: str
    """The ``k`` bit positions, comma-separated (a script argument)."""
    slice_ms: int
    ttl_ms: int
    digest: str
    """The identity's 32-hex digest (the argument check's filter identity derives from it)."""

    def index(self, now_ms: int) -> int:
        return now_ms // self.slice_ms

    def keys(self, now_ms: int) -> list[str]:
        """The live slice keys at ``now_ms`` (the server's clock), current first."""
        index = now_ms // self.slice_ms
        return [f"{self.slice_prefix}{index - back}" for back in range(self.window.slices + 1)]

    def span(self, now_ms: int) -> tuple[int, list[str]]:
        """The first index and the slice keys, oldest first, that a call whose clock reads
        ``now_ms`` passes: ``index - (slices + 1)`` to ``index + 1``, the live slices of any
        server clock within a slice of ``now_ms``."""
        first = now_ms // self.slice_ms - self.window.slices - 1
        return first, [f"{self.slice_prefix}{first + i}"
                       for i in range(self.window.slices + 3)]

    def argument(self, first: int) -> str:
        """The window argument of the scripts for keys from index ``first``:
        ``first:slice_ms:ttl_ms:m:k:slices:p1,p2,...`` (``seen`` in ``_lib.lua``)."""
        window = self.window
        return (f"{first}:{self.slice_ms}:{self.ttl_ms}:{window.bits}:{window.hashes}:"
                f"{window.slices}:{self.positions}")

    def expire_at_ms(self, index: int) -> int:
        """When slice ``index`` stops being live (its last identity is ``ttl`` old)."""
        return (index + 1) * self.slice_ms + self.ttl_ms

    def check_positions(self, check: str) -> list[int]:
        """The bit positions of the filter identity of this identity *and* the argument
        digest ``check`` (an explicit key's arguments, SPEC §3): added beside the identity at
        success, so a later call with the key and other arguments is told apart (the same
        derivation as ``check_bits`` in ``_lib.lua``)."""
        pair = hashlib.sha1(f"{self.digest}:{check}".encode()).hexdigest()
        return self.window.positions(pair[:32])[1]


def probe(key: str, window: Approximate, ttl_ms: int) -> Probe | None:
    """The probe of the approximate lock ``key`` (None when ``key`` is not one)."""
    parts = split_lock_key(key)
    if parts is None:
        return None
    prefix, task, tag, digest = parts
    _, positions = window.positions(digest)
    slice_ms = max(1, ttl_ms // window.slices)
    return Probe(window, f"{prefix}:{_BLOOM}:{task}:{{{tag}}}:",
                 ",".join(map(str, positions)), slice_ms, ttl_ms, digest)


def slice_pattern(prefix: str) -> str:
    """SCAN pattern of every slice key under ``prefix`` (stats)."""
    return f"{prefix}:{_BLOOM}:*"


# -- the registry the fused Celery publish reads ------------------------------------------------
# Deduplicator.identity registers each approximate task (by the readable part of its keys);
# the broker's push (taskdedup.celery.transport), which sees only the lock key, finds the
# window here. One entry per declared task and scope.

_registry: dict[str, tuple[Approximate, int]] = {}
_registry_lock = threading.Lock()


def _base(key: str) -> str:
    return key[: key.rfind(":{", 0, len(key) - 33)]


def register(key: str, window: Approximate, ttl_ms: int) -> None:
    """Remember that the task of approximate lock ``key`` has ``window`` and ``ttl_ms``."""
    base = _base(key)
    if _registry.get(base) != (window, ttl_ms):
        with _registry_lock:
            _registry[base] = (window, ttl_ms)


def probe_for(key: str) -> Probe | None:
    """The probe of ``key`` when it is an approximate lock key registered in this process."""
    if len(key) < 36 or key[-33] != "}":
        return None
    entry = _registry.get(_base(key))
    if entry is None:
        return None
    return probe(key, *entry)
