"""Drives a uibus server's HTTP port with the REAL neuro-san 0.7 client library (run with
.venv-neurosan07's python, Python 3.12): its MCP session (`/mcp`) and its HTTP sessions (the
neuro-san HTTP API), each made by neuro-san's own factories exactly as its users make them.

Usage: python neurosan07_client.py HOST HTTP_PORT AGENT
Prints one JSON object with what the client saw; the pytest test asserts on it.
"""

import asyncio
import json
import sys

from neuro_san.client.agent_session_factory import AgentSessionFactory
from neuro_san.client.concierge_session_factory import ConciergeSessionFactory
from neuro_san.session.async_http_service_agent_session import AsyncHttpServiceAgentSession


def chat(session, text, chat_context=None):
    request = {"user_message": {"type": "HUMAN", "text": text}}
    if chat_context is not None:
        request["chat_context"] = chat_context
    return list(session.streaming_chat(request))


def two_turns(session):
    first = chat(session, "my name is Ada")
    # As neuro-san's own clients do: carry the returned chat_context into the next turn.
    second = chat(session, "what is my name?", chat_context=first[-1]["response"]["chat_context"])
    return first, second


async def async_turn(host, port, agent):
    session = AsyncHttpServiceAgentSession(host=host, port=port, agent_name=agent,
                                           metadata={"x-uibus-session": "ns07-async"})
    request = {"user_message": {"type": "HUMAN", "text": "hello from async"}}
    return [message async for message in session.streaming_chat(request)]


def main() -> None:
    host, port, agent = sys.argv[1], int(sys.argv[2]), sys.argv[3]
    factory = AgentSessionFactory()
    out = {}
    # A per-run uibus session each, so the server-side stored context cannot help the client.
    mcp = factory.create_session("mcp", agent, hostname=host, port=port,
                                 metadata={"x-uibus-session": "ns07-mcp"})
    out["mcp_function"] = mcp.function({})
    out["mcp_tool_name"] = mcp.advertised_tool_name
    out["mcp_first"], out["mcp_second"] = two_turns(mcp)
    http = factory.create_session("http", agent, hostname=host, port=port,
                                  metadata={"x-uibus-session": "ns07-http"})
    out["http_function"] = http.function({})
    out["http_first"], out["http_second"] = two_turns(http)
    out["async"] = asyncio.run(async_turn(host, port, agent))
    # As `ns chat` and nsflow call a server: no uibus session, a new chat sends no chat_context. Two
    # such clients, one after the other, must each start their own conversation.
    for way in ("http", "mcp"):
        out[f"unnamed_{way}"] = [chat(factory.create_session(way, agent, hostname=host, port=port), text)
                                 for text in ("my pin is 4321", "what is my pin?")]
    out["list"] = ConciergeSessionFactory().create_session("http", hostname=host, port=port).list({})
    print(json.dumps(out))


if __name__ == "__main__":
    main()
