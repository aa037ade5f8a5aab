"""The one retry pacing: capped exponential backoff with jitter, for every loop that retries
something that is down (Redis's links and writer, the shared store's deletes).

Why one helper: the loops had each written their own doubling (and none spread its retries), so
after an outage every replica — and every link of one replica — retried in lockstep, hitting the
store together at each step. The jitter spreads them: each wait is between half and all of the
capped exponential delay ("equal jitter"), never shorter, so a retry never spins. No retry library
is a dependency (pyproject.toml), and this is the whole of what the loops need.

`Backoff` is the state of one retrying loop: `await backoff.wait()` sleeps the next delay and
lengthens the one after, `backoff.reset()` starts over after a success. A cancel of the sleeping
task propagates at once (nothing here catches it), so a loop stops as soon as its owner closes it.
"""

from __future__ import annotations

import asyncio
import random

FIRST_S = 0.05  # the first wait
MAX_S = 2.0  # no wait is longer: a store that is back is noticed within this
FACTOR = 2.0
JITTER = 0.5  # each wait is between (1 - JITTER) and 1 times the capped delay


def delay(attempt: int, first_s: float = FIRST_S, max_s: float = MAX_S, factor: float = FACTOR,
          jitter: float = JITTER, rand: random.Random | None = None) -> float:
    """The wait before retry number `attempt` (0: the first): `first_s * factor**attempt`, capped at
    `max_s`, then shortened by a random share of at most `jitter` of it."""
    if attempt < 0 or first_s <= 0 or max_s < first_s or factor < 1 or not 0 <= jitter <= 1:
        raise ValueError(f"no backoff from attempt={attempt}, first_s={first_s}, max_s={max_s}, factor={factor}, "
                         f"jitter={jitter}: attempt >= 0, 0 < first_s <= max_s, factor >= 1, 0 <= jitter <= 1")
    capped = max_s if attempt >= 64 else min(first_s * factor ** attempt, max_s)  # no float overflow
    return capped * (1 - jitter * (rand or random).random())


class Backoff:
    """One retrying loop's pacing (see the module docstring)."""

    __slots__ = ("attempt", "factor", "first_s", "jitter", "max_s", "rand")

    def __init__(self, first_s: float = FIRST_S, max_s: float = MAX_S, factor: float = FACTOR,
                 jitter: float = JITTER, rand: random.Random | None = None) -> None:
        delay(0, first_s, max_s, factor, jitter)  # a bad setting fails here, not at the first outage
        self.first_s, self.max_s, self.factor, self.jitter = first_s, max_s, factor, jitter
        self.rand = rand
        self.attempt = 0  # waits since the last reset

    def next_delay(self) -> float:
        """The wait `wait` sleeps next, and counts it."""
        seconds = delay(self.attempt, self.first_s, self.max_s, self.factor, self.jitter, self.rand)
        self.attempt += 1
        return seconds

    async def wait(self) -> None:
        """Sleeps the next delay; a cancel propagates."""
        await asyncio.sleep(self.next_delay())

    def reset(self) -> None:
        """After a success: the next wait is a first one again."""
        self.attempt = 0
