"""The `uibus` command as a new user meets it in the first hour, against a live server:
`uibus call` reaches every service uibus serves, `uibus acp` over files, pipes and a terminal,
`uibus chat`'s exit code when the agent fails, `uibus subscribe --since`."""

from __future__ import annotations

import asyncio
import json
import os
import pty
import re
import signal
import termios
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from tests.chatkit import MAXIMAL, Agent, local, request, write_agents
from tests.conftest import REPO, free_port, running, wait_for
from tests.test_cli import SIGINT_DEFAULT, UIBUS
from uibus.app import App
from uibus.clients import descriptors
from uibus.clients.connection import Connection
from uibus.infra.config import Config
from uibus.infra.session import SINCE_KEY
from uibus.pb.cline import common_pb2, ui_pb2

pytestmark = pytest.mark.timeout(180)

TOKEN = "first-hour-token"


@pytest.fixture
def config(config: Config, tmp_path: Path) -> Config:
    """hello_world as shipped; `slow`, a turn long enough to close stdin during; `down`, an agent whose
    model is unreachable (it fails every turn); `liar`, a healthy agent whose answer starts like an error."""
    agents = write_agents(tmp_path, [
        local("hello_world"), local("slow", delay_ms=150, chunks=8),
        {"name": "down", "backend": "openai", "options": {"base_url": f"http://127.0.0.1:{free_port()}/v1",
                                                           "model": "m1", "connect_timeout_s": 5}},
        local("liar", greeting="Error from liar: not really."),
    ], default="hello_world")
    return replace(config, agents=agents)


async def run(*args: str, target: str, stdin: Any = None, env: dict[str, str] | None = None) -> tuple[int, str, str]:
    proc = await asyncio.create_subprocess_exec(UIBUS, *args, "--target", target, stdin=stdin,
                                                stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
                                                env=env)
    out, err = await asyncio.wait_for(proc.communicate(), 60)
    return proc.returncode or 0, out.decode(), err.decode()


def lines(out: str) -> list[dict[str, Any]]:
    return [json.loads(line) for line in out.splitlines() if line.strip()]


# ---- uibus call ----------------------------------------------------------------------------------

def test_call_knows_every_service_of_every_proto_without_a_list() -> None:
    """The services `uibus call` finds locally are exactly those the protos declare (a new proto is
    callable the day it lands): found by walking the generated modules, not from a list."""
    declared = set()
    for proto in (REPO / "protos").rglob("*.proto"):
        text = proto.read_text()
        package = re.search(r"^package\s+([\w.]+)\s*;", text, re.M)
        for service in re.findall(r"^service\s+(\w+)", text, re.M):
            declared.add(f"{package.group(1)}.{service}" if package else service)
    assert {s.full_name for s in descriptors.local_services()} == declared
    assert {"uibus.v1.SessionService", "uibus.v1.WebviewService", "uibus.v1.TeamService", "uibus.v1.AuditService",
            "cline.WorktreeService"} <= declared


