"""The Lua sources: each script carries the shared functions of ``_lib.lua`` it calls, and
only those (:mod:`taskdedup.stores.scripts`)."""

from __future__ import annotations

import re

import pytest
import redis

from taskdedup.stores import scripts
from taskdedup.stores.redis import SCRIPTS


def _defined(source: str) -> list[str]:
    return re.findall(r"^local function (\w+)\(", source, re.MULTILINE)


def test_the_library_splits_into_its_functions_in_file_order() -> None:
    names = [name for name, _ in scripts.library_functions()]
    assert names[:2] == ["read", "parse"] and {"claim", "gate", "seen", "window"} <= set(names)
    assert all(source.rstrip().endswith("end") for _, source in scripts.library_functions())


def test_a_script_gets_what_it_calls_transitively_and_nothing_else() -> None:
    assert _defined(scripts.with_library("return 1")) == []
    assert _defined(scripts.with_library("-- parse(v) in a comment\nreturn 1")) == []
    # parse alone; claim brings seen, which brings window and the filter's functions
    assert _defined(scripts.with_library("return parse(ARGV[1])")) == ["parse"]
    claim = _defined(scripts.with_library("return claim(KEYS[1], ARGV[1], 1, false)"))
    assert {"claim", "parse", "seen", "window"} <= set(claim) and "gate" not in claim
    assert _defined(SCRIPTS["release"]) == ["read", "parse", "owner_text", "same"]
    assert "gate" in _defined(SCRIPTS["reserve"]) and "gate" not in _defined(SCRIPTS["claim"])


def test_every_script_loads_on_a_real_server(redis_url: str) -> None:
    """Each trimmed source still compiles (a function it calls but lacks would only fail at
    run time, as a nil global: the store tests run every script too)."""
    client = redis.Redis.from_url(redis_url)
    for name, source in SCRIPTS.items():
        assert client.script_load(source), name
        for called in re.findall(r"\b(\w+)\s*\(", re.sub(r"--.*", "", source)):
            if called in dict(scripts.library_functions()):
                assert called in _defined(source), (name, called)


def test_a_malformed_library_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    scripts.library_functions.cache_clear()
    monkeypatch.setattr(scripts, "_lua", lambda name: "local x = 1\n")
    try:
        with pytest.raises(ValueError, match="unexpected top-level line"):
            scripts.library_functions()
    finally:
        scripts.library_functions.cache_clear()
