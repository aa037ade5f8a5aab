"""`uibus chat [agent]`: talk to a neuro-san agent served by uibus, the reply printed as it streams.

    uibus chat hello_world                 # interactive; one line per message, Ctrl-D ends
    echo "hi" | uibus chat hello_world     # one turn per stdin line
    uibus chat -m "hi" -m "and again"      # the given messages, then exit (default agent)

The conversation lives on the server, in the session (`--session`), so a later `uibus chat` — or
a webview of the same session — continues it; `--new` starts over. The reply is asked for with
the MAXIMAL filter so its pieces can be printed as they arrive.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from collections.abc import Callable
from typing import Any

import grpc

from uibus.clients.connection import Connection
from uibus.pb.neuro_san.api.grpc import agent_pb2, chat_pb2

CANONICAL = agent_pb2.DESCRIPTOR.services_by_name["AgentService"].full_name
_AI = chat_pb2.ChatMessage.AI
_FRAMEWORK = chat_pb2.ChatMessage.AGENT_FRAMEWORK


def streaming_chat(conn: Connection, agent: str) -> grpc.aio.UnaryStreamMultiCallable:
    """StreamingChat of `agent` at the path neuro-san clients use (canonical path when empty)."""
    service = f"{agent}.AgentService" if agent else CANONICAL
    return conn.channel.unary_stream(f"/{service}/StreamingChat",
                                     request_serializer=agent_pb2.ChatRequest.SerializeToString,
                                     response_deserializer=agent_pb2.ChatResponse.FromString)


async def one_turn(call: grpc.aio.UnaryStreamMultiCallable, text: str, *, new: bool, sly_data: dict[str, Any],
                   out: Any, verbose: bool) -> str:
    """Sends one message and prints the reply as it streams; returns the whole answer."""
    request = agent_pb2.ChatRequest(user_message=chat_pb2.ChatMessage(type=chat_pb2.ChatMessage.HUMAN, text=text),
                                    chat_filter=agent_pb2.ChatFilter(chat_filter_type=agent_pb2.MAXIMAL))
    if new:
        request.chat_context.SetInParent()  # an empty context: the server starts the conversation over
    if sly_data:
        request.sly_data.update(sly_data)
    streamed = False
    answer = ""
    async for response in call(request):
        message = response.response
        if message.type == _AI:
            out.write(message.text)
            out.flush()
            streamed = True
        elif message.type == _FRAMEWORK:
            answer = message.text
            if not streamed:
                out.write(answer)
        elif verbose and message.text:
            print(f"[{chat_pb2.ChatMessage.ChatMessageType.Name(message.type)}] {message.text}", file=sys.stderr)
    out.write("\n")
    out.flush()
    return answer


async def run(ns: argparse.Namespace) -> int:
    try:
        sly_data = json.loads(ns.sly_data) if ns.sly_data else {}
    except ValueError as exc:
        print(f"uibus chat: --sly-data is not JSON: {exc}", file=sys.stderr)
        return 2
    if not isinstance(sly_data, dict):
        print("uibus chat: --sly-data must be a JSON object", file=sys.stderr)
        return 2
    interactive = not ns.message and sys.stdin.isatty()
    loop = asyncio.get_running_loop()
    async with Connection(ns.target, session=ns.session, token=ns.token, tls=ns.tls) as conn:
        call = streaming_chat(conn, ns.agent)
        new = ns.new
        messages = iter(ns.message) if ns.message else None
        while True:
            if messages is not None:
                text = next(messages, None)
            else:
                if interactive:
                    print("you> ", end="", file=sys.stderr, flush=True)
                line = await loop.run_in_executor(None, sys.stdin.readline)
                text = line.rstrip("\n") if line else None
            if text is None:
                return 0
            if not text.strip():
                continue
            await one_turn(call, text, new=new, sly_data=sly_data, out=sys.stdout, verbose=ns.verbose)
            new = False


def add_parser(sub: argparse._SubParsersAction,  # type: ignore[type-arg]
               client_options: Callable[[argparse.ArgumentParser], None]) -> None:
    p = sub.add_parser("chat", help="chat with a neuro-san agent; replies stream as they arrive",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("agent", nargs="?", default="", help="agent name (default: the server's default agent)")
    p.add_argument("-m", "--message", action="append", default=[], help="send this message (repeatable) and exit")
    p.add_argument("--new", action="store_true", help="start a new conversation instead of continuing the session's")
    p.add_argument("--sly-data", default="", help="JSON object passed to the agent as sly_data")
    p.add_argument("-v", "--verbose", action="store_true", help="also show progress and other agent messages")
    client_options(p)
    p.set_defaults(func=_command)


def _command(ns: argparse.Namespace) -> int:
    try:
        return asyncio.run(run(ns))
    except KeyboardInterrupt:
        return 130
    except grpc.aio.AioRpcError as exc:
        print(f"uibus chat: {exc.code().name}: {exc.details()}", file=sys.stderr)
        return 1
