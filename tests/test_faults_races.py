"""Races: 8 processes x 100 rounds hitting one identity at the same instant (SPEC §8).

Each round has a fresh identity; the processes meet at a ``multiprocessing.Barrier`` and
then all call at once. For the enqueue gate (``Deduplicator.gate`` → reserve) exactly one
is accepted and all others get the winner's id; for the worker guard (``claim``, as when a
reservation expired in a backlog and several messages of one identity reach workers at
once) exactly one runs. Processes are spawned (not forked), each with its own connection.
"""

from __future__ import annotations

import multiprocessing
from collections import Counter
from typing import Any

import pytest

from tests.fault_jobs import SCALE, race, report

PROCESSES = 8
ROUNDS = 100 * SCALE


def run_race(redis_url: str, transition: str) -> dict[int, list[tuple[int, bool, str | None]]]:
    ctx = multiprocessing.get_context("spawn")
    barrier: Any = ctx.Barrier(PROCESSES)
    results: Any = ctx.Queue()
    prefix = f"{transition}-{multiprocessing.current_process().pid}-{id(barrier):x}"
    procs = [
        ctx.Process(target=race,
                    args=(redis_url, i, ROUNDS, prefix, transition, barrier, results))
        for i in range(PROCESSES)
    ]
    for proc in procs:
        proc.start()
    try:
        collected = dict(results.get(timeout=120) for _ in procs)
    finally:
        for proc in procs:
            proc.join(timeout=30)
            if proc.is_alive():
                proc.kill()
                proc.join(timeout=10)
    assert all(proc.exitcode == 0 for proc in procs)
    return collected


@pytest.mark.parametrize("transition", ["reserve", "claim"])
def test_eight_processes_racing_on_one_identity_have_exactly_one_winner_per_round(
    redis_url: str, transition: str
) -> None:
    outcomes = run_race(redis_url, transition)
    assert sorted(outcomes) == list(range(PROCESSES))
    winners: Counter[int] = Counter()
    losers_pointing_at_the_winner = 0
    for round_ in range(ROUNDS):
        row = [outcomes[i][round_] for i in range(PROCESSES)]
        assert all(r[0] == round_ for r in row)
        won = [i for i, r in enumerate(row) if r[1]]
        assert len(won) == 1, f"round {round_}: winners {won}"
        winners[won[0]] += 1
        winner_id = f"p{won[0]}-r{round_}"
        # every other caller got the original's id (the caller returns its handle)
        assert all(r[2] == winner_id for i, r in enumerate(row) if i != won[0])
        losers_pointing_at_the_winner += PROCESSES - 1
    report(
        f"race_{transition}", processes=PROCESSES, rounds=ROUNDS,
        calls=PROCESSES * ROUNDS, accepted=sum(winners.values()),
        rounds_with_exactly_one_winner=ROUNDS,
        duplicates_answered_with_the_winners_id=losers_pointing_at_the_winner,
        wins_per_process=dict(sorted(winners.items())),
    )