async def test_call_reaches_the_services_a_new_user_tries(app: App) -> None:
    target = f"127.0.0.1:{app.port}"
    rc, out, err = await run("call", "uibus.v1.SessionService/CreateSession", '{"title":"q1"}', "--session", "q1",
                             target=target)
    assert rc == 0, err
    made = json.loads(out)
    assert (made["session"], made["title"]) == ("q1", "q1")
    calls = [
        ("call", "uibus.v1.SessionService/ListSessions"),
        ("call", "uibus.v1.TeamService/WhoAmI", "--session", "q1"),
        ("call", "uibus.v1.AuditService/Verify"),
        ("call", "ConciergeService/List"),
        # neuro-san's per-agent service exists only on the server: found through its reflection, in grpcurl's form too
        ("call", "hello_world.AgentService/StreamingChat",
         json.dumps({"user_message": {"text": "hi"}, "chat_filter": {"chat_filter_type": "MAXIMAL"}}),
         "--session", "q1"),
        ("call", "hello_world.AgentService.Connectivity"),
        ("call", "cline.WorktreeService/listWorktrees", "--session", "q1"),
    ]
    listed, who, verified, concierge, chat, connectivity, worktrees = await asyncio.gather(
        *(run(*c, target=target) for c in calls))
    assert listed[0] == 0 and "q1" in [s["session"] for s in json.loads(listed[1])["sessions"]], listed
    assert who[0] == 0 and json.loads(who[1])["session"] == "q1", who
    assert verified[0] == 0 and json.loads(verified[1])["ok"] is True, verified
    assert concierge[0] == 0 and "slow" in [a["agent_name"] for a in json.loads(concierge[1])["agents"]], concierge
    assert chat[0] == 0, chat
    replies = lines(chat[1])
    assert len(replies) > 2 and replies[-1]["response"]["type"] == "AGENT_FRAMEWORK", replies  # a stream: JSON lines
    assert replies[-1]["response"]["text"].startswith('Hello from hello_world! You said: "hi".')
    assert "".join(r["response"]["text"] for r in replies if r["response"]["type"] == "AI") \
        == replies[-1]["response"]["text"]
    assert connectivity[0] == 0 and json.loads(connectivity[1])["connectivity_info"][0]["origin"] == "hello_world"
    # reached (the server's own refusal, exit 1), not "no such method" (exit 2)
    assert worktrees[0] == 1 and "FAILED_PRECONDITION" in worktrees[2] and "worktree" in worktrees[2], worktrees


async def test_call_streams_a_server_stream_as_json_lines_until_ctrl_c(app: App) -> None:
    target = f"127.0.0.1:{app.port}"
    async with Connection(target, session="web") as conn:
        await conn.host.PublishPartialMessage(ui_pb2.ClineMessage(ts=5, type=ui_pb2.SAY, say=ui_pb2.TEXT, text="one"))
    proc = await asyncio.create_subprocess_exec(*SIGINT_DEFAULT, UIBUS, "call", "uibus.v1.WebviewService/Subscribe",
                                                '{"client_id": "cli", "mark_replay_end": true}', "--session", "web",
                                                "--target", target, stdout=asyncio.subprocess.PIPE)
    assert proc.stdout is not None
    try:
        seen = []
        while not seen or "replayComplete" not in seen[-1]:
            seen.append(json.loads(await asyncio.wait_for(proc.stdout.readline(), 30)))
            assert len(seen) < 50, seen
        assert [e["partialMessage"]["text"] for e in seen if "partialMessage" in e] == ["one"], seen
        proc.send_signal(signal.SIGINT)
        assert await asyncio.wait_for(proc.wait(), 20) == 130
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()


async def test_an_unknown_name_lists_the_close_matches(app: App) -> None:
    target = f"127.0.0.1:{app.port}"
    typo, agent, ambiguous, nothing = await asyncio.gather(
        run("call", "CreateSesion", target=target), run("call", "nope.AgentService/StreamingChat", target=target),
        run("call", "Subscribe", target=target), run("call", "xyzzy", target=target))
    assert typo[0] == 2 and "no uibus method is called 'CreateSesion'" in typo[2], typo
    assert "close: uibus.v1.SessionService/CreateSession" in typo[2], typo
    assert agent[0] == 2 and "hello_world.AgentService/StreamingChat" in agent[2], agent  # known from reflection
    assert ambiguous[0] == 2 and "uibus.v1.WebviewService/Subscribe" in ambiguous[2] \
        and "uibus.v1.ExtensionUiService/Subscribe" in ambiguous[2], ambiguous
    assert nothing[0] == 2 and "services: " in nothing[2] and "uibus.v1.SessionService" in nothing[2], nothing


