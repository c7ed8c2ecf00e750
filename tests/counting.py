"""Counting the commands a test sends, for its round-trip bars."""

from __future__ import annotations

import threading
from typing import Any

import pytest
import redis


class CommandCounter:
    """Counts the commands redis-py sends from this thread (one per round trip outside
    pipelines): a heartbeat thread an earlier test left behind in this xdist process sends its
    own (a lease renewal is an EVALSHA too), which are not the test's."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.commands: list[str] = []
        original = redis.Redis.execute_command
        mine = threading.get_ident()

        def counting(client: redis.Redis, *args: Any, **options: Any) -> Any:
            if threading.get_ident() == mine:
                self.commands.append(str(args[0]).upper())
            return original(client, *args, **options)

        monkeypatch.setattr(redis.Redis, "execute_command", counting)
