"""One app hosting the real agents the steering and attachment tests talk to: the ACP fixture agent
and pinned pi on a scripted model server. Both test files want the same pair, so it is made here."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

import grpc
import pytest

from tests.chatkit import MAXIMAL, Agent, request
from tests.conftest import free_port, require, wait_for
from tests.pikit import PI, Model, hosting, pi_agent, scripted_model
from tests.test_acp_agent import ACP_DIR, fixture_agent
from uibus.app import App
from uibus.clients.connection import Connection
from uibus.infra.config import Config
from uibus.pb.uibus.v1 import sessions_pb2 as pb
from uibus.pb.uibus.v1 import sessions_pb2_grpc


def need_fixture() -> None:
    require("the ACP SDK (npm ci --prefix tests/acp)", (ACP_DIR / "node_modules" / "@agentclientprotocol").is_dir(),
            "node")


@asynccontextmanager
async def fixture_and_pi(config: Config, tmp_path: Path) -> AsyncIterator[tuple[App, Model]]:
    """An app (with HTTP) hosting "acp" (the fixture agent) and "pi" on a scripted model, and that model."""
    need_fixture()
    require("the pinned pi agent (npm ci --prefix tests/pi)", PI.exists(), "node")
    async with scripted_model() as model, \
            hosting(config, tmp_path, [fixture_agent(tmp_path), pi_agent(tmp_path, model)],
                    http_port=free_port()) as app:
        yield app, model


async def stop_a_hung_pi_turn(caller: Connection, stopper: Connection, model: Model) -> grpc.aio.AioRpcError:
    """A pi turn started on `caller` that hangs at the model, stopped by StopTurn from `stopper`:
    asserts the caller's call ends CANCELLED and that pi got `abort` (it dropped its model request),
    and returns the caller's error for what else a test checks."""
    call = Agent(caller, "pi").StreamingChat(request("take forever", filter_type=MAXIMAL))
    await asyncio.wait_for(call.read(), 30)
    await wait_for(lambda: model.open_requests == 1, timeout=10, what="the model request")
    assert (await sessions_pb2_grpc.SessionServiceStub(stopper.channel).StopTurn(
        pb.AgentRequest(agent="pi"))).stopped is True
    with pytest.raises(grpc.aio.AioRpcError) as err:
        async for _ in call:
            pass
    assert err.value.code() == grpc.StatusCode.CANCELLED
    await wait_for(lambda: model.open_requests == 0, timeout=10, what="the model request to be dropped (abort)")
    assert model.cancelled == 1
    return err.value
