"""python -m bench.resume: what resuming a hosted agent's conversation costs the next turn.

With option `resume` (default true) uibus keeps each hosted agent's conversation handle, so an agent
process idle for `idle_seconds` can be closed (an idle pi holds ~140 MiB) and the next turn starts a
new process that picks the conversation up (pi: `switch_session`; ACP: `session/load`, which also
replays the transcript, dropped by uibus). This bench measures, per agent, the time from sending a
MAXIMAL StreamingChat turn to its first streamed AI piece:

* `live`: the agent process is running (the turn only costs the model's first piece);
* `resumed`: the process was closed for being idle; the turn starts a new one, which reopens the
  conversation of --turns earlier turns;
* `cold`: a new session, no handle: a new process and a new conversation (what every turn after an
  idle close cost before resume).

The agents are the real pinned ones (pi 0.73 in RPC mode, claude-code-acp 0.16 through its ACP
adapter) against the scripted model servers of the tests (tests/pikit.py, tests/scripted_models.py),
which answer at once, so the figures are uibus + the agent, not a model. uibus runs in this process
(tests.conftest.start_app) on an embedded SQLite store in a tmp dir. The figures go to stdout as a
table (median and max of --rounds) and, with --json, as JSON.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import tempfile
import time
from collections.abc import AsyncIterator, Callable
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from pathlib import Path
from typing import Any

from tests.chatkit import AI, MAXIMAL, Agent, request, write_agents
from tests.conftest import start_app
from tests.pikit import PI, Reply, pi_agent, scripted_model
from tests.scripted_models import Say, claude_model
from tests.test_acp_agent import CLAUDE_ACP, claude_agent
from uibus.app import App
from uibus.clients.connection import Connection
from uibus.infra.config import Config

IDLE_S = 0.5  # the idle close used to get a closed process quickly


async def first_piece(target: str, session: str, agent: str, text: str) -> float:
    """Seconds from the call to its first AI piece (the rest of the turn is read to its end)."""
    async with Connection(target, session=session) as conn:
        start = time.perf_counter()
        first = 0.0
        async for r in Agent(conn, agent).StreamingChat(request(text, filter_type=MAXIMAL)):
            if not first and r.response.type == AI and r.response.text:
                first = time.perf_counter() - start
        if not first:
            raise RuntimeError(f"{agent}: no AI piece in the turn")
        return first


async def until_closed(app: App, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while app.core.agent_sessions.count():
        if time.monotonic() > deadline:
            raise RuntimeError("the idle agent was not closed")
        await asyncio.sleep(0.05)


@asynccontextmanager
async def pi_setup(tmp: Path, replies: int) -> AsyncIterator[tuple[list[dict[str, Any]], Callable[[], None]]]:
    async with scripted_model() as model:
        def refill() -> None:
            model.script(*[Reply(text="Here is a reply of a few words.") for _ in range(replies)])
        entry = pi_agent(tmp, model, idle_seconds=IDLE_S)
        entry["options"]["command"] = [a for a in entry["options"]["command"] if a != "--no-session"]
        refill()
        yield [entry], refill


@asynccontextmanager
async def claude_setup(tmp: Path, replies: int) -> AsyncIterator[tuple[list[dict[str, Any]], Callable[[], None]]]:
    async with claude_model() as model:
        def refill() -> None:
            model.script(*[Say("Here is a reply of a few words.") for _ in range(replies)])
        entry = claude_agent(tmp, model, idle_seconds=IDLE_S)
        refill()
        yield [entry], refill


SETUPS: dict[str, tuple[Path, Callable[[Path, int], AbstractAsyncContextManager[Any]]]] = {
    "pi": (PI, pi_setup), "claude": (CLAUDE_ACP, claude_setup)}


async def measure(name: str, rounds: int, turns: int) -> dict[str, list[float]]:
    program, setup = SETUPS[name]
    if not program.exists():
        raise SystemExit(f"{program} is missing: npm ci --prefix {program.parents[2]}")
    out: dict[str, list[float]] = {"live": [], "resumed": [], "cold": []}
    with tempfile.TemporaryDirectory(prefix="bench-resume-") as d:
        tmp = Path(d)
        async with setup(tmp, 4 * rounds * (turns + 3)) as (entries, _refill):
            agent = entries[0]["name"]
            config = Config(host="127.0.0.1", port=0, http_port=0, store=str(tmp / "uibus.db"), grace_seconds=2.0,
                            agents=write_agents(tmp, entries))
            app = await start_app(config)
            target = f"127.0.0.1:{app.port}"
            try:
                for r in range(rounds):
                    session = f"s{r}"
                    out["cold"].append(await first_piece(target, session, agent, "hello"))
                    for t in range(turns - 1):  # the conversation a resume reopens
                        out["live"].append(await first_piece(target, session, agent, f"turn {t}"))
                    await until_closed(app)
                    out["resumed"].append(await first_piece(target, session, agent, "go on"))
                    await until_closed(app)
                handles = app.core.agent_sessions.handles
                if handles.resumed != rounds or handles.resume_failed:
                    raise RuntimeError(f"{name}: {handles.resumed} resumes, {handles.resume_failed} failed; "
                                       f"expected {rounds}")
            finally:
                await app.aclose()
    return out


def table(results: dict[str, dict[str, list[float]]]) -> str:
    rows = ["agent   | case    | n  | median ms | max ms", "--------|---------|----|-----------|-------"]
    for name, cases in results.items():
        for case in ("live", "resumed", "cold"):
            v = cases[case]
            rows.append(f"{name:<7} | {case:<7} | {len(v):<2} | {statistics.median(v) * 1000:9.0f} | "
                        f"{max(v) * 1000:6.0f}")
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.resume", description=(__doc__ or "").splitlines()[0])
    p.add_argument("--agents", default="pi,claude", help="comma-separated of pi,claude (default both)")
    p.add_argument("--rounds", type=int, default=5, help="resumes measured per agent (default 5)")
    p.add_argument("--turns", type=int, default=4, help="turns of the conversation before each resume (default 4)")
    p.add_argument("--json", action="store_true", help="print the raw figures as JSON too")
    a = p.parse_args(argv)

    async def run() -> dict[str, dict[str, list[float]]]:
        return {name: await measure(name, a.rounds, max(1, a.turns)) for name in a.agents.split(",") if name}

    results = asyncio.run(run())
    print(table(results))
    if a.json:
        print(json.dumps(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
