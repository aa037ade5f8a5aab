"""`uibus chat [agent]`: talk to a neuro-san agent served by uibus, the reply printed as it streams.

    uibus chat hello_world                 # interactive; one line per message, Ctrl-D ends
    echo "hi" | uibus chat hello_world     # one turn per stdin line
    uibus chat -m "hi" -m "and again"      # the given messages, then exit (default agent)

The conversation lives on the server, in the session (`--session`), so a later `uibus chat` — or
a webview of the same session — continues it; `--new` starts over. The reply is asked for with
the MAXIMAL filter so its pieces can be printed as they arrive.

When the agent fails a turn, the error goes to stderr and `uibus chat` exits 1 (at once, unless
interactive: then at the end); the reply on stdout is only ever the agent's answer.
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


class AgentFailed(Exception):
    """The agent failed the turn: the server's final message says so (its `structure.error`)."""


def failure_of(message: chat_pb2.ChatMessage) -> str:
    """The failure a turn's final message reports ("" for an answer). uibus marks a failed turn's
    final message with `structure.error` (uibus.domain.chat), so a reply that merely starts with
    "Error from" is still an answer."""
    if not message.HasField("structure"):
        return ""
    found = message.structure.fields.get("error")
    if found is None:
        return ""
    return found.string_value or message.text or "the agent failed"


async def one_turn(call: grpc.aio.UnaryStreamMultiCallable, text: str, *, new: bool, sly_data: dict[str, Any],
                   out: Any, verbose: bool) -> str:
    """Sends one message and prints the reply as it streams; returns the whole answer. A failed
    turn raises AgentFailed (after what streamed before the failure, ended with a newline)."""
    request = agent_pb2.ChatRequest(user_message=chat_pb2.ChatMessage(type=chat_pb2.ChatMessage.HUMAN, text=text),
                                    chat_filter=agent_pb2.ChatFilter(chat_filter_type=agent_pb2.MAXIMAL))
    if new:
        request.chat_context.SetInParent()  # an empty context: the server starts the conversation over
    if sly_data:
        request.sly_data.update(sly_data)
    streamed = False
    answer, failed = "", ""
    async for response in call(request):
        message = response.response
        if message.type == _AI:
            out.write(message.text)
            out.flush()
            streamed = True
        elif message.type == _FRAMEWORK:
            failed = failure_of(message)
            answer = message.text
            if not streamed and not failed:
                out.write(answer)
        elif verbose and message.text:
            print(f"[{chat_pb2.ChatMessage.ChatMessageType.Name(message.type)}] {message.text}", file=sys.stderr)
    if streamed or not failed:
        out.write("\n")
    out.flush()
    if failed:
        raise AgentFailed(failed)
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
        new, failed = ns.new, False
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
                return 1 if failed else 0
            if not text.strip():
                continue
            try:
                await one_turn(call, text, new=new, sly_data=sly_data, out=sys.stdout, verbose=ns.verbose)
            except AgentFailed as exc:
                print(f"uibus chat: {exc}", file=sys.stderr, flush=True)
                if not interactive:  # a script's next message would build on a turn that failed
                    return 1
                failed = True
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