async def test_call_takes_the_token_like_the_other_commands(config: Config) -> None:
    async with running(replace(config, auth_token=TOKEN)) as app:
        target = f"127.0.0.1:{app.port}"
        env = {**os.environ, "UIBUS_TOKEN": TOKEN}
        (bare, flag, from_env, reflected, reflected_bare) = await asyncio.gather(
            run("call", "uibus.v1.SessionService/CreateSession", '{"title": "t"}', "--session", "t1", target=target),
            run("call", "uibus.v1.SessionService/CreateSession", '{"title": "t"}', "--session", "t1", "--token", TOKEN,
                target=target),
            run("call", "uibus.v1.SessionService/ListSessions", target=target, env=env),
            run("call", "hello_world.AgentService/Connectivity", "--token", TOKEN, target=target),
            run("call", "hello_world.AgentService/Connectivity", target=target))
    assert bare[0] == 1 and "UNAUTHENTICATED" in bare[2], bare
    assert flag[0] == 0 and json.loads(flag[1])["session"] == "t1", flag
    assert from_env[0] == 0 and "sessions" in json.loads(from_env[1]), from_env
    assert reflected[0] == 0 and json.loads(reflected[1])["connectivity_info"][0]["origin"] == "hello_world", reflected
    assert reflected_bare[0] != 0 and "UNAUTHENTICATED" in reflected_bare[2], reflected_bare


# ---- uibus subscribe --since ---------------------------------------------------------------------

async def test_subscribe_since_replays_exactly_the_events_after_n_then_goes_live(app: App) -> None:
    target = f"127.0.0.1:{app.port}"
    async with Connection(target, session="resume") as conn:
        for ts, text in enumerate("abcd", start=1):
            await conn.host.PublishPartialMessage(ui_pb2.ClineMessage(ts=ts, type=ui_pb2.SAY, say=ui_pb2.TEXT,
                                                                      text=text))
        logged = conn.ui.subscribeToPartialMessage(common_pb2.EmptyRequest(), metadata=((SINCE_KEY, "0"),))
        seqs = {}
        async for message in logged:
            seqs[message.text] = message.seq
            if len(seqs) == 4:
                break
        logged.cancel()
        assert seqs["a"] < seqs["b"] < seqs["c"] < seqs["d"]
        sub = await asyncio.create_subprocess_exec(*SIGINT_DEFAULT, UIBUS, "subscribe", "partialMessage", "--since",
                                                   str(seqs["b"]), "--session", "resume", "--target", target,
                                                   stdout=asyncio.subprocess.PIPE)
        assert sub.stdout is not None
        try:
            got = [json.loads(await asyncio.wait_for(sub.stdout.readline(), 30)) for _ in range(2)]
            await wait_for(lambda: app.bus.count("partial_message", "resume") == 1, timeout=20, what="live")
            await conn.host.PublishPartialMessage(ui_pb2.ClineMessage(ts=9, type=ui_pb2.SAY, say=ui_pb2.TEXT,
                                                                      text="e"))
            got.append(json.loads(await asyncio.wait_for(sub.stdout.readline(), 30)))
            # exactly what came after b, in order, then live: nothing of a or b, nothing twice
            assert [(m["text"], int(m["seq"])) for m in got[:2]] == [("c", seqs["c"]), ("d", seqs["d"])]
            assert got[2]["text"] == "e" and int(got[2]["seq"]) > seqs["d"]
            sub.send_signal(signal.SIGINT)
            assert await asyncio.wait_for(sub.wait(), 20) == 130
        finally:
            if sub.returncode is None:
                sub.kill()
                await sub.wait()


async def test_subscribe_since_is_refused_where_it_would_be_ignored(app: App) -> None:
    target = f"127.0.0.1:{app.port}"
    live_only, negative = await asyncio.gather(run("subscribe", "theme", "--since", "3", target=target),
                                               run("subscribe", "partialMessage", "--since", "-1", target=target))
    assert live_only[0] == 2 and "subscribeToTheme is live only" in live_only[2], live_only
    assert negative[0] == 2 and "not a sequence number" in negative[2], negative


# ---- uibus chat ----------------------------------------------------------------------------------

