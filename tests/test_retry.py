"""uibus.infra.retry: the one retry pacing (capped exponential backoff with jitter)."""

from __future__ import annotations

import asyncio
import random
import re
import time

import pytest

from tests.conftest import REPO
from uibus.infra.retry import FIRST_S, MAX_S, Backoff, delay


def test_delays_double_up_to_the_cap_and_jitter_only_shortens_them() -> None:
    rand = random.Random(7)
    for attempt in range(80):
        capped = min(FIRST_S * 2 ** attempt, MAX_S)
        for _ in range(50):
            seconds = delay(attempt, rand=rand)
            assert capped / 2 <= seconds <= capped, (attempt, seconds)
    # Without jitter the sequence is the plain capped doubling.
    assert [delay(n, jitter=0) for n in range(8)] == [0.05, 0.1, 0.2, 0.4, 0.8, 1.6, 2.0, 2.0]
    assert delay(10_000, jitter=0) == MAX_S  # no overflow, however long the outage


def test_jitter_spreads_loops_that_started_together() -> None:
    """Replicas that lost Redis at the same moment do not retry at the same moments."""
    waits = {round(Backoff(rand=random.Random(seed)).next_delay(), 6) for seed in range(20)}
    assert len(waits) > 10


def test_bad_settings_are_refused_when_made() -> None:
    for kwargs in ({"first_s": 0}, {"first_s": 3, "max_s": 2}, {"factor": 0.5}, {"jitter": 1.5}):
        with pytest.raises(ValueError, match="no backoff from"):
            Backoff(**kwargs)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="attempt >= 0"):
        delay(-1)


async def test_wait_sleeps_longer_each_time_and_reset_starts_over() -> None:
    backoff = Backoff(first_s=0.01, max_s=0.04, jitter=0)
    took = []
    for _ in range(4):
        started = time.monotonic()
        await backoff.wait()
        took.append(time.monotonic() - started)
    assert took[0] >= 0.009 and took[1] >= 0.019 and took[2] >= 0.039 and took[3] >= 0.039, took
    assert backoff.attempt == 4
    backoff.reset()
    assert backoff.attempt == 0 and backoff.next_delay() == 0.01


async def test_a_cancel_ends_the_wait_at_once() -> None:
    backoff = Backoff(first_s=30, max_s=30)
    waiting = asyncio.ensure_future(backoff.wait())
    await asyncio.sleep(0.01)
    started = time.monotonic()
    waiting.cancel()
    with pytest.raises(asyncio.CancelledError):
        await waiting
    assert time.monotonic() - started < 1


def test_no_loop_paces_its_retries_by_hand() -> None:
    """The retrying loops (Redis's links and writer, the shared dialogs' deletes) use `Backoff`: a
    hand-made doubling (`backoff * 2`, `min(backoff …`) elsewhere is a second pacing to keep in step."""
    by_hand = re.compile(r"\b\w*(backoff|delay|retry)\w*\s*\*=?\s*2\b|min\(\s*\w*(backoff|delay)\w*\s*\*", re.I)
    found = [f"{path.relative_to(REPO)}:{n}" for path in (REPO / "server").rglob("*.py")
             if path.name != "retry.py" and "pb" not in path.parts
             for n, line in enumerate(path.read_text().splitlines(), 1) if by_hand.search(line)]
    assert found == []
    for module in ("infra/redis/bus.py", "infra/redis/links.py", "replicas/dialog_sharing.py"):
        assert "Backoff()" in (REPO / "server" / module).read_text(), module
