"""A prompt that starts with `/` is a slash command only when it names a command the agent listed
(docs/hosting/pi.md): `/usr/bin/true` is a model prompt, and every turn's output belongs to that turn.

The agent is the real pi (tests/pikit.py: its model a scripted server on loopback) with an extension
that makes pi say `agent_start` a little after its answer to the prompt (tests/pi/slow-start.ts), as
listed by pi itself, then behind tests/scripts/pi_commands_proxy.py, which changes only pi's answer to
`get_commands`: `none` (a pi that answers without a command list: uibus took every `/…` for a
command, ended the turn at pi's response — before the run — and the run's reply became the next
turn's), and `claim=…` (a list naming a command pi does not have: the turn must still wait for the
run its prompt started, found by asking `get_state` after the response).
"""

from __future__ import annotations

import asyncio
import json
import sys
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from tests.chatkit import FRAMEWORK
from tests.conftest import REPO, require
from tests.ext_ui_helpers import ext, open_uis, read
from tests.pikit import PI, Model, Reply, hosting, pi_agent, scripted_model, turn_of
from tests.support import needs
from uibus.clients.connection import Connection
from uibus.infra.config import Config
from uibus.pb.uibus.v1 import extension_ui_pb2 as pb

pytestmark = pytest.mark.timeout(120)
PROXY = REPO / "tests" / "scripts" / "pi_commands_proxy.py"
SLOW_START = REPO / "tests" / "pi" / "slow-start.ts"  # pi says agent_start 400 ms after its response
_DIALOGS = ("select", "confirm", "input", "editor")


@pytest.fixture
@needs("node")
async def model() -> AsyncIterator[Model]:
    require("the pinned pi agent (npm ci --prefix tests/pi)", PI.exists(), "node")
    async with scripted_model() as m:
        yield m


@pytest.mark.parametrize("commands", ["pi's own", "none", "claim=usr/bin/true"])
async def test_a_path_prompt_and_the_next_each_get_their_own_reply(config: Config, model: Model, tmp_path: Path,
                                                                   commands: str) -> None:
    agent = pi_agent(tmp_path, model)
    agent["options"]["command"] += ["-e", str(SLOW_START)]
    if commands != "pi's own":
        agent["options"]["command"] = [sys.executable, str(PROXY), commands, *agent["options"]["command"]]
    # a little time between pieces: a turn ended at pi's response would miss them all
    model.script(Reply(text="True exits with status zero.", delay_s=0.05),
                 Reply(text="The second answer.", delay_s=0.05))
    async with hosting(config, tmp_path, [agent]) as app, \
            Connection(f"127.0.0.1:{app.port}", session="slash") as conn:
        first = await turn_of(conn, "pi", "/usr/bin/true")
        assert first[-1].response.text == "True exits with status zero."
        second = await turn_of(conn, "pi", "what next?")
        assert second[-1].response.text == "The second answer."
        # pi sent the path to the model as the user's words, and each prompt was one model request
        assert len(model.requests) == 2
        assert "/usr/bin/true" in json.dumps(model.requests[0]["messages"])
        assert "what next?" in json.dumps(model.requests[1]["messages"])


async def test_a_listed_command_still_ends_at_its_response(config: Config, model: Model, tmp_path: Path) -> None:
    """The other side: `/ui-tour` is an extension command pi lists; its turn ends at pi's response
    (no model request; its dialogs answered `cancelled` at a UI), and the next prompt is a model
    turn with its own reply."""
    model.script(Reply(text="After the tour."))
    async with hosting(config, tmp_path, [pi_agent(tmp_path, model)]) as app, \
            Connection(f"127.0.0.1:{app.port}", session="listed") as conn:
        (ui,) = await open_uis(app, conn, 1, "listed")
        chat = asyncio.ensure_future(turn_of(conn, "pi", "/ui-tour"))
        async with asyncio.timeout(60):
            while not chat.done():
                reading = asyncio.ensure_future(read(ui, 60))
                await asyncio.wait((reading, chat), return_when=asyncio.FIRST_COMPLETED)
                if not reading.done():
                    reading.cancel()
                    break
                event = reading.result()
                if event.WhichOneof("event") == "request" and event.request.WhichOneof("method") in _DIALOGS:
                    await ext(conn).Respond(pb.RespondRequest(id=event.request.id, cancelled=True))
            assert (await chat)[-1].response.type == FRAMEWORK
        assert model.requests == []
        assert (await turn_of(conn, "pi", "and now?"))[-1].response.text == "After the tour."
