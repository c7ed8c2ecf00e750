"""Deterministic identity of a task call: bind, canonicalize, hash.

Two calls that mean the same work must get the same identity on the caller and on the
worker, after the arguments have crossed the broker (kombu's json, msgpack, yaml and
pickle serializers, RQ's pickle). So the identity is computed from a *canonical form*
of the arguments, not from their Python ``repr``: every value is turned into
type-tagged, self-delimiting bytes in which the differences a serializer introduces
(tuple → list, ``1.0`` → ``1``, int dict keys → str keys, key order) disappear, while the
differences that matter (``True`` vs ``1``, ``"A"`` vs ``"a"``) stay.

The digest is SHA-256 over a versioned domain prefix (``taskdedup:v1:args`` for
arguments, ``taskdedup:v1:value`` for explicit keys, so an idempotency key never equals an
argument digest), the scope, the task name and the canonical bytes; the identity is the
hex of its first 128 bits (32 lowercase hex characters). A change to any form below is
a new :data:`FINGERPRINT_VERSION`.

Canonical forms (one tag byte, then the payload; variable-length payloads are
length-prefixed or terminated by ``;``):

* ``None`` → ``N``; ``True`` → ``T``; ``False`` → ``F`` (so ``True != 1``).
* ``int`` (any size) → ``i<hex>;``.
* ``float``: integral values are the int (``1.0 == 1``, ``-0.0 == 0``, ``1e20`` is the
  int ``10**20``); other values (including ``inf``/``-inf``) → ``f`` + the 8 bytes of the
  IEEE-754 big-endian double (exact, like ``float.hex``). NaN is refused: it never
  equals itself, so it cannot identify anything.
* ``str`` → ``s<len>:`` + UTF-8 (lone surrogates kept with ``surrogatepass``); compared
  exactly as given, no case folding or Unicode normalization.
* ``bytes``, ``bytearray``, ``memoryview`` → one form, ``b<len>:`` + the bytes.
* ``list``, ``tuple`` and their subclasses (``NamedTuple`` included: JSON makes it a
  list) → one *sequence* form, ``l<count>:`` + the items in order.
* ``set``, ``frozenset`` → ``e<count>:`` + the encoded items sorted by their bytes.
* ``dict`` and any ``collections.abc.Mapping`` → ``d<count>:`` + (key, value) pairs sorted
  by the encoded key (ties, possible only after key conversion, by the value). Keys:
  ``str`` as is; ``int`` → its decimal string, ``True``/``False``/``None`` →
  ``"true"``/``"false"``/``"null"`` and an integral float → the int's string (this is how
  JSON spells them, so ``{1: x} == {"1": x}`` and the identity survives kombu's json);
  an ``Enum`` key → the key form of its value; any other key (tuple, UUID, date,
  non-integral float, …) → ``k`` + its canonical value form, never equal to a str key.
* ``datetime``: aware → ``Z`` + the UTC instant in microseconds since the Unix epoch
  (so the same instant in two time zones is one identity); naive → ``D`` + the same count
  read as if the wall time were UTC (a distinct tag: no time zone is assumed).
* ``date`` → ``a`` + its proleptic ordinal.
* ``time``: naive → ``h`` + microseconds since midnight; aware → ``H`` + microseconds
  since midnight UTC (minus the offset, not wrapped), matching Python's ``==``.
* ``Decimal`` → ``m`` + sign, digits without trailing zeros and exponent
  (``Decimal("1.10") == Decimal("1.1")``, ``-0 == 0``); independent of the decimal
  context; an integral Decimal stays a Decimal (``Decimal(1) != 1``); infinities
  allowed, NaN and sNaN refused.
* ``UUID`` → ``u`` + its 16 bytes.
* ``Enum`` member → the canonical form of its ``.value``.
* dataclass instance → the mapping of its fields (``dataclasses.fields``, shallow; values
  canonical in turn), so a dataclass equals the dict of its fields.
* pydantic v2 model (duck-typed: its class has ``model_dump``) → the mapping returned
  by ``model_dump()``.
* types registered with :func:`register_canonical` → the canonical form of what the
  registered function returns. Lookup: the exact type, then its MRO; a registration wins
  over the built-in handling of subclasses of built-ins.

Anything else (an open file, a function or lambda, a class, ``object()``, a generator,
NaN, a reference cycle, nesting deeper than :data:`MAX_DEPTH`) raises ``TypeError``
naming the argument path, e.g. ``kwargs['order'].items[3]``. Messages name the offending
*type*, never an argument's value, so they are safe to log.

Bounded work (arguments are not trusted: SPEC §8). One object may be met many times in one
call — YAML anchors and aliases, pickle's references, ``[a, a]`` — and the canonical form
repeats it each time, so a 4 KB message could stand for billions of nodes. Within one call
each container (and each string, bytes or int longer than 256 bytes) is encoded once; met
again, where its nesting is known to fit under :data:`MAX_DEPTH`, its bytes are repeated
without walking it. The repetition is charged to :data:`MAX_SHARED_BYTES`: past it,
``TypeError`` names the path where the budget ran out. Everything else is encoded once per
occurrence in the input, so the work is linear in the size of the input plus that budget.
Sharing never changes a canonical form: a value and an unshared copy of it have one identity.
"""

from __future__ import annotations

import dataclasses
import datetime as _dt
import enum
import hashlib
import inspect
import math
import struct
import uuid
from collections.abc import Callable, Collection, Mapping, Sequence
from decimal import Decimal
from itertools import pairwise
from operator import itemgetter
from typing import Any, Final

