"""Unit tests of taskdedup.policy: defaults, validation at construction, coercion, modes and
the global switch. Every refusal must be a ConfigurationError (also a ValueError) whose
message names the field and says what to change."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterator
from datetime import timedelta
from typing import Any

import pytest

import taskdedup
from taskdedup import ConfigurationError, Mode, OnDuplicate, OnStoreError, Policy, TaskDedupError
from taskdedup.policy import MAX_DURATION_MS


@pytest.fixture(autouse=True)
def _gating_enabled(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Every test starts and ends with gating on and no TASKDEDUP_DISABLED in the env."""
    monkeypatch.delenv("TASKDEDUP_DISABLED", raising=False)
    taskdedup.enable()
    yield
    taskdedup.enable()


# -- defaults ------------------------------------------------------------------------------


def test_defaults_match_the_spec() -> None:
    p = Policy()
    assert p.mode is Mode.UNTIL_EXPIRED
    assert p.ttl == 600.0
    assert p.lease == 60.0
    assert p.include is None
    assert p.exclude is None
    assert p.key is None
    assert p.scope is None
    assert p.on_duplicate is OnDuplicate.RETURN
    assert p.on_store_error is OnStoreError.RAISE


def test_strings_are_converted_to_enums() -> None:
    p = Policy(mode="until_executed", on_duplicate="raise", on_store_error="allow")
    assert p.mode is Mode.UNTIL_EXECUTED
    assert p.on_duplicate is OnDuplicate.RAISE
    assert p.on_store_error is OnStoreError.ALLOW


def test_enum_members_are_accepted() -> None:
    p = Policy(mode=Mode.WHILE_EXECUTING, on_store_error=OnStoreError.ALLOW)
    assert p.mode is Mode.WHILE_EXECUTING
    assert p.on_store_error is OnStoreError.ALLOW


def test_policy_is_immutable() -> None:
    p = Policy()
    with pytest.raises(dataclasses.FrozenInstanceError):
        p.ttl = 5  # type: ignore[misc]


def test_include_and_exclude_become_frozensets_and_a_str_is_one_name() -> None:
    assert Policy(include=["a", "b", "a"]).include == frozenset({"a", "b"})
    assert Policy(exclude=("x",)).exclude == frozenset({"x"})
    assert Policy(include="user_id").include == frozenset({"user_id"})


def test_empty_scope_means_no_scope() -> None:
    assert Policy(scope="").scope is None
    assert Policy(scope="tenant-1").scope == "tenant-1"


# -- durations -----------------------------------------------------------------------------


def test_timedelta_is_accepted_for_ttl_and_lease() -> None:
    p = Policy(ttl=timedelta(minutes=2), lease=timedelta(milliseconds=1500))
    assert p.ttl == 120.0
    assert p.lease == 1.5
    assert p == Policy(ttl=120, lease=1.5)


def test_int_and_float_seconds_are_accepted() -> None:
    p = Policy(ttl=10, lease=0.25)
    assert p.ttl == 10.0 and isinstance(p.ttl, float)
    assert p.lease == 0.25


def test_ttl_ms_and_lease_ms_are_integer_milliseconds() -> None:
    p = Policy(ttl=1.5, lease=timedelta(seconds=30))
    assert p.ttl_ms == 1500 and isinstance(p.ttl_ms, int)
    assert p.lease_ms == 30_000 and isinstance(p.lease_ms, int)


def test_ttl_ms_and_lease_ms_never_round_down_to_zero() -> None:
    p = Policy(ttl=0.0001, lease=0.0004)
    assert p.ttl_ms == 1
    assert p.lease_ms == 1


@pytest.mark.parametrize("field", ["ttl", "lease"])
@pytest.mark.parametrize(
    "value", [0, 0.0, -1, -0.5, timedelta(0), timedelta(seconds=-3)], ids=repr
)
def test_non_positive_duration_is_refused(field: str, value: Any) -> None:
    with pytest.raises(ConfigurationError, match=rf"Policy\.{field} must be a positive, finite"):
        Policy(**{field: value})


@pytest.mark.parametrize("field", ["ttl", "lease"])
@pytest.mark.parametrize("value", [math.nan, math.inf, -math.inf], ids=repr)
def test_nan_and_infinite_duration_is_refused(field: str, value: float) -> None:
    with pytest.raises(ConfigurationError, match=rf"Policy\.{field} must be a positive, finite"):
        Policy(**{field: value})


@pytest.mark.parametrize("field", ["ttl", "lease"])
@pytest.mark.parametrize(
    "value",
    [1e17, 2**63, 10**400, 1e300, timedelta.max, MAX_DURATION_MS / 1000 + 1, 3.2e9],
    ids=repr,
)
def test_duration_redis_cannot_store_is_refused(field: str, value: Any) -> None:
    """Redis refuses a PX/PEXPIRE that overflows once added to the clock (and a countdown):
    such a policy would fail every reservation ("store unavailable", forever)."""
    with pytest.raises(ConfigurationError) as info:
        Policy(**{field: value})
    message = str(info.value)
    assert f"Policy.{field}" in message and "at most" in message and "100 years" in message


