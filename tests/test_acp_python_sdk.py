"""uibus as an ACP agent for an editor written with the official Python SDK (`agent-client-protocol`,
pinned in requirements-dev.lock), unmodified: it spawns `uibus acp` and its pydantic models parse
every answer, so a capability advertised off-schema fails here. The hosted agent is the TypeScript
SDK's fixture (tests/acp/fixture-agent.mjs) advertising additionalDirectories.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from tests.acpkit import need
from tests.conftest import require
from tests.pikit import hosting
from tests.test_acp_access import roots_agent
from tests.test_acp_serve import UIBUS
from uibus.app import App
from uibus.infra.config import Config

pytestmark = [pytest.mark.timeout(120), pytest.mark.node]


class Recorder:
    """The editor's side: what the agent sent (session/update), no permissions granted."""

    def __init__(self) -> None:
        self.updates: list[tuple[str, Any]] = []

    async def session_update(self, session_id: str, update: Any, **kwargs: Any) -> None:
        self.updates.append((session_id, update))

    async def request_permission(self, **kwargs: Any) -> Any:
        raise NotImplementedError

    def text(self, session: str) -> str:
        return "".join(u.content.text for s, u in self.updates
                       if s == session and getattr(u, "session_update", "") == "agent_message_chunk")


@pytest.fixture
async def app(config: Config, tmp_path: Path) -> AsyncIterator[App]:
    need("@agentclientprotocol/sdk")
    (tmp_path / "work" / "lib").mkdir(parents=True)
    async with hosting(config, tmp_path, [roots_agent(tmp_path)]) as app:
        yield app


async def test_the_python_sdks_client_reads_the_capabilities_and_opens_sessions_with_directories(
        app: App, tmp_path: Path) -> None:
    acp = pytest.importorskip("acp")
    require("agent-client-protocol", hasattr(acp, "spawn_agent_process"))
    work, recorder = tmp_path / "work", Recorder()
    lib = str(work / "lib")
    async with acp.spawn_agent_process(recorder, UIBUS, "acp", "--agent", "roots", "--target",
                                       f"127.0.0.1:{app.port}") as (conn, _proc):
        init = await conn.initialize(protocol_version=1)
        caps = init.agent_capabilities
        assert init.protocol_version == 1 and caps.load_session is True
        assert caps.session_capabilities.additional_directories is not None
        assert caps.auth.logout is not None
        session = (await conn.new_session(cwd=str(work), additional_directories=[lib])).session_id
        answer = await conn.prompt(session_id=session, prompt=[acp.text_block("roots")])
        assert answer.stop_reason == "end_turn"
        assert recorder.text(session) == f'Roots: ["{lib}"]'
        await conn.resume_session(session_id=session, cwd=str(work), additional_directories=[])
        await conn.prompt(session_id=session, prompt=[acp.text_block("roots")])
        assert recorder.text(session).endswith("Roots: []")
        with pytest.raises(acp.RequestError) as refused:
            await conn.new_session(cwd=str(work), additional_directories=["/etc"])
        assert refused.value.code == -32602 and "/etc is outside" in str(refused.value.data or refused.value)