__all__ = [
    "FINGERPRINT_VERSION",
    "MAX_DEPTH",
    "MAX_SHARED_BYTES",
    "bind_arguments",
    "canonical_bytes",
    "fingerprint",
    "fingerprint_value",
    "register_canonical",
]

FINGERPRINT_VERSION: int = 1
"""Version of the canonical form; part of every digest so a change can be rolled out."""

MAX_DEPTH: Final = 100
"""Deepest nesting of containers accepted in one argument."""

MAX_SHARED_BYTES: int = 32 * 1024 * 1024
"""Most bytes of canonical form that objects met again in one call may repeat (32 MiB).

An object seen twice — a YAML alias, a pickle reference, ``[a, a]`` — costs its canonical size
again; past this budget :func:`fingerprint` raises ``TypeError`` naming the path. Legitimate
arguments rarely repeat more than a few kilobytes; a hostile message that expands
exponentially is stopped after a fraction of a second and this much memory.
"""

_ARGS_PREFIX: Final = b"taskdedup:v%d:args\0" % FINGERPRINT_VERSION
_VALUE_PREFIX: Final = b"taskdedup:v%d:value\0" % FINGERPRINT_VERSION
_HINT: Final = (
    "pass JSON-like values, or register a canonical form with taskdedup.register_canonical"
)
_SIGNATURE_CACHE_SIZE: Final = 4096
_RESOLVED_CACHE_SIZE: Final = 4096

_LARGE: Final = 256
"""Scalars (str, bytes, int) whose form is longer than this are remembered by ``id`` too."""

_sha256 = hashlib.sha256
_isnan = math.isnan
_pack_double = struct.Struct(">d").pack
_first = itemgetter(0)
_EPOCH: Final = _dt.datetime(1970, 1, 1)
_MICROSECOND: Final = _dt.timedelta(microseconds=1)


class _Refusal(Exception):
    """Internal: a value cannot be canonicalized; collects its path while unwinding.

    Raised deep inside the encoder without any path bookkeeping on the fast path; each
    container frame it passes through appends its segment, and the public entry point turns
    it into a ``TypeError`` with the full path.
    """

    def __init__(self, reason: str, *, too_deep: bool = False) -> None:
        super().__init__(reason)
        self.reason = reason
        self.too_deep = too_deep
        self.segments: list[str] = []
        self.containers: list[object] = []

    def add(self, segment: str, container: object) -> None:
        self.segments.append(segment)
        self.containers.append(container)


def _typename(tp: type) -> str:
    if tp.__module__ == "builtins":
        return tp.__qualname__
    return f"{tp.__module__}.{tp.__qualname__}"


def _too_deep() -> _Refusal:
    return _Refusal(f"nested deeper than {MAX_DEPTH} levels", too_deep=True)


def _over_budget() -> _Refusal:
    return _Refusal(
        "shared sub-objects (one object met again and again: YAML aliases, pickle references, "
        f"[a, a]) repeat more than MAX_SHARED_BYTES ({MAX_SHARED_BYTES} bytes) of canonical "
        "form; pass plain data, or an explicit dedup_key"
    )


# --- one call's memory of what it encoded --------------------------------------------------


class _Walk(dict[int, tuple[Any, ...]]):
    """What one canonicalization has encoded so far, by ``id``, and the bytes it repeated.

    It maps a container's ``id`` to ``(obj, chunks, start, end, depth)`` — where its bytes lie
    and the depth it was encoded at — or, once repeated, to ``(obj, bytes, depth)``. ``large``
    holds the long scalars seen. Both keep their objects alive, so an ``id`` is never reused;
    so does ``lists`` for the chunk lists other than the root registered in :data:`_WALKS`.
    The attributes are class defaults until first set: a walk is cheap to make.
    """

    spent = 0
    large: dict[int, Any] | None = None
    lists: list[list[bytes]] | None = None


_WALKS: dict[int, _Walk] = {}
"""The walk of every chunk list of the calls under way, by the list's ``id``. Made on first
need, so the common call (scalar arguments) never makes one, and chunk lists stay plain lists
(CPython's fast paths for ``append`` and ``bytes.join`` want exactly a list)."""

_Encoder = Callable[[Any, list[bytes], int], None]


def _walk(out: list[bytes]) -> _Walk:
    walk = _WALKS.get(id(out))
    if walk is None:
        walk = _WALKS[id(out)] = _Walk()
    return walk


def _sub(out: list[bytes], *chunks: bytes) -> list[bytes]:
    """A separate chunk list (a set member, a key) that shares ``out``'s walk."""
    walk = _walk(out)
    sub = list(chunks)
    if walk.lists is None:
        walk.lists = [sub]
    else:
        walk.lists.append(sub)
    _WALKS[id(sub)] = walk
    return sub


def _end(out: list[bytes]) -> None:
    """Drop the walk of a call's root chunk list, and its other lists' entries."""
    walk = _WALKS.pop(id(out), None)
    if walk is not None and walk.lists is not None:
        for chunks in walk.lists:
            _WALKS.pop(id(chunks), None)


def _spend(walk: _Walk, size: int) -> None:
    walk.spent += size
    if walk.spent > MAX_SHARED_BYTES:
        raise _over_budget()


def _seen(value: Any, out: list[bytes], depth: int) -> _Walk | None:
    """The walk to record ``value`` in; None when ``value`` was encoded before at ``depth`` or
    deeper (so its nesting fits here too) and its bytes have just been appended again."""
    walk = _walk(out)
    done = walk.get(id(value))
    if done is None or depth > done[-1]:
        return walk
    _replay(walk, value, done, out)
    return None


