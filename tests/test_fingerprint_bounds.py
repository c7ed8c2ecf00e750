"""``fingerprint`` does bounded work on hostile input (SPEC §8 "Input is not trusted").

A message can share one sub-object many times — YAML anchors and aliases, pickle's memo,
``[a, a]`` — so that a few kilobytes on the wire expand into billions of nodes. Each shared
object is encoded once per call and its bytes repeated; the repetition is capped by
:data:`taskdedup.identity.MAX_SHARED_BYTES`, past which ``TypeError`` names the argument path.
Every identity below the cap is the one computed before (sharing never changes a digest).

The hostile inputs run in a fresh interpreter with a memory cap and a deadline, so a
regression fails the test instead of hanging or exhausting the machine.
"""

from __future__ import annotations

import copy
import dataclasses
import enum
import resource
import subprocess
import sys
import textwrap
import threading
import time
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from taskdedup import fingerprint
from taskdedup.identity import MAX_DEPTH, canonical_bytes, fingerprint_value, register_canonical
from tests.workers import ROOT

identity = sys.modules["taskdedup.identity"]


def anchor_bomb(levels: int = 12, width: int = 9) -> str:
    """YAML whose every level repeats the previous one ``width`` times by alias."""
    lines = ["a0: &a0 [" + ", ".join(["1"] * width) + "]"]
    for level in range(1, levels):
        lines.append(f"a{level}: &a{level} [" + ", ".join([f"*a{level - 1}"] * width) + "]")
    return "\n".join(lines) + "\n"


def shared_tower(levels: int, width: int = 9, kind: type = list) -> Any:
    """The object graph of :func:`anchor_bomb`: one list per level, shared ``width`` times."""
    value: Any = kind([1] * width)
    for _ in range(levels):
        value = kind([value] * width)
    return value


# --- hostile inputs, in a fresh interpreter ---------------------------------------------------

PRELUDE = """
import dataclasses, pickle, time
from kombu.serialization import loads
from taskdedup import fingerprint
from tests.test_fingerprint_bounds import Frozen, anchor_bomb, set_tower, shared_tower

def report(make):
    value = make()
    start = time.perf_counter()
    try:
        digest = fingerprint("tasks.hostile", (value,))
    except TypeError as exc:
        print("TypeError:", exc)
    else:
        print("digest:", digest)
    print("seconds:", round(time.perf_counter() - start, 3))
"""

HOSTILE = {
    "yaml-anchors": "loads(anchor_bomb().encode(), 'application/x-yaml', 'utf-8', "
                    "accept={'application/x-yaml'})",
    "pickle-graph": "pickle.loads(pickle.dumps(shared_tower(11)))",
    "dataclasses": "pickle.loads(pickle.dumps(Frozen.tower(30)))",
    "frozensets": "set_tower(12)",
    "dict-values": "[{'k': v} for v in [shared_tower(10)] * 9]",
    "long-string": "['x' * 65536] * 20000",
    "long-string-keys": "(lambda k: [{k: n} for n in range(20000)])('x' * 65536)",
    "long-bytes": "[b'x' * 65536] * 20000",
    "long-int": "[16 ** 4000] * 400000",
}


def set_tower(levels: int) -> Any:
    """Frozensets of tuples, each level holding the previous one 9 times (frozensets cache
    their hash, so building it is cheap; encoding it naively is not)."""
    value: Any = frozenset(range(9))
    for _ in range(levels):
        value = frozenset((value, n) for n in range(9))
    return value


@dataclasses.dataclass(frozen=True)
class Frozen:
    left: Any
    right: Any

    @classmethod
    def tower(cls, levels: int) -> Any:
        value: Any = 1
        for _ in range(levels):
            value = cls(value, value)
        return value


def run_capped(body: str, timeout: float = 60.0) -> tuple[str, float]:
    """Run ``body`` in a fresh interpreter limited to 1.5 GiB; its output and wall time."""
    cap = 3 * 2**29

    def limit() -> None:
        resource.setrlimit(resource.RLIMIT_AS, (cap, cap))

    start = time.monotonic()
    done = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(PRELUDE) + body], cwd=ROOT, capture_output=True,
        text=True, timeout=timeout, preexec_fn=limit, check=False,
    )
    elapsed = time.monotonic() - start
    assert done.returncode == 0, done.stderr[-2000:]
    return done.stdout, elapsed


