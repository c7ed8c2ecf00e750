"""A call gated and claimed in this process, as a worker's body about to run: the starting
point of the in-process tests of what follows a claim (completion, renewals)."""

from __future__ import annotations

import uuid

from taskdedup import Deduplicator, Policy


def claimed_call(
    dedup: Deduplicator, name: str, policy: Policy, label: str = ""
) -> tuple[str, str]:
    """Gate and claim a fresh call of ``name``; its (key, owner)."""
    owner = str(uuid.uuid4())
    identity = dedup.identity(name, policy, (label or owner,))
    dedup.gate(name, policy, identity, owner)
    dedup.start(name, policy, identity.key, owner)
    return identity.key, owner