def _replay(walk: _Walk, value: Any, done: tuple[Any, ...], out: list[bytes]) -> None:
    """Append again the bytes of ``value`` (``done`` is its entry), charged to the budget."""
    if len(done) == 5:
        data = b"".join(done[1][done[2] : done[3]])
        walk[id(value)] = (value, data, done[4])
    else:
        data = done[1]
    _spend(walk, len(data))
    out.append(data)


def _repeat(out: list[bytes], value: Any, size: int) -> None:
    """Charge a long scalar's ``size`` to the budget when this call has met it before."""
    walk = _walk(out)
    large = walk.large
    if large is None:
        walk.large = {id(value): value}
    elif id(value) in large:
        _spend(walk, size)
    else:
        large[id(value)] = value


def _encode(value: Any, out: list[bytes], depth: int) -> None:
    tp = type(value)
    (_DISPATCH.get(tp) or _resolve(tp))(value, out, depth)


# --- scalar encoders ----------------------------------------------------------------------


def _enc_none(value: Any, out: list[bytes], depth: int) -> None:
    out.append(b"N")


def _enc_bool(value: Any, out: list[bytes], depth: int) -> None:
    out.append(b"T" if value else b"F")


def _enc_int(value: Any, out: list[bytes], depth: int) -> None:
    chunk = b"i%x;" % value
    if len(chunk) > _LARGE:
        _repeat(out, value, len(chunk))
    out.append(chunk)


def _enc_float(value: Any, out: list[bytes], depth: int) -> None:
    if value.is_integer():
        out.append(b"i%x;" % int(value))
    elif _isnan(value):
        raise _Refusal("float NaN (NaN never equals itself, so it cannot identify a call)")
    else:
        out.append(b"f" + _pack_double(value))


def _enc_str(value: Any, out: list[bytes], depth: int) -> None:
    data = value.encode("utf-8", "surrogatepass")
    if len(data) > _LARGE:
        _repeat(out, value, len(data))
    out.append(b"s%x:%b" % (len(data), data))


def _enc_bytes(value: Any, out: list[bytes], depth: int) -> None:
    data = bytes(value)
    if len(data) > _LARGE:
        _repeat(out, value, len(data))
    out.append(b"b%x:" % len(data))
    out.append(data)


def _enc_memoryview(value: Any, out: list[bytes], depth: int) -> None:
    _enc_bytes(value.tobytes(), out, depth)


