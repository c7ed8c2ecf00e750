"""The identity survives the broker: caller digest == worker digest after each serializer.

Celery sends a task as the body ``(args, kwargs, embed)`` through one of kombu's serializers
(json, msgpack, yaml, pickle); RQ pickles ``(func_name, instance, args, kwargs)``. For each
serializer we generate only the values it can carry (its own limits, not taskdedup's), send
them through it, and check that the fingerprint computed from the decoded arguments equals
the one computed from the originals, with and without binding to a task function.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime as dt
import enum
import importlib
import typing
import uuid
from collections.abc import Callable, Iterator
from decimal import Decimal
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from kombu.serialization import dumps as kombu_dumps
from kombu.serialization import loads as kombu_loads
from rq.serializers import DefaultSerializer, JSONSerializer

from taskdedup.identity import fingerprint, register_canonical

fpmod = importlib.import_module("taskdedup.identity")

NAME = "tasks.roundtrip"
EMBED = {"callbacks": None, "errbacks": None, "chain": None, "chord": None}
SETTINGS = settings(
    max_examples=80,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
)


def task(a: Any = None, b: Any = None, *rest: Any, **extra: Any) -> None:
    """The task function the worker would bind the decoded arguments to."""


# --- module-level types, so pickle can carry them -------------------------------------------


class Level(enum.IntEnum):
    LOW = 1
    HIGH = 2


class Mode(enum.StrEnum):
    FAST = "fast"
    SAFE = "safe"


class Color(enum.Enum):
    RED = "red"
    PAIR = (1, 2)
    NOTHING = None


class Point(typing.NamedTuple):
    x: int
    y: Any


@dataclasses.dataclass
class Item:
    sku: str
    qty: int = 1
    tags: list[str] = dataclasses.field(default_factory=list)


@dataclasses.dataclass(frozen=True)
class Key:
    kind: str
    number: int


class Money:
    def __init__(self, amount: Decimal, currency: str) -> None:
        self.amount = amount
        self.currency = currency


try:
    import pydantic

    class Customer(pydantic.BaseModel):
        id: int
        email: str
        since: dt.date
        tags: list[str] = []

    customers: st.SearchStrategy[Any] = st.builds(
        Customer,
        id=st.integers(),
        email=st.text(max_size=8),
        since=st.dates(),
        tags=st.lists(st.text(max_size=3), max_size=2),
    )
except ImportError:  # pydantic is optional
    customers = st.nothing()


@contextlib.contextmanager
def money_registered() -> Iterator[None]:
    saved = dict(fpmod._REGISTRY)
    register_canonical(Money, lambda m: (m.amount, m.currency))
    try:
        yield
    finally:
        fpmod._REGISTRY.clear()
        fpmod._REGISTRY.update(saved)
        fpmod._rebuild_dispatch()


# --- carriers -------------------------------------------------------------------------------


def kombu_carrier(serializer: str) -> Callable[[Any], Any]:
    def carry(body: Any) -> Any:
        content_type, encoding, payload = kombu_dumps(body, serializer=serializer)
        if isinstance(payload, str):  # on the wire it is bytes
            payload = payload.encode(encoding)
        return kombu_loads(payload, content_type, encoding, accept={content_type})

    return carry


def celery_trip(serializer: str, args: list[Any], kwargs: dict[str, Any]) -> None:
    """Send args/kwargs as Celery does and compare the identities on both sides."""
    carry = kombu_carrier(serializer)
    sent_args = tuple(args)
    received_args, received_kwargs, embed = carry((sent_args, kwargs, EMBED))
    assert embed == EMBED
    assert fingerprint(NAME, received_args, received_kwargs) == fingerprint(NAME, sent_args, kwargs)
    assert fingerprint(NAME, received_args, received_kwargs, func=task) == fingerprint(
        NAME, sent_args, kwargs, func=task
    )


def rq_trip(serializer: Any, args: list[Any], kwargs: dict[str, Any]) -> None:
    """Send args/kwargs as RQ stores a job (func name, instance, args, kwargs)."""
    data = serializer.dumps(("tests.test_fingerprint_roundtrip.task", None, args, kwargs))
    _, _, received_args, received_kwargs = serializer.loads(data)
    assert fingerprint(NAME, received_args, received_kwargs) == fingerprint(NAME, args, kwargs)
    assert fingerprint(NAME, received_args, received_kwargs, func=task) == fingerprint(
        NAME, args, kwargs, func=task
    )


# --- strategies -----------------------------------------------------------------------------

finite_or_infinite = st.floats(allow_nan=False)
text = st.text(max_size=8)
# JSON escapes lone surrogates (\ud800), so kombu's json carries them; UTF-8 based
# serializers (msgpack, yaml) cannot encode them, so those get the default text.
text_with_surrogates = st.text(
    st.characters(min_codepoint=0xD800, max_codepoint=0xDFFF) | st.characters(), max_size=8
)
# UTC offsets: whole seconds (as every real time zone has, LMT included) for the text
# serializers, since Python 3.11's fromisoformat() drops the microseconds of an offset like
# "+00:00:00.000001"; pickle also gets sub-second offsets.
second_offsets = st.builds(
    dt.timezone,
    st.integers(-(24 * 3600 - 1), 24 * 3600 - 1).map(lambda s: dt.timedelta(seconds=s)),
)
subsecond_offsets = st.builds(
    dt.timezone,
    st.timedeltas(min_value=dt.timedelta(hours=-23, minutes=-59), max_value=dt.timedelta(hours=23)),
)
minute_offsets = st.builds(
    dt.timezone,
    st.integers(-23 * 60 - 59, 23 * 60 + 59).map(lambda m: dt.timedelta(minutes=m)),
)
any_timezone = second_offsets | st.timezones()
enum_members = st.sampled_from([*Level, *Mode])


def kwargs_of(values: st.SearchStrategy[Any]) -> st.SearchStrategy[dict[str, Any]]:
    # "k_" keeps the names clear of the task's own parameters (a, b).
    return st.dictionaries(text.map(lambda s: "k_" + s), values, max_size=3)


def containers(
    scalars: st.SearchStrategy[Any], keys: st.SearchStrategy[Any], *, unique_spelling: bool
) -> st.SearchStrategy[Any]:
    def extend(inner: st.SearchStrategy[Any]) -> st.SearchStrategy[Any]:
        maps = st.dictionaries(keys, inner, max_size=3)
        if unique_spelling:
            maps = maps.filter(lambda d: len({json_spelling(k) for k in d}) == len(d))
        return st.lists(inner, max_size=3) | st.lists(inner, max_size=3).map(tuple) | maps

    return st.recursive(scalars, extend, max_leaves=10)


def json_spelling(key: Any) -> str:
    """How JSON writes a dict key: two keys spelled alike collapse into one on the wire."""
    if key is True:
        return "true"
    if key is False:
        return "false"
    if key is None:
        return "null"
    return str(key)


# kombu 5.7 json (kombu/utils/json.py): JSON types, plus bytes, datetime, date, time,
# Decimal and UUID as {"__type__", "__value__"} envelopes. Tuples and NamedTuples arrive as
# lists, int/bool/None keys as strings, IntEnum/StrEnum as their values.
# Excluded: sets/frozensets, plain Enums and dataclasses (kombu's json cannot encode them),
# float dict keys (JSON writes 1.0 as "1.0", while 1.0 is the int 1 everywhere else),
# bytearray (kombu's json only encodes bytes), aware datetimes/times whose UTC offset has
# a fraction of a second (Python 3.11's fromisoformat() drops it: a different instant).
json_scalars = (
    st.none()
    | st.booleans()
    | st.integers()
    | finite_or_infinite
    | text_with_surrogates
    | st.binary(max_size=8)
    | st.datetimes()
    | st.datetimes(timezones=any_timezone)
    | st.dates()
    | st.times()
    | st.times(timezones=any_timezone)
    | st.decimals(allow_nan=False)
    | st.uuids()
    | enum_members
    | st.builds(Point, st.integers(), text)
)
json_values = containers(
    json_scalars, text | st.integers() | st.booleans() | st.none(), unique_spelling=True
)

# kombu's msgpack: packb(use_bin_type=True) / unpackb(raw=False).
# Excluded: ints outside [-2**63, 2**64) (msgpack's range), datetimes/dates/times (kombu
# does not turn on msgpack's timestamp extension), Decimal, UUID, sets, plain Enums,
# dataclasses (no encoder), non-str dict keys (unpackb's strict_map_key refuses them), lone
# surrogates (msgpack strings are UTF-8).
msgpack_scalars = (
    st.none()
    | st.booleans()
    | st.integers(-(2**63), 2**64 - 1)
    | finite_or_infinite
    | text
    | st.binary(max_size=8)
    | enum_members
    | st.builds(Point, st.integers(-(2**63), 2**63 - 1), text)
)
msgpack_values = containers(msgpack_scalars, text, unique_spelling=False)

# kombu's yaml: yaml.safe_dump / yaml.safe_load. YAML keeps int, bool, None and float keys
# as such, and carries sets (!!set), bytes (!!binary), naive datetimes and dates.
# Excluded: aware datetimes whose UTC offset is not whole minutes (PyYAML's timestamp
# resolver only reads +HH:MM and fails on the seconds datetime.isoformat() writes),
# time, Decimal, UUID, Enums, NamedTuples, frozensets, dataclasses (safe_dump cannot
# represent them), tuple keys and set members (safe_load cannot build them), lone
# surrogates (not encodable).
yaml_scalars = (
    st.none()
    | st.booleans()
    | st.integers()
    | finite_or_infinite
    | text
    | st.binary(max_size=8)
    | st.datetimes()
    | st.datetimes(timezones=minute_offsets)
    | st.dates()
)
yaml_hashables = st.none() | st.booleans() | st.integers() | finite_or_infinite | text
yaml_values = containers(
    yaml_scalars | st.sets(yaml_hashables, max_size=3), yaml_hashables, unique_spelling=False
)

# pickle (kombu's and RQ's): everything taskdedup has a canonical form for, as long as the
# classes are importable (module level).
hashable_scalars = (
    st.none()
    | st.booleans()
    | st.integers()
    | finite_or_infinite
    | text_with_surrogates
    | st.binary(max_size=4)
    | st.dates()
    | st.decimals(allow_nan=False)
    | st.uuids()
)
pickle_scalars = (
    json_scalars
    | st.sampled_from(list(Color))
    | st.binary(max_size=8).map(bytearray)
    | st.datetimes(timezones=subsecond_offsets)
    | st.times(timezones=subsecond_offsets)
    | st.sets(hashable_scalars, max_size=3)
    | st.frozensets(hashable_scalars, max_size=3)
    | st.builds(Key, text, st.integers())
    | st.builds(Item, text, st.integers(), st.lists(text, max_size=2))
    | st.builds(Money, st.decimals(allow_nan=False), text)
    | customers
)
pickle_values = containers(
    pickle_scalars,
    hashable_scalars | st.tuples(st.integers(), text) | st.builds(Key, text, st.integers()),
    unique_spelling=False,
)

# RQ's JSONSerializer: plain json.dumps/json.loads, no extension types.
# Excluded: bytes, datetimes, Decimal, UUID, sets, Enums other than IntEnum/StrEnum,
# dataclasses (json cannot encode them), float keys (see kombu json).
plain_json_scalars = (
    st.none() | st.booleans() | st.integers() | finite_or_infinite | text_with_surrogates
)
plain_json_values = containers(
    plain_json_scalars | enum_members,
    text | st.integers() | st.booleans() | st.none(),
    unique_spelling=True,
)


# --- properties -----------------------------------------------------------------------------


@SETTINGS
@given(args=st.lists(json_values, max_size=3), kwargs=kwargs_of(json_values))
def test_kombu_json(args: list[Any], kwargs: dict[str, Any]) -> None:
    celery_trip("json", args, kwargs)


@SETTINGS
@given(args=st.lists(msgpack_values, max_size=3), kwargs=kwargs_of(msgpack_values))
def test_kombu_msgpack(args: list[Any], kwargs: dict[str, Any]) -> None:
    celery_trip("msgpack", args, kwargs)


@SETTINGS
@given(args=st.lists(yaml_values, max_size=3), kwargs=kwargs_of(yaml_values))
def test_kombu_yaml(args: list[Any], kwargs: dict[str, Any]) -> None:
    celery_trip("yaml", args, kwargs)


@SETTINGS
@given(args=st.lists(pickle_values, max_size=3), kwargs=kwargs_of(pickle_values))
def test_kombu_pickle(args: list[Any], kwargs: dict[str, Any]) -> None:
    with money_registered():
        celery_trip("pickle", args, kwargs)


@SETTINGS
@given(args=st.lists(pickle_values, max_size=3), kwargs=kwargs_of(pickle_values))
def test_rq_pickle(args: list[Any], kwargs: dict[str, Any]) -> None:
    with money_registered():
        rq_trip(DefaultSerializer, args, kwargs)


@SETTINGS
@given(args=st.lists(plain_json_values, max_size=3), kwargs=kwargs_of(plain_json_values))
def test_rq_json(args: list[Any], kwargs: dict[str, Any]) -> None:
    rq_trip(JSONSerializer, args, kwargs)


# --- the classic breakages, spelled out -----------------------------------------------------

AWARE = dt.datetime(2024, 3, 1, 13, 0, tzinfo=dt.timezone(dt.timedelta(hours=1)))


@pytest.mark.parametrize(
    ("serializer", "args", "kwargs"),
    [
        # celery-once's bug: a tuple comes back as a list
        ("json", [(1, 2), Point(3, 4)], {"k_t": ((5,), [6])}),
        ("msgpack", [(1, 2), Point(3, 4)], {"k_t": ((5,), [6])}),
        ("yaml", [(1, 2)], {"k_t": ((5,), [6])}),
        # int, None and bool keys come back as strings from JSON
        ("json", [{1: "a", None: "b", False: "c"}], {"k_m": {2: [1.0]}}),
        # 1.0 stays 1.0 through json, but must equal 1 anyway
        ("json", [1.0, -0.0, 1e20], {"k_f": 2.5}),
        # extension types of kombu's json
        ("json", [AWARE, dt.date(2024, 1, 1), dt.time(10, 0), Decimal("1.10")], {}),
        ("json", [b"\x00\xff", b"text"], {"k_u": uuid.UUID(int=7)}),
        # YAML's own types
        ("yaml", [{1, 2, 3}, b"\x00", dt.datetime(2024, 1, 1), AWARE], {"k_m": {1: None}}),
        ("pickle", [{1, 2}, frozenset({"a"}), Color.PAIR, Item("a")], {"k_d": Decimal("1.0")}),
    ],
)
def test_known_cases(serializer: str, args: list[Any], kwargs: dict[str, Any]) -> None:
    celery_trip(serializer, args, kwargs)