async def test_chat_exits_non_zero_with_the_error_on_stderr_when_the_agent_fails(app: App) -> None:
    target = f"127.0.0.1:{app.port}"
    failed, fine, liar = await asyncio.gather(
        run("chat", "down", "-m", "hi", "-m", "never sent", "--session", "c-down", target=target),
        run("chat", "hello_world", "-m", "hi", "--session", "c-fine", target=target),
        run("chat", "liar", "-m", "hi", "--session", "c-liar", target=target))
    rc, out, err = failed
    assert rc == 1, failed
    assert err.startswith("uibus chat: Error from down: ") and err.count("Error from down") == 1, failed  # stopped
    assert "Error from" not in out, failed
    assert fine == (0, 'Hello from hello_world! You said: "hi". This is the start of our conversation.\n', ""), fine
    # An answer that merely reads like an error is an answer: the server's marker decides, not the words.
    assert liar[0] == 0 and liar[1].startswith("Error from liar: not really.") and liar[2] == "", liar


async def test_chat_from_a_pipe_stops_at_the_failed_turn(app: App) -> None:
    target = f"127.0.0.1:{app.port}"
    proc = await asyncio.create_subprocess_exec(UIBUS, "chat", "down", "--session", "c-pipe", "--target", target,
                                                stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE,
                                                stderr=asyncio.subprocess.PIPE)
    out, err = await asyncio.wait_for(proc.communicate(b"first\nsecond\n"), 60)
    assert proc.returncode == 1 and out == b"" and err.decode().count("uibus chat: Error from down: ") == 1, (out, err)


async def test_a_failed_turn_is_marked_on_the_wire_and_its_text_is_unchanged(app: App) -> None:
    """What neuro-san clients read stays as it was (the text, the stream ending OK); the final message's
    structure carries `error` and `tool`, as neuro-san's JSON error formatter names them."""
    async with Connection(f"127.0.0.1:{app.port}", session="wire") as conn:
        for agent in ("down", "hello_world"):
            replies = [r async for r in Agent(conn, agent).StreamingChat(request("hi", filter_type=MAXIMAL))]
            final = replies[-1].response
            if agent == "down":
                assert final.text.startswith("Error from down: "), final
                assert dict(final.structure) == {"error": final.text, "tool": "down"}
            else:
                assert not final.HasField("structure") and final.text.startswith("Hello from hello_world!")


# ---- uibus acp -----------------------------------------------------------------------------------

def acp(ident: int, method: str, **params: Any) -> str:
    return json.dumps({"jsonrpc": "2.0", "id": ident, "method": method, "params": params}) + "\n"


INIT = acp(1, "initialize", protocolVersion=1, clientCapabilities={})
NEW = acp(2, "session/new", cwd="/tmp", mcpServers=[])
LIST = acp(3, "session/list")


async def test_acp_with_stdin_from_a_file_and_stdout_to_a_file(app: App, tmp_path: Path) -> None:
    requests, answers = tmp_path / "in.jsonl", tmp_path / "out.txt"
    requests.write_text(INIT + NEW + LIST)
    with requests.open("rb") as stdin, answers.open("wb") as stdout:
        proc = await asyncio.create_subprocess_exec(UIBUS, "acp", "--target", f"127.0.0.1:{app.port}", stdin=stdin,
                                                    stdout=stdout, stderr=asyncio.subprocess.PIPE)
        _, err = await asyncio.wait_for(proc.communicate(), 60)
    assert proc.returncode == 0, err.decode()
    got = {a["id"]: a for a in lines(answers.read_text())}
    assert sorted(got) == [1, 2, 3], got  # every request answered, none cancelled
    assert got[1]["result"]["agentInfo"]["name"] == "uibus"
    session = got[2]["result"]["sessionId"]
    assert session.startswith("acp-") and "result" in got[3], got


