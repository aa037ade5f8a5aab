"""uibus as the real clients see it: the neuro-san client library (0.5.68, its last gRPC release,
from .venv-neurosan made by .ci/setup) and the `uibus chat` command, each against a uibus server
process."""

from __future__ import annotations

import asyncio
import json
import sys
from pathlib import Path

from conftest import REPO, require

NEUROSAN_PY = REPO / ".venv-neurosan" / "bin" / "python"
SCRIPT = Path(__file__).parent / "scripts" / "neurosan_client.py"
UIBUS = Path(sys.executable).parent / "uibus"


async def _run(*cmd: str, stdin: bytes = b"", timeout: float = 120) -> tuple[int, str, str]:
    proc = await asyncio.create_subprocess_exec(*cmd, stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE,
                                                stderr=asyncio.subprocess.PIPE, cwd=REPO)
    out, err = await asyncio.wait_for(proc.communicate(stdin), timeout)
    assert proc.returncode is not None
    return proc.returncode, out.decode(), err.decode()


async def test_the_real_neuro_san_grpc_client_works_against_uibus(spawn):
    require(".venv-neurosan with neuro-san==0.5.68 (made by .ci/setup)", NEUROSAN_PY.exists())
    server = spawn()
    await server.wait_ready()
    code, out, err = await _run(str(NEUROSAN_PY), str(SCRIPT), "127.0.0.1", str(server.port), "hello_world")
    assert code == 0, err[-3000:]
    seen = json.loads(out.strip().splitlines()[-1])

    assert "deterministic local agent" in seen["function"]["function"]["description"]
    assert seen["connectivity"]["connectivity_info"][0]["origin"] == "hello_world"
    assert [a["agent_name"] for a in seen["list"]["agents"]] == ["hello_world"]

    # MINIMAL: only the final AGENT_FRAMEWORK message, sly_data reached the agent.
    [only] = seen["minimal"]
    assert set(only) == {"response"}
    assert only["response"]["type"] == "AGENT_FRAMEWORK"
    assert 'You said: "my name is Ada"' in only["response"]["text"]
    assert "sly_data keys: token." in only["response"]["text"]

    # MAXIMAL, with the chat_context the client carried forward: every message, request echoed.
    maximal = seen["maximal"]
    assert [m["response"]["type"] for m in maximal] == ["AGENT_PROGRESS"] + ["AI"] * 8 + ["AGENT_FRAMEWORK"]
    assert all(m["request"]["user_message"]["text"] == "what is my name?" for m in maximal)
    assert all(m["response"]["origin"][0]["tool"] == "hello_world" for m in maximal[:-1])
    final = maximal[-1]["response"]
    assert 'Earlier you said: "my name is Ada" (this is turn 2).' in final["text"]
    assert "".join(m["response"]["text"] for m in maximal[1:-1]) == final["text"]
    texts = [m["text"] for m in final["chat_context"]["chat_histories"][0]["messages"]]
    assert texts[0::2] == ["my name is Ada", "what is my name?"]

    # An empty chat_context from the client starts over (the client's context wins over the stored one).
    assert "This is the start of our conversation." in seen["fresh"][-1]["response"]["text"]


async def test_uibus_chat_streams_replies_and_keeps_the_conversation(spawn):
    server = spawn()
    await server.wait_ready()
    target = ("--target", server.target, "--session", "cli")
    code, out, err = await _run(str(UIBUS), "chat", "hello_world", *target, stdin=b"first line\n\nsecond line\n")
    assert code == 0, err
    replies = out.splitlines()
    assert len(replies) == 2
    assert replies[0] == 'Hello from hello_world! You said: "first line". This is the start of our conversation.'
    assert 'Earlier you said: "first line" (this is turn 2).' in replies[1]
    # A later run continues the session's conversation; --new starts over; -m sends and exits.
    code, out, _ = await _run(str(UIBUS), "chat", *target, "-m", "third")
    assert code == 0 and 'Earlier you said: "second line" (this is turn 3).' in out
    code, out, _ = await _run(str(UIBUS), "chat", *target, "--new", "-m", "anew", "-m", "more",
                              "--sly-data", '{"chunks": 3}')
    lines = out.splitlines()
    assert "start of our conversation" in lines[0] and "sly_data keys: chunks." in lines[0]
    assert 'Earlier you said: "anew"' in lines[1]
    code, _, err = await _run(str(UIBUS), "chat", "nope", *target, "-m", "hi")
    assert code == 1 and "UNIMPLEMENTED" in err and "hello_world" in err
    code, _, err = await _run(str(UIBUS), "chat", *target, "--sly-data", "[1]", "-m", "hi")
    assert code == 2 and "JSON object" in err


async def test_uibus_chat_prints_pieces_as_they_arrive(spawn):
    server = spawn()
    await server.wait_ready()
    proc = await asyncio.create_subprocess_exec(
        str(UIBUS), "chat", "--target", server.target, "-m", "slowly", "--sly-data", '{"chunks": 4, "delay_ms": 300}',
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE, cwd=REPO)
    assert proc.stdout is not None
    first = await asyncio.wait_for(proc.stdout.read(1), 30)
    loop = asyncio.get_running_loop()
    first_at = loop.time()
    rest = await asyncio.wait_for(proc.stdout.readline(), 30)
    # Three 300 ms pauses separate the first piece from the last: it was not printed all at once.
    assert loop.time() - first_at > 0.5
    assert (first + rest).decode().startswith('Hello from hello_world! You said: "slowly".')
    assert await asyncio.wait_for(proc.wait(), 30) == 0
