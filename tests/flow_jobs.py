"""The body of the coalesce and debounce tests' tasks and RQ jobs (SPEC §15), importable by
worker subprocesses.

Each run of identity ``label`` records ``start<n>``/``end<n>`` (``effects:<label>``), ``n``
being an argument the identity ignores, so which call's arguments ran is visible; a second
run beside the first records ``overlap``. ``gate`` (also ignored by the identity) names the
gate ``go:<gate>`` that holds the body until the test opens it.
"""

from __future__ import annotations

import time

from tests.effects import effect, r, wait_gate


def run(label: str, n: int, gate: str = "") -> int:
    """One run of identity ``label``, held by gate ``gate`` when one is named."""
    return body(label, n, gate, pause=0.1)


def body(label: str, n: int, gate: str, pause: float) -> int:
    """Record ``start<n>``, wait for gate ``gate`` (or ``pause`` seconds when none is named),
    record ``end<n>``; ``overlap`` when another run of ``label`` is in progress. Shared with
    :func:`tests.second_call_jobs.hold`."""
    if r().incr(f"busy:{label}") > 1:
        effect(label, "overlap")
    effect(label, f"start{n}")
    try:
        if gate:
            wait_gate(gate)
        else:
            time.sleep(pause)
    finally:
        r().decr(f"busy:{label}")
    effect(label, f"end{n}")
    return n