@pytest.mark.parametrize("field", ["ttl", "lease"])
def test_duration_up_to_the_cap_is_accepted(field: str) -> None:
    top = Policy(**{field: MAX_DURATION_MS / 1000})
    assert getattr(top, f"{field}_ms") == MAX_DURATION_MS
    assert Policy(**{field: timedelta(days=365 * 99)})


def test_the_cap_leaves_room_for_the_clock_and_a_countdown() -> None:
    """ms since the epoch now and in 2200, plus the cap twice (ttl + a countdown clamped to it),
    stay far below the 64-bit limit Redis checks against."""
    assert MAX_DURATION_MS == 100 * 365 * 24 * 3600 * 1000
    year_2200_ms = 7_258_118_400_000
    assert year_2200_ms + 2 * MAX_DURATION_MS < 2**63 // 1000


@pytest.mark.parametrize("field", ["ttl", "lease"])
@pytest.mark.parametrize("value", ["600", None, [60], b"1"], ids=repr)
def test_wrong_type_duration_is_refused(field: str, value: Any) -> None:
    with pytest.raises(ConfigurationError, match=rf"Policy\.{field} must be seconds .* timedelta"):
        Policy(**{field: value})


@pytest.mark.parametrize("field", ["ttl", "lease"])
@pytest.mark.parametrize("value", [True, False])
def test_bool_duration_is_refused(field: str, value: bool) -> None:
    with pytest.raises(ConfigurationError, match=rf"Policy\.{field} .* got bool"):
        Policy(**{field: value})


# -- enums ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("field", "valid"),
    [
        ("mode", ["until_executing", "until_executed", "until_expired", "while_executing"]),
        ("on_duplicate", ["return", "raise", "drop", "replace"]),
        ("on_store_error", ["raise", "allow"]),
    ],
)
@pytest.mark.parametrize("bad", ["bogus", "UNTIL_EXPIRED", 5, None])
def test_unknown_enum_value_is_refused_listing_the_choices(
    field: str, valid: list[str], bad: Any
) -> None:
    with pytest.raises(ConfigurationError) as info:
        Policy(**{field: bad})
    message = str(info.value)
    assert f"Policy.{field}={bad!r}" in message
    for choice in valid:
        assert repr(choice) in message


def test_configuration_error_is_a_value_error_and_a_taskdedup_error() -> None:
    with pytest.raises(ConfigurationError) as info:
        Policy(mode="bogus")
    assert isinstance(info.value, ValueError)
    assert isinstance(info.value, TaskDedupError)


# -- combinations --------------------------------------------------------------------------


def test_include_with_exclude_is_refused() -> None:
    with pytest.raises(ConfigurationError, match="give include or exclude, not both"):
        Policy(include=["a"], exclude=["b"])


@pytest.mark.parametrize("names", [{"include": ["a"]}, {"exclude": ["a"]}])
def test_key_with_include_or_exclude_is_refused(names: dict[str, Any]) -> None:
    with pytest.raises(ConfigurationError, match="drop include/exclude or drop key"):
        Policy(key=lambda a: a, **names)


@pytest.mark.parametrize("key", ["user_id", 42, ["a"]], ids=repr)
def test_non_callable_key_is_refused(key: Any) -> None:
    with pytest.raises(ConfigurationError, match=r"Policy\.key must be a callable"):
        Policy(key=key)


def test_callable_key_is_kept() -> None:
    def key(user_id: int) -> int:
        return user_id

    assert Policy(key=key).key is key


@pytest.mark.parametrize("names", [5, [1, 2], ["a", None]], ids=repr)
def test_include_that_is_not_argument_names_is_refused(names: Any) -> None:
    with pytest.raises(ConfigurationError, match=r"Policy\.include must .*argument names"):
        Policy(include=names)


@pytest.mark.parametrize("scope", ["tenant:1", ":", "a:b:c"])
def test_scope_containing_a_colon_is_refused(scope: str) -> None:
    with pytest.raises(ConfigurationError, match=r"Policy\.scope must be a string without ':'"):
        Policy(scope=scope)


def test_scope_that_is_not_a_string_is_refused() -> None:
    with pytest.raises(ConfigurationError, match=r"Policy\.scope must be a string"):
        Policy(scope=5)  # type: ignore[arg-type]


@pytest.mark.parametrize("on_duplicate", ["raise", "drop", "replace"])
def test_while_executing_with_an_enqueue_strategy_is_refused(on_duplicate: str) -> None:
    with pytest.raises(ConfigurationError) as info:
        Policy(mode="while_executing", on_duplicate=on_duplicate)
    message = str(info.value)
    assert f"on_duplicate={on_duplicate!r}" in message
    assert "use mode='until_executed'" in message