async def test_acp_over_pipes_answers_every_request_read_before_the_input_ended(app: App, tmp_path: Path) -> None:
    """`cat init.json | uibus acp | cat` prints the answers; a prompt still running when the input
    ends is answered (its turn finishes), not cancelled."""
    requests = tmp_path / "init.json"
    requests.write_text(INIT + LIST)
    shell = await asyncio.create_subprocess_exec(
        "bash", "-c", 'cat "$1" | "$2" acp --target "$3" | cat', "sh", str(requests), UIBUS,
        f"127.0.0.1:{app.port}", stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
    out, err = await asyncio.wait_for(shell.communicate(), 60)
    assert shell.returncode == 0, err.decode()
    assert sorted(a["id"] for a in lines(out.decode())) == [1, 3], out

    proc = await asyncio.create_subprocess_exec(UIBUS, "acp", "--agent", "slow", "--target", f"127.0.0.1:{app.port}",
                                                stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE)
    assert proc.stdin is not None and proc.stdout is not None
    proc.stdin.write((INIT + NEW).encode())
    first = [json.loads(await asyncio.wait_for(proc.stdout.readline(), 30)) for _ in range(2)]
    session = next(a["result"]["sessionId"] for a in first if a["id"] == 2)
    proc.stdin.write(acp(4, "session/prompt", sessionId=session, prompt=[{"type": "text", "text": "go"}]).encode())
    proc.stdin.close()  # at once: the turn (8 pieces, 150 ms apart) is still running when the input ends
    rest, _ = await asyncio.wait_for(proc.communicate(), 60)
    assert proc.returncode == 0
    messages = lines(rest.decode())
    chunks = "".join(m["params"]["update"]["content"]["text"] for m in messages
                     if m.get("method") == "session/update"
                     and m["params"]["update"]["sessionUpdate"] == "agent_message_chunk")
    assert chunks == 'Hello from slow! You said: "go". This is the start of our conversation.', messages
    (answer,) = [m for m in messages if m.get("id") == 4]
    assert answer["result"]["stopReason"] == "end_turn", answer


async def test_acp_on_a_terminal(app: App) -> None:
    """stdin and stdout a terminal, as when a person runs `uibus acp` by hand; Ctrl-D ends it."""
    master, slave = pty.openpty()
    attrs = termios.tcgetattr(slave)
    attrs[3] &= ~termios.ECHO  # the terminal does not echo what is typed back
    termios.tcsetattr(slave, termios.TCSANOW, attrs)
    try:
        proc = await asyncio.create_subprocess_exec(UIBUS, "acp", "--target", f"127.0.0.1:{app.port}", stdin=slave,
                                                    stdout=slave, stderr=asyncio.subprocess.PIPE)
    finally:
        os.close(slave)
    loop = asyncio.get_running_loop()
    try:
        os.write(master, INIT.encode())
        buffer = b""
        while b"\n" not in buffer:
            buffer += await asyncio.wait_for(loop.run_in_executor(None, os.read, master, 65536), 30)
        answer = json.loads(buffer.split(b"\n")[0])
        assert answer["id"] == 1 and answer["result"]["agentInfo"]["name"] == "uibus", answer
        os.write(master, b"\x04")  # Ctrl-D at the start of a line: the end of input
        assert await asyncio.wait_for(proc.wait(), 30) == 0
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
        os.close(master)


async def test_acp_refuses_an_unknown_agent_at_session_new_listing_the_known_ones(app: App) -> None:
    proc = await asyncio.create_subprocess_exec(UIBUS, "acp", "--agent", "pi", "--target", f"127.0.0.1:{app.port}",
                                                stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE)
    out, _ = await asyncio.wait_for(proc.communicate((INIT + NEW).encode()), 60)
    got = {a["id"]: a for a in lines(out.decode())}
    assert "result" in got[1], got  # initialize still works: an editor learns of the agent at session/new
    error = got[2]["error"]
    assert error["code"] == -32002, error
    assert "agent 'pi' is not served here" in error["message"], error
    assert all(name in error["message"] for name in ("hello_world", "slow", "down", "liar")), error


async def test_mcp_tells_a_failed_turn_as_a_tool_error(web: App) -> None:
    """The marker reaches every door: over /mcp the failed turn is a tool error with its text once."""
    from tests.test_mcp import chat_args, mcp_client

    async with mcp_client(web) as client:
        failed = await client.call_tool("down", chat_args("hi"))
        fine = await client.call_tool("liar", chat_args("hi"))
    assert failed.is_error is True and failed.content[0].text.startswith("Error from down: "), failed
    assert failed.content[0].text.count("Error from down") == 1, failed
    assert failed.structured_content["structure"]["tool"] == "down", failed
    assert fine.is_error is False and fine.content[0].text.startswith("Error from liar: not really."), fine