@pytest.mark.parametrize("make", HOSTILE.values(), ids=HOSTILE.keys())
def test_shared_sub_objects_never_expand_without_bound(make: str) -> None:
    out, elapsed = run_capped(f"report(lambda: {make})\n")
    assert out.startswith("TypeError: cannot fingerprint args[0]"), out
    assert "MAX_SHARED_BYTES" in out and "shared" in out
    seconds = float(out.rsplit("seconds:", 1)[1])
    assert seconds < 5, out  # the call itself; the interpreter's start is not counted
    assert elapsed < 30


def test_a_4kb_anchor_bomb_is_small_on_the_wire() -> None:
    assert len(anchor_bomb()) < 4096 < len(anchor_bomb(levels=70))


# --- the budget, in this process --------------------------------------------------------------


def test_past_the_budget_the_error_names_the_path(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(identity, "MAX_SHARED_BYTES", 1000)
    row = list(range(100))  # 394 bytes of canonical form: the 4th copy is past 1000
    with pytest.raises(TypeError) as info:
        fingerprint("t", (), {"rows": [row] * 10})
    message = str(info.value)
    assert message.startswith("cannot fingerprint kwargs['rows'][3]: "), message
    assert "MAX_SHARED_BYTES" in message and "1000" in message
    # the same value without sharing is only its own size: accepted
    assert fingerprint("t", (), {"rows": [list(row) for _ in range(10)]})


def test_the_budget_is_per_call(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(identity, "MAX_SHARED_BYTES", 1000)
    row = list(range(50))
    for _ in range(20):
        fingerprint("t", ([row, row],))


def test_a_shared_tower_under_the_budget_keeps_its_identity() -> None:
    shared = shared_tower(5)  # 9**6 leaves, ~1.6 MB of canonical form
    assert fingerprint("t", (shared,)) == fingerprint("t", (unshare(shared),))


# --- sharing never changes an identity --------------------------------------------------------


class Shade(enum.Enum):
    PAIR = (1, (2, 3))


class Box:
    def __init__(self, inner: Any) -> None:
        self.inner = inner


@dataclasses.dataclass
class Pair:
    left: Any
    right: Any


def unshare(value: Any) -> Any:
    """An equal value in which no object appears twice (``copy.deepcopy`` keeps sharing)."""
    if isinstance(value, enum.Enum):
        return value
    if isinstance(value, list):
        return [unshare(v) for v in value]
    if isinstance(value, tuple):
        return tuple(unshare(v) for v in value)
    if isinstance(value, (set, frozenset)):
        return type(value)(unshare(v) for v in value)
    if isinstance(value, dict):
        return {unshare(k): unshare(v) for k, v in value.items()}
    if isinstance(value, Pair):
        return Pair(unshare(value.left), unshare(value.right))
    if isinstance(value, Box):
        return Box(unshare(value.inner))
    if isinstance(value, str):
        return "".join(list(value))
    if isinstance(value, (bytes, bytearray)):
        return type(value)(bytearray(value))
    if type(value) is int:
        return int(str(value))
    return copy.copy(value)


LONG = "é" * 5000
LONG_BYTES = b"\x00" * 5000
LONG_INT = 7**3000


def shapes() -> list[Any]:
    small = [1, "a", 2.5]
    tup = (1, (2, "b"))
    box = Box([1, 2])
    pair = Pair([LONG], {"k": small})
    return [
        [small, small, [small]],
        {"a": small, "b": {"c": small}, "d": (small, small)},
        {tup: tup, "x": tup, (tup, 1): [tup]},
        {frozenset({tup, 1}), tup},
        [pair, pair, Pair(pair, pair)],
        [box, box, {"b": box}],
        [Shade.PAIR, Shade.PAIR.value, Shade.PAIR],
        [LONG, LONG, {LONG: LONG}, (LONG,)],
        [LONG_BYTES, LONG_BYTES, bytearray(LONG_BYTES)],
        [LONG_INT, LONG_INT, {LONG_INT: -LONG_INT}],
        {1: small, "1": small, 1.0 + 0.5: small},
        [[], [], (), (), {}, {}],
    ]


@pytest.fixture
def box_registered() -> Any:
    saved = dict(identity._REGISTRY)
    register_canonical(Box, lambda b: ("box", b.inner))
    yield
    identity._REGISTRY.clear()
    identity._REGISTRY.update(saved)
    identity._rebuild_dispatch()


@pytest.mark.usefixtures("box_registered")
@pytest.mark.parametrize("index", range(len(shapes())))
def test_a_shared_value_has_the_identity_of_its_copy(index: int) -> None:
    shared = shapes()[index]
    assert canonical_bytes(shared) == canonical_bytes(unshare(shared))
    assert fingerprint("t", (shared, shared), {"k": shared}) == fingerprint(
        "t", (unshare(shared), unshare(shared)), {"k": unshare(shared)}
    )


def nested(height: int) -> Any:
    value: Any = "leaf"
    for _ in range(height):
        value = [value]
    return value


@pytest.mark.parametrize("deep_first", [False, True])
def test_the_depth_limit_does_not_depend_on_sharing(deep_first: bool) -> None:
    """An object accepted near the top is still refused where it sits too deep."""
    x = nested(MAX_DEPTH - 3)
    fingerprint_value("t", [x, x])  # shallow: fine

    def arrange(a: Any, b: Any) -> list[Any]:
        deep = nested(5)
        deep[0][0][0][0][0] = b
        return [deep, a] if deep_first else [a, deep]

    for value in (arrange(x, x), arrange(x, unshare(x))):
        with pytest.raises(TypeError, match=f"nested deeper than {MAX_DEPTH} levels"):
            fingerprint_value("t", value)


def test_cycles_through_shared_objects_are_still_refused() -> None:
    shared = [1, 2]
    loop: list[Any] = [shared, shared]
    loop.append(loop)
    with pytest.raises(TypeError, match=r"kwargs\['x'\]\[2\]: reference cycle"):
        fingerprint("t", (), {"x": loop})


jsonish = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=5),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=3), inner,
                                                                 max_size=3),
    max_leaves=12,
)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(value=jsonish, other=jsonish)
def test_sharing_never_changes_an_identity(value: Any, other: Any) -> None:
    shared = [value, other, value, {"v": value, "o": [other, value]}]
    assert fingerprint("t", (shared,)) == fingerprint("t", (unshare(shared),))