def test_while_executing_with_return_is_accepted() -> None:
    assert Policy(mode="while_executing", on_duplicate="return").mode is Mode.WHILE_EXECUTING


@pytest.mark.parametrize("on_duplicate", ["return", "raise", "drop", "replace"])
@pytest.mark.parametrize("mode", ["until_executing", "until_executed", "until_expired"])
def test_enqueue_gating_modes_accept_every_on_duplicate(mode: str, on_duplicate: str) -> None:
    p = Policy(mode=mode, on_duplicate=on_duplicate)
    assert p.mode == mode and p.on_duplicate == on_duplicate


# -- coerce --------------------------------------------------------------------------------


def test_coerce_returns_a_policy_unchanged() -> None:
    p = Policy(ttl=5)
    assert Policy.coerce(p) is p


def test_coerce_builds_a_policy_from_a_dict() -> None:
    p = Policy.coerce({"mode": "until_executed", "ttl": timedelta(seconds=30), "scope": "eu"})
    assert p == Policy(mode="until_executed", ttl=30, scope="eu")


def test_coerce_true_is_the_default_policy() -> None:
    assert Policy.coerce(True) == Policy()


@pytest.mark.parametrize("value", [False, None])
def test_coerce_false_and_none_mean_no_policy(value: Any) -> None:
    assert Policy.coerce(value) is None


def test_coerce_refuses_unknown_dict_keys_and_lists_the_known_ones() -> None:
    with pytest.raises(ConfigurationError) as info:
        Policy.coerce({"mdoe": "until_executed", "ttl": 5, "zz": 1})
    message = str(info.value)
    assert "unknown Policy field(s) 'mdoe', 'zz'" in message
    assert "known:" in message and "mode" in message and "on_duplicate" in message


def test_coerce_validates_dict_values() -> None:
    with pytest.raises(ConfigurationError, match=r"Policy\.ttl must be seconds"):
        Policy.coerce({"ttl": "10"})
    with pytest.raises(ConfigurationError, match=r"Policy\.mode='bogus'"):
        Policy.coerce({"mode": "bogus"})


@pytest.mark.parametrize("value", [5, 0, 1, "until_expired", ["mode"], object()],
                         ids=["5", "0", "1", "until_expired", "list", "object"])
def test_coerce_refuses_other_types(value: Any) -> None:
    with pytest.raises(ConfigurationError, match=r"dedup= must be a taskdedup\.Policy, a dict"):
        Policy.coerce(value)


# -- modes ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("mode", "enqueue", "execution"),
    [
        (Mode.UNTIL_EXECUTING, True, False),
        (Mode.UNTIL_EXECUTED, True, True),
        (Mode.UNTIL_EXPIRED, True, True),
        (Mode.WHILE_EXECUTING, False, True),
    ],
)
def test_mode_gates_per_the_spec_table(mode: Mode, enqueue: bool, execution: bool) -> None:
    assert mode.gates_enqueue is enqueue
    assert mode.gates_execution is execution


def test_every_mode_is_covered_by_the_table() -> None:
    assert {m.value for m in Mode} == {
        "until_executing", "until_executed", "until_expired", "while_executing",
    }


# -- the global switch ---------------------------------------------------------------------


def test_enabled_without_disable_or_env_var() -> None:
    assert taskdedup.is_disabled() is False


def test_disable_and_enable() -> None:
    taskdedup.disable()
    assert taskdedup.is_disabled() is True
    taskdedup.enable()
    assert taskdedup.is_disabled() is False


@pytest.mark.parametrize("value", ["1", "true", "yes"])
def test_env_var_disables(monkeypatch: pytest.MonkeyPatch, value: str) -> None:
    monkeypatch.setenv("TASKDEDUP_DISABLED", value)
    assert taskdedup.is_disabled() is True


@pytest.mark.parametrize("value", ["0", "", "false", "no"])
def test_env_var_false_values_keep_gating_on(monkeypatch: pytest.MonkeyPatch, value: str) -> None:
    monkeypatch.setenv("TASKDEDUP_DISABLED", value)
    assert taskdedup.is_disabled() is False


@pytest.mark.parametrize("value", ["False", "FALSE", "No"])
def test_env_var_false_values_are_case_insensitive(
    monkeypatch: pytest.MonkeyPatch, value: str
) -> None:
    monkeypatch.setenv("TASKDEDUP_DISABLED", value)
    assert taskdedup.is_disabled() is False


def test_env_var_is_read_at_call_time(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TASKDEDUP_DISABLED", "1")
    assert taskdedup.is_disabled() is True
    monkeypatch.setenv("TASKDEDUP_DISABLED", "0")
    assert taskdedup.is_disabled() is False
    monkeypatch.delenv("TASKDEDUP_DISABLED")
    assert taskdedup.is_disabled() is False


def test_enable_does_not_override_the_env_var(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TASKDEDUP_DISABLED", "1")
    taskdedup.enable()
    assert taskdedup.is_disabled() is True
