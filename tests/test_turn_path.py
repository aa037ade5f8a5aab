"""The path of a local hosted chat turn, measured: which of uibus's modules hand the turn along, and
that control never turns around between layers (the old `Chat.turn → LocalPlacement.turn →
Chat.turn_here`: domain → replicas → domain).

The turn is a real one: a hosted agent (tests/scripts/rpc_shell.py, pi's RPC mode) behind a real
server, called over a real gRPC channel. While its second turn runs (the first started the
process), a profiler records every call made in the turn's own task from one uibus module into
another. The shared mechanics of the lowest layer (uibus.infra: the bus, the store, tasks, tokens,
telemetry) are used by everyone and are not steps of the path; a module that calls nothing else of
uibus is a leaf helper (a clock, a view), not a step either. What is left is the path a reader
walks: it must be short (≤ 12 modules, as docs/architecture.md lists it), and no call may go from a
lower layer up into a higher one (a turn-around: a method handed to a lower layer and called back,
as the old placement's `serve_turns(self.turn_here)` was). A function made on the spot and handed
down to be applied within the call (`store.update(key, apply)`, a sort key) is part of its caller's
step, not a turn-around.
"""

from __future__ import annotations

import asyncio
import sys
import types
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

import uibus
from tests.chatkit import Agent, request, write_agents
from tests.conftest import REPO, start_app
from tests.test_architecture import layer_of
from uibus.clients.connection import Connection
from uibus.infra.config import Config

pytestmark = pytest.mark.timeout(60)

SHELL = REPO / "tests" / "scripts" / "rpc_shell.py"
SERVER = str(Path(uibus.__file__).parent) + "/"  # where the package runs from


def module_of(frame: types.FrameType) -> str | None:
    """The uibus module a frame runs in (None: not uibus's code)."""
    name = frame.f_code.co_filename
    if not name.startswith(SERVER) or "/pb/" in name:
        return None
    parts = ["uibus", *Path(name[len(SERVER):]).with_suffix("").parts]
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


@contextmanager
def calls_in(task_of: list[asyncio.Task[object] | None], edges: set[tuple[str, str]]) -> Iterator[None]:
    """Records (caller module, callee module) for each call between two uibus modules made in the
    task that first enters the pipeline (the turn's own call) while the block runs."""

    def profile(frame: types.FrameType, event: str, arg: object) -> None:
        if event != "call":
            return
        callee = module_of(frame)
        if callee is None or "<locals>" in frame.f_code.co_qualname or "<lambda>" in frame.f_code.co_qualname:
            return
        try:
            task = asyncio.current_task()
        except RuntimeError:
            return
        if task_of[0] is None and callee == "uibus.edge.pipeline":
            task_of[0] = task
        if task is None or task is not task_of[0]:
            return
        caller = frame.f_back
        while caller is not None and module_of(caller) is None:
            caller = caller.f_back
        if caller is not None and (name := module_of(caller)) != callee:
            edges.add((name, callee))  # type: ignore[arg-type]

    sys.setprofile(profile)
    try:
        yield
    finally:
        sys.setprofile(None)


async def test_a_local_hosted_turn_walks_few_modules_and_never_turns_around(tmp_path: Path) -> None:
    agents = write_agents(tmp_path, [{"name": "shell", "backend": "rpc", "options": {
        "command": [sys.executable, str(SHELL)], "cwd": str(tmp_path), "stop_timeout_seconds": 2}}])
    app = await start_app(Config(host="127.0.0.1", port=0, http_port=0, store=str(tmp_path / "u.db"),
                                 grace_seconds=1.0, agents=agents))
    edges: set[tuple[str, str]] = set()
    try:
        async with Connection(f"127.0.0.1:{app.port}", session="walk") as conn:
            first = [r async for r in Agent(conn, "shell").StreamingChat(request("echo one"))]
            assert first[-1].response.text.startswith("exit 0: one")
            with calls_in([None], edges):
                second = [r async for r in Agent(conn, "shell").StreamingChat(request("echo two"))]
            assert second[-1].response.text.startswith("exit 0: two")
    finally:
        await app.aclose()
    assert app.core.agent_sessions.count() == 0

    steps = {(a, b) for a, b in edges if not a.startswith("uibus.infra") and not b.startswith("uibus.infra")}
    path = {a for a, _ in steps} | {"uibus.agents.stdio"}  # ... and the process the turn is written to
    # the turn went the way docs/architecture.md draws it
    for module in ("uibus.edge.pipeline", "uibus.edge.services.agent", "uibus.replicas.placement",
                   "uibus.domain.chat", "uibus.domain.agent_sessions", "uibus.agents.turns"):
        assert module in path, (module, sorted(path))
    assert len(path) <= 12, sorted(path)
    upward = sorted(f"{a} → {b}" for a, b in edges if layer_of(b) > layer_of(a))
    assert upward == [], "control turned around: a lower layer called up into a higher one"