def test_no_call_leaves_its_memory_behind(monkeypatch: pytest.MonkeyPatch) -> None:
    """The per-call memory of shared objects is dropped when the call ends, however it ends."""
    shared = [LONG, {"a": [1, 2]}, frozenset({(1, 2)})]
    fingerprint("t", ([shared, shared],), {"k": {(1,): shared}})
    fingerprint_value("t", [shared, shared])
    canonical_bytes([shared, shared])
    with pytest.raises(TypeError):
        fingerprint("t", ([shared, object()],))
    monkeypatch.setattr(identity, "MAX_SHARED_BYTES", 10)
    with pytest.raises(TypeError, match="MAX_SHARED_BYTES"):
        fingerprint("t", ([shared, shared],))
    assert identity._WALKS == {}


def test_threads_never_see_each_others_memory() -> None:
    """Each call's memory is its own: calls on shared values from many threads agree."""
    values = [shapes()[index] for index in (0, 1, 2, 3, 7, 9)]
    expected = [fingerprint("t", (v, v)) for v in values]
    failures: list[str] = []

    def hammer() -> None:
        for _ in range(100):
            for v, want in zip(values, expected, strict=True):
                if fingerprint("t", (v, v)) != want:
                    failures.append("differs")

    threads = [threading.Thread(target=hammer) for _ in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert not failures and not any(t.is_alive() for t in threads)
    assert identity._WALKS == {}