def _enc_datetime(value: Any, out: list[bytes], depth: int) -> None:
    offset = value.utcoffset()
    if offset is None:
        out.append(b"D%x;" % ((value - _EPOCH) // _MICROSECOND))
    else:
        # Timedelta arithmetic, not astimezone(): no overflow at the ends of the range.
        out.append(b"Z%x;" % ((value.replace(tzinfo=None) - _EPOCH - offset) // _MICROSECOND))


def _enc_date(value: Any, out: list[bytes], depth: int) -> None:
    out.append(b"a%x;" % value.toordinal())


def _enc_time(value: Any, out: list[bytes], depth: int) -> None:
    micros = (value.hour * 3600 + value.minute * 60 + value.second) * 1_000_000 + value.microsecond
    offset = value.utcoffset()
    if offset is None:
        out.append(b"h%x;" % micros)
    else:
        out.append(b"H%x;" % (micros - offset // _MICROSECOND))


def _enc_decimal(value: Any, out: list[bytes], depth: int) -> None:
    if not value.is_finite():
        if value.is_infinite():
            out.append(b"m-inf;" if value.is_signed() else b"minf;")
            return
        raise _Refusal("Decimal NaN (NaN never equals itself, so it cannot identify a call)")
    sign, digits, exponent = value.as_tuple()
    end = len(digits)
    while end and digits[end - 1] == 0:
        end -= 1
    if end == 0:
        out.append(b"m0;")
        return
    if end > _LARGE:
        _repeat(out, value, end)
    exponent += len(digits) - end
    text = "".join(map(str, digits[:end]))
    out.append(b"m%s%se%d;" % (b"-" if sign else b"", text.encode("ascii"), exponent))


def _enc_uuid(value: Any, out: list[bytes], depth: int) -> None:
    out.append(b"u" + value.bytes)


# --- container encoders -------------------------------------------------------------------


def _enc_sequence(value: Any, out: list[bytes], depth: int) -> None:
    if depth >= MAX_DEPTH:
        raise _too_deep()
    if depth:
        walk = _WALKS.get(id(out))
        if walk is not None:
            done = walk.get(id(value))
            if done is not None and depth <= done[-1]:
                _replay(walk, value, done, out)
                return
    start = len(out)
    count = len(value)
    out.append(b"l%x:" % count)
    inner = depth + 1
    index = 0
    try:
        for index, item in enumerate(value):  # noqa: B007 (read by the except)
            tp = type(item)
            if tp is str:  # inlined: the most common item
                data = item.encode("utf-8", "surrogatepass")
                if len(data) > _LARGE:
                    _repeat(out, item, len(data))
                out.append(b"s%x:%b" % (len(data), data))
            else:
                (_DISPATCH.get(tp) or _resolve(tp))(item, out, inner)
    except _Refusal as exc:
        exc.add(f"[{index}]", value)
        raise
    if depth and count:
        _walk(out)[id(value)] = (value, out, start, len(out), depth)


def _enc_set(value: Any, out: list[bytes], depth: int) -> None:
    if depth >= MAX_DEPTH:
        raise _too_deep()
    walk = _seen(value, out, depth) if depth else None
    if depth and walk is None:
        return
    start = len(out)
    inner = depth + 1
    parts: list[bytes] = []
    try:
        for item in value:
            sub = _sub(out)
            _encode(item, sub, inner)
            parts.append(b"".join(sub))
    except _Refusal as exc:
        exc.add("{set}", value)
        raise
    parts.sort()
    out.append(b"e%x:" % len(parts))
    out.extend(parts)
    if walk is not None and parts:
        walk[id(value)] = (value, out, start, len(out), depth)


def _key_segment(key: Any, attr: bool) -> str:
    if attr and type(key) is str:
        return f".{key}"
    if type(key) in (str, int, bool, float) or key is None:
        text = repr(key)
        if len(text) > 60:
            text = text[:57] + "..."
        return f"[{text}]"
    return f"[<{_typename(type(key))} key>]"


def _str_key(text: str) -> bytes:
    data = text.encode("utf-8", "surrogatepass")
    return b"s%x:%b" % (len(data), data)


def _key_bytes(key: Any, depth: int, out: list[bytes]) -> bytes:
    """The encoded form of a mapping key: JSON's spelling for scalars, else tagged ``k``."""
    tp = type(key)
    if tp is str:
        return _str_key(key)
    if tp is int:
        try:
            encoded = _str_key(str(key))
        except ValueError:  # beyond sys.get_int_max_str_digits(); JSON could not carry it
            raise _Refusal("int key with too many digits") from None
        if len(encoded) > _LARGE:
            _repeat(out, key, len(encoded))
        return encoded
    if tp is bool:
        return b"s4:true" if key else b"s5:false"
    if key is None:
        return b"s4:null"
    if tp is float:
        if key.is_integer():
            return _key_bytes(int(key), depth, out)
    else:
        fn = _registered(tp)
        if fn is not None or tp not in _BUILTIN:
            if depth >= MAX_DEPTH:
                raise _too_deep()
            if fn is not None:
                return _key_bytes(fn(key), depth + 1, out)
            if isinstance(key, enum.Enum):
                return _key_bytes(key.value, depth + 1, out)
            if isinstance(key, str):
                return _str_key(str.__str__(key))
            if isinstance(key, int):
                return _key_bytes(int(key), depth, out)
            if isinstance(key, float):
                return _key_bytes(float(key), depth, out)
    sub = _sub(out, b"k")
    _encode(key, sub, depth)
    return b"".join(sub)


def _enc_mapping(value: Any, out: list[bytes], depth: int, attr: bool = False) -> None:
    if depth >= MAX_DEPTH:
        raise _too_deep()
    if depth:
        walk = _WALKS.get(id(out))
        if walk is not None:
            done = walk.get(id(value))
            if done is not None and depth <= done[-1]:
                _replay(walk, value, done, out)
                return
    start = len(out)
    inner = depth + 1
    items: list[tuple[bytes, Any, Any]] = []
    key: Any = None
    # Distinct str keys of a dict never share a form; other keys may ({1: a, "1": b}).
    mixed = type(value) is not dict
    try:
        for key, item in value.items():
            if type(key) is str:
                data = key.encode("utf-8", "surrogatepass")
                if len(data) > _LARGE:
                    _repeat(out, key, len(data))
                items.append((b"s%x:%b" % (len(data), data), key, item))
            else:
                mixed = True
                items.append((_key_bytes(key, inner, out), key, item))
    except _Refusal as exc:
        exc.add(f"[<{_typename(type(key))} key>]", value)
        raise
    if len(items) > 1:
        items.sort(key=_first)
    out.append(b"d%x:" % len(items))
    if mixed and any(a[0] == b[0] for a, b in pairwise(items)):
        _enc_colliding_items(value, items, out, inner, attr)
    else:
        try:
            for encoded_key, key, item in items:  # noqa: B007 (read by the except)
                tp = type(item)
                if tp is str:
                    data = item.encode("utf-8", "surrogatepass")
                    if len(data) > _LARGE:
                        _repeat(out, item, len(data))
                    out.append(b"%bs%x:%b" % (encoded_key, len(data), data))
                else:
                    out.append(encoded_key)
                    (_DISPATCH.get(tp) or _resolve(tp))(item, out, inner)
        except _Refusal as exc:
            exc.add(_key_segment(key, attr), value)
            raise
    if depth and items:
        _walk(out)[id(value)] = (value, out, start, len(out), depth)


def _enc_colliding_items(
    mapping: Any, items: list[tuple[bytes, Any, Any]], out: list[bytes], depth: int, attr: bool
) -> None:
    """Rare path: two keys share a form (``{1: a, "1": b}``); order pairs by value too."""
    pairs: list[tuple[bytes, bytes]] = []
    for encoded_key, key, item in items:
        sub = _sub(out)
        try:
            _encode(item, sub, depth)
        except _Refusal as exc:
            exc.add(_key_segment(key, attr), mapping)
            raise
        pairs.append((encoded_key, b"".join(sub)))
    pairs.sort()
    for encoded_key, encoded_value in pairs:
        out.append(encoded_key)
        out.append(encoded_value)


# --- encoders resolved per type -----------------------------------------------------------


def _enc_enum(value: Any, out: list[bytes], depth: int) -> None:
    if depth >= MAX_DEPTH:
        raise _too_deep()
    try:
        _encode(value.value, out, depth + 1)
    except _Refusal as exc:
        exc.add("", value)
        raise


def _enc_model(value: Any, out: list[bytes], depth: int) -> None:
    walk = _seen(value, out, depth) if depth else None
    if depth and walk is None:
        return
    start = len(out)
    dumped = value.model_dump()
    if not isinstance(dumped, Mapping):
        raise _Refusal(
            f"{_typename(type(value))}.model_dump() returned {_typename(type(dumped))}, "
            "not a mapping"
        )
    try:
        _enc_mapping(dumped, out, depth, attr=True)
    except _Refusal as exc:
        exc.add("", value)
        raise
    if walk is not None:
        walk[id(value)] = (value, out, start, len(out), depth)


def _make_dataclass_encoder(tp: type) -> _Encoder:
    entries = sorted((_str_key(f.name), f.name) for f in dataclasses.fields(tp))
    header = b"d%x:" % len(entries)

    def encode_dataclass(value: Any, out: list[bytes], depth: int) -> None:
        if depth >= MAX_DEPTH:
            raise _too_deep()
        walk = _seen(value, out, depth) if depth else None
        if depth and walk is None:
            return
        start = len(out)
        out.append(header)
        name = ""
        try:
            for encoded_key, name in entries:
                out.append(encoded_key)
                item = getattr(value, name)
                tp = type(item)
                (_DISPATCH.get(tp) or _resolve(tp))(item, out, depth + 1)
        except _Refusal as exc:
            exc.add(f".{name}", value)
            raise
        if walk is not None:
            walk[id(value)] = (value, out, start, len(out), depth)

    return encode_dataclass


def _make_converter(fn: Callable[[Any], Any]) -> _Encoder:
    def encode_registered(value: Any, out: list[bytes], depth: int) -> None:
        if depth >= MAX_DEPTH:
            raise _too_deep()
        walk = _seen(value, out, depth) if depth else None
        if depth and walk is None:
            return
        start = len(out)
        try:
            _encode(fn(value), out, depth + 1)
        except _Refusal as exc:
            exc.add("", value)
            raise
        if walk is not None:
            walk[id(value)] = (value, out, start, len(out), depth)

    return encode_registered


def _make_cast(cast: Callable[[Any], Any], encoder: _Encoder) -> _Encoder:
    def encode_subclass(value: Any, out: list[bytes], depth: int) -> None:
        encoder(cast(value), out, depth)

    return encode_subclass


def _enc_refuse(value: Any, out: list[bytes], depth: int) -> None:
    if isinstance(value, type):
        raise _Refusal(f"a class ({_typename(value)}) — {_HINT}")
    raise _Refusal(f"unsupported type {_typename(type(value))} — {_HINT}")


_BUILTIN: Final[dict[type, _Encoder]] = {
    type(None): _enc_none,
    bool: _enc_bool,
    int: _enc_int,
    float: _enc_float,
    str: _enc_str,
    bytes: _enc_bytes,
    bytearray: _enc_bytes,
    memoryview: _enc_memoryview,
    list: _enc_sequence,
    tuple: _enc_sequence,
    dict: _enc_mapping,
    set: _enc_set,
    frozenset: _enc_set,
    _dt.datetime: _enc_datetime,
    _dt.date: _enc_date,
    _dt.time: _enc_time,
    Decimal: _enc_decimal,
    uuid.UUID: _enc_uuid,
}
"""Exact built-in types: the fast path."""

_CORE: Final = frozenset(
    {type(None), bool, int, float, str, bytes, bytearray, memoryview}
    | {list, tuple, dict, set, frozenset, object}
)
"""Types whose canonical form cannot be replaced: every other form is built from them."""

_REGISTRY: dict[type, Callable[[Any], Any]] = {}
_DISPATCH: dict[type, _Encoder] = dict(_BUILTIN)
"""Exact type → encoder: the built-ins plus every type resolved so far."""


def _registered(tp: type) -> Callable[[Any], Any] | None:
    if _REGISTRY:
        for base in tp.__mro__:
            fn = _REGISTRY.get(base)
            if fn is not None:
                return fn
    return None


def _resolve_uncached(tp: type) -> _Encoder:
    fn = _registered(tp)
    if fn is not None:
        return _make_converter(fn)
    if tp in _BUILTIN:
        return _BUILTIN[tp]
    if issubclass(tp, type):
        return _enc_refuse
    if issubclass(tp, enum.Enum):
        return _enc_enum
    if dataclasses.is_dataclass(tp):
        return _make_dataclass_encoder(tp)
    if callable(getattr(tp, "model_dump", None)):
        return _enc_model
    if issubclass(tp, int):
        return _make_cast(int, _enc_int)
    if issubclass(tp, float):
        return _make_cast(float, _enc_float)
    if issubclass(tp, str):
        return _make_cast(str.__str__, _enc_str)
    if issubclass(tp, (bytes, bytearray)):
        return _enc_bytes
    for base, encoder in (
        (_dt.datetime, _enc_datetime),
        (_dt.date, _enc_date),
        (_dt.time, _enc_time),
        (Decimal, _enc_decimal),
        (uuid.UUID, _enc_uuid),
        (Mapping, _enc_mapping),
        (list, _enc_sequence),
        (tuple, _enc_sequence),
        (set, _enc_set),
        (frozenset, _enc_set),
    ):
        if issubclass(tp, base):
            return encoder
    return _enc_refuse


def _resolve(tp: type) -> _Encoder:
    encoder = _resolve_uncached(tp)
    if len(_DISPATCH) >= _RESOLVED_CACHE_SIZE:
        _rebuild_dispatch()
    _DISPATCH[tp] = encoder
    return encoder


def _rebuild_dispatch() -> None:
    _DISPATCH.clear()
    _DISPATCH.update((tp, enc) for tp, enc in _BUILTIN.items() if tp not in _REGISTRY)


def register_canonical(type_: type, fn: Callable[[Any], Any]) -> None:
    """Teach taskdedup the canonical form of a type of your own.

    ``fn`` maps an instance to a value taskdedup already understands (a tuple, a dict, a
    str, ...); the instance's identity is the canonical form of that value. It applies to
    ``type_`` and its subclasses (nearest registered class in the MRO wins) and takes
    precedence over the built-in handling, e.g. for a ``str`` subclass. Register before
    tasks are sent, and the same way on callers and workers, or identities will differ.

    Example:
        ``register_canonical(Money, lambda m: (str(m.amount), m.currency))``

    Args:
        type_: the class to register.
        fn: a deterministic function of the instance.

    Raises:
        TypeError: ``type_`` is not a class or ``fn`` is not callable.
        ValueError: ``type_`` is one of the core types (None, bool, int, float, str,
            bytes, list, tuple, dict, set, ...) or ``object``, whose forms every other
            form is built from.
    """
    if not isinstance(type_, type):
        raise TypeError(f"register_canonical() needs a class, got {_typename(type(type_))}")
    if not callable(fn):
        raise TypeError(f"register_canonical() needs a callable, got {_typename(type(fn))}")
    if type_ in _CORE:
        raise ValueError(
            f"cannot register a canonical form for {_typename(type_)}: it is a core type "
            "whose form every other form is built from; register a subclass instead"
        )
    _REGISTRY[type_] = fn
    _rebuild_dispatch()


# --- binding ------------------------------------------------------------------------------

_NORMAL: Final = 0
_VAR_POSITIONAL: Final = 1
_VAR_KEYWORD: Final = 2


class _Binder:
    """A function's signature, prepared once for fast binding and encoding."""

    __slots__ = (
        "defaults",
        "entries",
        "fast",
        "header",
        "keywords",
        "names",
        "positional",
        "qualname",
        "selections",
        "signature",
        "var_keyword",
        "var_positional_offset",
    )

    def __init__(self, func: Callable[..., Any], signature: inspect.Signature) -> None:
        self.signature = signature
        self.qualname: str = getattr(func, "__qualname__", None) or _typename(type(func))
        params = list(signature.parameters.values())
        kinds = inspect.Parameter
        self.names = frozenset(p.name for p in params)
        self.fast = all(p.kind not in (kinds.VAR_POSITIONAL, kinds.VAR_KEYWORD) for p in params)
        self.positional = tuple(
            p.name for p in params if p.kind in (kinds.POSITIONAL_ONLY, kinds.POSITIONAL_OR_KEYWORD)
        )
        self.keywords = frozenset(
            p.name for p in params if p.kind in (kinds.POSITIONAL_OR_KEYWORD, kinds.KEYWORD_ONLY)
        )
        self.defaults = tuple(
            (p.name, p.default) for p in params if p.default is not inspect.Parameter.empty
        )
        self.var_positional_offset = len(self.positional)
        self.var_keyword: str | None = None
        entries: list[tuple[bytes, str, int]] = []
        for p in params:
            if p.kind is kinds.VAR_POSITIONAL:
                kind = _VAR_POSITIONAL
            elif p.kind is kinds.VAR_KEYWORD:
                kind = _VAR_KEYWORD
                self.var_keyword = p.name
            else:
                kind = _NORMAL
            entries.append((_str_key(p.name), p.name, kind))
        entries.sort(key=_first)
        self.entries: tuple[tuple[bytes, str, int], ...] = tuple(entries)
        self.header = b"d%x:" % len(entries)
        self.selections: dict[
            tuple[bool, frozenset[str]], tuple[tuple[tuple[bytes, str, int], ...], bytes]
        ] = {}

    def bind(
        self, task: str, args: Sequence[Any], kwargs: Mapping[str, Any] | None
    ) -> dict[str, Any]:
        """Map every parameter to its value, defaults applied, like ``Signature.bind``."""
        if self.fast and len(args) <= len(self.positional):
            bound = dict(zip(self.positional, args, strict=False))
            ok = True
            if kwargs:
                keywords = self.keywords
                for key, value in kwargs.items():
                    if key in bound or key not in keywords:
                        ok = False
                        break
                    bound[key] = value
            if ok:
                if len(bound) < len(self.names):
                    for name, default in self.defaults:
                        if name not in bound:
                            bound[name] = default
                if len(bound) == len(self.names):
                    return bound
        try:
            bound_arguments = self.signature.bind(*args, **(kwargs or {}))
        except TypeError as exc:
            raise TypeError(
                f"cannot fingerprint task {task!r}: its arguments do not match the signature "
                f"of {self.qualname}: {exc}"
            ) from None
        bound_arguments.apply_defaults()
        return dict(bound_arguments.arguments)

    def select(
        self, task: str, names: Collection[str], include: bool
    ) -> tuple[tuple[tuple[bytes, str, int], ...], bytes]:
        """The entries kept by ``include``/``exclude``, validated once per name set."""
        key = (include, frozenset(names))
        cached = self.selections.get(key)
        if cached is not None:
            return cached
        chosen = key[1]
        unknown = chosen - self.names
        if unknown and self.var_keyword is None:
            option = "include" if include else "exclude"
            raise ValueError(
                f"{option} names {', '.join(sorted(map(repr, unknown)))}, which "
                f"{'is not a parameter' if len(unknown) == 1 else 'are not parameters'} "
                f"of {self.qualname} (task {task!r}); fix the {option} list"
            )
        entries: list[tuple[bytes, str, int]] = []
        for entry in self.entries:
            name, kind = entry[1], entry[2]
            if kind == _VAR_KEYWORD and name not in chosen:
                # Names that are not parameters select keys inside **kwargs.
                keep = bool(unknown) if include else True
            else:
                keep = (name in chosen) == include
            if keep:
                entries.append(entry)
        result = (tuple(entries), b"d%x:" % len(entries))
        if len(self.selections) < 64:
            self.selections[key] = result
        return result

    def encode(
        self,
        bound: Mapping[str, Any],
        entries: tuple[tuple[bytes, str, int], ...],
        header: bytes,
        out: list[bytes],
        keyword_filter: tuple[bool, frozenset[str]] | None,
    ) -> None:
        """Append the canonical mapping parameter → value, with argument paths on error."""
        out.append(header)
        if self.fast:
            name = ""
            try:
                for encoded_key, name, _ in entries:
                    value = bound[name]
                    tp = type(value)
                    if tp is str:  # inlined: the most common argument types
                        data = value.encode("utf-8", "surrogatepass")
                        out.append(b"%bs%x:%b" % (encoded_key, len(data), data))
                    elif tp is int:
                        out.append(b"%bi%x;" % (encoded_key, value))
                    else:
                        out.append(encoded_key)
                        (_DISPATCH.get(tp) or _resolve(tp))(value, out, 1)
            except _Refusal as exc:
                raise _as_type_error(exc, f"kwargs[{name!r}]") from None
            return
        for encoded_key, name, kind in entries:
            out.append(encoded_key)
            value = bound[name]
            if kind == _NORMAL:
                try:
                    tp = type(value)
                    (_DISPATCH.get(tp) or _resolve(tp))(value, out, 1)
                except _Refusal as exc:
                    raise _as_type_error(exc, f"kwargs[{name!r}]") from None
            elif kind == _VAR_POSITIONAL:
                out.append(b"l%x:" % len(value))
                for index, item in enumerate(value):
                    try:
                        _encode(item, out, 2)
                    except _Refusal as exc:
                        root = f"args[{self.var_positional_offset + index}]"
                        raise _as_type_error(exc, root) from None
            else:
                if keyword_filter is not None and name not in keyword_filter[1]:
                    include, chosen = keyword_filter
                    value = {k: v for k, v in value.items() if (k in chosen) == include}
                try:
                    _enc_mapping(value, out, 1)
                except _Refusal as exc:
                    raise _as_type_error(exc, "kwargs") from None


_BINDERS: dict[Any, _Binder] = {}


def _binder(func: Callable[..., Any], task: str) -> _Binder:
    try:
        return _BINDERS[func]
    except KeyError:
        cacheable = True
    except TypeError:  # an unhashable callable: works, just not cached
        cacheable = False
    try:
        signature = inspect.signature(func)
    except (TypeError, ValueError) as exc:
        raise ValueError(
            f"cannot fingerprint task {task!r}: cannot read the signature of "
            f"{getattr(func, '__qualname__', None) or _typename(type(func))}: {exc}"
        ) from None
    binder = _Binder(func, signature)
    if cacheable:
        if len(_BINDERS) >= _SIGNATURE_CACHE_SIZE:
            _BINDERS.clear()
        _BINDERS[func] = binder
    return binder


def bind_arguments(
    func: Callable[..., Any], args: Sequence[Any], kwargs: Mapping[str, Any] | None
) -> dict[str, Any]:
    """Bind a call's arguments to ``func``'s parameters, defaults applied.

    This is the mapping :func:`fingerprint` canonicalizes when given ``func``: ``f(42, 5)``,
    ``f(42, amount=5)`` and ``f(user_id=42, amount=5)`` all give
    ``{"user_id": 42, "amount": 5}``. A ``*args`` parameter maps to a tuple and a
    ``**kwargs`` parameter to a dict. The signature is read once per function and cached.

    Returns:
        parameter name → value, in signature order.

    Raises:
        TypeError: the arguments do not fit the signature (wrong arity, unknown keyword).
        ValueError: the signature of ``func`` cannot be read.
    """
    task = getattr(func, "__qualname__", None) or _typename(type(func))
    binder = _binder(func, task)
    bound = binder.bind(task, args, kwargs)
    return {name: bound[name] for name in binder.signature.parameters}


# --- public entry points ------------------------------------------------------------------


def _shorten(segments: list[str]) -> str:
    if len(segments) <= 12:
        return "".join(segments)
    return "".join(segments[:6]) + "…" + "".join(segments[-3:])


def _as_type_error(exc: _Refusal, root: str) -> TypeError:
    """Turn an internal refusal into the public ``TypeError`` naming the argument path."""
    segments = exc.segments[::-1]
    if exc.too_deep:
        containers = exc.containers[::-1]
        seen: dict[int, int] = {}
        for index, container in enumerate(containers):
            earlier = seen.get(id(container))
            if earlier is not None:
                return TypeError(
                    f"cannot fingerprint {root}{_shorten(segments[:index])}: reference cycle — "
                    f"this {_typename(type(container))} is the same object as "
                    f"{root}{_shorten(segments[:earlier])}, which contains it"
                )
            seen[id(container)] = index
        return TypeError(f"cannot fingerprint {root}{_shorten(segments)}: {exc.reason}")
    return TypeError(f"cannot fingerprint {root}{''.join(segments)}: {exc.reason}")


def _recursion_error(what: str) -> TypeError:
    return TypeError(
        f"cannot fingerprint {what}: nested too deeply for the interpreter's recursion limit"
    )


_HEADS: dict[tuple[bytes, str, str | None], bytes] = {}


def _head(prefix: bytes, name: str, scope: str | None) -> bytes:
    """Domain prefix, scope and task name, encoded once per (name, scope) and cached."""
    key = (prefix, name, scope)
    try:
        return _HEADS[key]
    except (KeyError, TypeError):
        pass
    if not isinstance(name, str):
        raise TypeError(f"task name must be a str, not {_typename(type(name))}")
    if scope is not None and not isinstance(scope, str):
        raise TypeError(f"scope must be a str or None, not {_typename(type(scope))}")
    out = [prefix]
    if scope:
        _enc_str(str.__str__(scope), out, 0)
    else:
        out.append(b"N")
    _enc_str(str.__str__(name), out, 0)
    _end(out)  # a long name or scope was remembered
    head = b"".join(out)
    if len(_HEADS) >= _SIGNATURE_CACHE_SIZE:
        _HEADS.clear()
    _HEADS[key] = head
    return head


def _names(option: str, names: Collection[str]) -> frozenset[str]:
    if isinstance(names, (str, bytes)):
        raise TypeError(
            f"{option} must be a collection of argument names, not a single string: "
            f"write {option}=[{names!r}]"
        )
    return frozenset(names)


def fingerprint(
    name: str,
    args: Sequence[Any] = (),
    kwargs: Mapping[str, Any] | None = None,
    *,
    func: Callable[..., Any] | None = None,
    include: Collection[str] | None = None,
    exclude: Collection[str] | None = None,
    scope: str | None = None,
) -> str:
    """The identity of one task call: 32 lowercase hex characters.

    Equal calls give equal identities, on the caller and on the worker after any kombu
    serializer or RQ's pickle (see the module docstring for the canonical forms).

    With ``func`` (the task's function) the arguments are first bound to its signature
    with defaults applied, so ``f(42, 5)``, ``f(42, amount=5)``, ``f(user_id=42, amount=5)``
    and ``f(42)`` (when ``amount`` defaults to 5) are one identity. Without ``func`` the
    identity is that of the pair (positional arguments, keyword arguments).

    ``include``/``exclude`` choose which arguments count. With ``func`` they name
    parameters (a name that is not a parameter is a configuration error, unless ``func``
    takes ``**kwargs``, whose keys it then selects). Without ``func`` they apply to keyword
    arguments only: positional arguments always count.

    Args:
        name: the task name (part of the identity).
        args: positional arguments of the call.
        kwargs: keyword arguments of the call.
        func: the task's function, to bind the arguments to its signature.
        include: only these arguments count.
        exclude: these arguments do not count.
        scope: an optional namespace (tenant, environment) that is part of the identity.

    Raises:
        TypeError: an argument has no canonical form (the message names its path, e.g.
            ``kwargs['order'].items[3]``, and its type, never its value), or the arguments
            do not match ``func``'s signature.
        ValueError: both ``include`` and ``exclude`` given, or one names a parameter that
            ``func`` does not have.
    """
    out = [_head(_ARGS_PREFIX, name, scope)]
    if args is None:  # tolerated like kwargs=None: Celery's apply_async(args=None)
        args = ()
    selected: frozenset[str] | None = None
    if include is not None:
        if exclude is not None:
            raise ValueError("include and exclude are mutually exclusive: pass one of them")
        selected = _names("include", include)
    elif exclude is not None:
        selected = _names("exclude", exclude)

    try:
        if func is not None:
            try:
                binder = _BINDERS[func]
            except (KeyError, TypeError):
                binder = _binder(func, name)
            bound = binder.bind(name, args, kwargs)
            out.append(b"B")
            if selected is None:
                binder.encode(bound, binder.entries, binder.header, out, None)
            else:
                entries, header = binder.select(name, selected, include is not None)
                keyword_filter = (include is not None, selected)
                binder.encode(bound, entries, header, out, keyword_filter)
        else:
            out.append(b"P")
            try:
                _enc_sequence(args, out, 0)
            except _Refusal as exc:
                raise _as_type_error(exc, "args") from None
            if kwargs is None:
                kwargs = {}
            elif selected is not None:
                keep = include is not None
                kwargs = {k: v for k, v in kwargs.items() if (k in selected) == keep}
            try:
                _enc_mapping(kwargs, out, 0)
            except _Refusal as exc:
                raise _as_type_error(exc, "kwargs") from None
    except RecursionError:
        raise _recursion_error(repr(name)) from None
    finally:
        if _WALKS:
            _end(out)
    return _sha256(b"".join(out)).hexdigest()[:32]


def fingerprint_value(name: str, value: Any, *, scope: str | None = None) -> str:
    """The identity given by an explicit value instead of the arguments.

    Used for a per-call idempotency key (``dedup_key="ORD-789"``) or the result of a
    user ``key=`` function. Its domain prefix differs from :func:`fingerprint`'s, so such
    an identity never equals an argument digest; the form is the same 32 hex characters.

    Args:
        name: the task name (part of the identity).
        value: any value with a canonical form, usually a str.
        scope: an optional namespace that is part of the identity.

    Raises:
        TypeError: ``value`` has no canonical form (the message names the path).
    """
    out = [_head(_VALUE_PREFIX, name, scope)]
    try:
        _encode(value, out, 0)
    except _Refusal as exc:
        raise _as_type_error(exc, "value") from None
    except RecursionError:
        raise _recursion_error(repr(name)) from None
    finally:
        if _WALKS:
            _end(out)
    return _sha256(b"".join(out)).hexdigest()[:32]


def canonical_bytes(value: Any) -> bytes:
    """The canonical encoding of one value, as described in the module docstring.

    Two values have the same encoding exactly when they are the same identity (``1.0``
    and ``1``, a tuple and the equal list, ...). Useful to check a registered form.

    Raises:
        TypeError: ``value`` has no canonical form (the message names the path).
    """
    out: list[bytes] = []
    try:
        _encode(value, out, 0)
    except _Refusal as exc:
        raise _as_type_error(exc, "value") from None
    except RecursionError:
        raise _recursion_error("a value") from None
    finally:
        if _WALKS:
            _end(out)
    return b"".join(out)
