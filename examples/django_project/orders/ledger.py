"""Where the example's tasks leave their side effects (stand-ins for a card charge, an e-mail,
a stock reservation): a Redis list per effect, so that you can count how often each ran."""

from functools import cache

import redis
from django.conf import settings


@cache
def _client() -> redis.Redis:
    return redis.Redis.from_url(settings.REDIS_URL)


def record(effect: str, value: object) -> None:
    """Append ``value`` to the list ``ledger:<effect>``."""
    _client().rpush(f"ledger:{effect}", str(value))


def entries(effect: str) -> list[str]:
    """What :func:`record` appended for ``effect``, oldest first."""
    return [v.decode() for v in _client().lrange(f"ledger:{effect}", 0, -1)]
