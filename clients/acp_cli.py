"""`uibus acp`: uibus as an ACP agent an editor spawns (Zed's `agent_servers`, JetBrains' `acp.json`,
CodeCompanion, any Agent Client Protocol client).

    uibus acp --agent pi                                  # a local uibus, the agent `pi`
    uibus acp --agent claude --target uibus.example:443 --tls --token "$UIBUS_TOKEN"

It speaks ACP (JSON-RPC 2.0, one message per line) on stdin/stdout and gRPC to a uibus, local or
remote, through the same channel `uibus chat` uses; logs go to stderr, never stdout. Each ACP
session is a uibus session (its sessionId is the session name), shared with every other UI of
it: the page, a phone, another editor, a neuro-san client. Everything but the framing lives in
uibus.edge.editors, which `/acp` on the HTTP port serves too.

stdin and stdout may be pipes, a terminal or files (`uibus acp < requests.jsonl > answers.txt`).
When the input ends, every request read before it is still answered (a running prompt finishes its
turn), then uibus acp exits: `cat init.json | uibus acp | cat` prints the answers. `--agent` names
an agent the server has; one it has not is refused at `session/new`, naming those it has.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import stat
import sys
from collections.abc import AsyncIterator, Awaitable, Callable

from uibus.clients.connection import Connection
from uibus.edge.editors.account import Identity
from uibus.edge.editors.agent import DEFAULT_PREFIX, Editor, check_prefix
from uibus.edge.editors.uplink import Uplink
from uibus.infra import logs
from uibus.infra.errors import InvalidArgument
from uibus.infra.jsonrpc import INVALID_REQUEST, RpcError
from uibus.infra.tasks import cancel_and_wait

MAX_LINE = 16 * 1024 * 1024  # one incoming message at most this long; a longer one is refused
CHUNK = 64 * 1024  # what one read of a stdin that is a file takes


def _is_stream(fd: int) -> bool:
    """Whether asyncio's pipe transports take `fd` (a pipe, a socket, a terminal or another
    character device); a regular file is not one (`uibus acp < in.json > out.txt`)."""
    mode = os.fstat(fd).st_mode
    return stat.S_ISFIFO(mode) or stat.S_ISSOCK(mode) or stat.S_ISCHR(mode)


class _FileFeed:
    """Feeds a StreamReader from a file that is no pipe, a chunk at a time in a thread (reading a
    file never waits for a writer), paused and resumed by the reader's own flow control as a pipe
    transport is: the reader calls `pause_reading` once it holds twice its limit."""

    def __init__(self, fd: int, reader: asyncio.StreamReader) -> None:
        self.fd = fd
        self.reader = reader
        self._go = asyncio.Event()
        self._go.set()
        reader.set_transport(self)  # type: ignore[arg-type]

    def pause_reading(self) -> None:
        self._go.clear()

    def resume_reading(self) -> None:
        self._go.set()

    async def run(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            await self._go.wait()
            data = await loop.run_in_executor(None, os.read, self.fd, CHUNK)
            if not data:
                self.reader.feed_eof()
                return
            self.reader.feed_data(data)


@contextlib.asynccontextmanager
async def _stdio() -> AsyncIterator[tuple[asyncio.StreamReader, Callable[[str], Awaitable[None]]]]:
    """Our stdin as a StreamReader and a `write` of one line to our stdout, whatever they are:
    pipes and terminals through asyncio's pipe transports, files read in a thread and written
    directly. Every line is out of our hands (in the pipe, in the file) when `write` returns, so
    nothing written is lost when the process ends."""
    loop = asyncio.get_running_loop()
    reader = asyncio.StreamReader(limit=MAX_LINE)
    stdin, stdout = sys.stdin.fileno(), sys.stdout.fileno()
    async with contextlib.AsyncExitStack() as stack:
        if _is_stream(stdin):
            await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader), sys.stdin)
        else:
            feed = loop.create_task(_FileFeed(stdin, reader).run(), name="uibus acp stdin")
            stack.push_async_callback(cancel_and_wait, feed)
        if _is_stream(stdout):
            transport, protocol = await loop.connect_write_pipe(asyncio.streams.FlowControlMixin, sys.stdout)
            transport.set_write_buffer_limits(high=0)  # drain() returns once the line is in the pipe
            writer = asyncio.StreamWriter(transport, protocol, None, loop)
            stack.callback(transport.close)

            async def write(line: str) -> None:
                writer.write(line.encode() + b"\n")
                await writer.drain()
        else:
            out = sys.stdout.buffer

            async def write(line: str) -> None:  # a file: written at once, as a log line is
                out.write(line.encode() + b"\n")
                out.flush()
        yield reader, write


async def _skip_line(reader: asyncio.StreamReader) -> bool:
    """Drops the rest of an overlong line; False at the end of input."""
    while True:
        try:
            await reader.readuntil(b"\n")
            return True
        except asyncio.LimitOverrunError as exc:
            await reader.readexactly(exc.consumed)
        except asyncio.IncompleteReadError:
            return False


async def serve(ns: argparse.Namespace) -> int:
    async with _stdio() as (reader, write), Connection(ns.target, token=ns.token, tls=ns.tls) as conn:
        editor = Editor(Uplink(conn.channel, ns.agent), write, prefix=ns.session_prefix,  # type: ignore[arg-type]
                        identity=Identity(token=bool(ns.token)))

        async def line() -> bytes | None:
            """The next message: one line (framing only); None once the editor closed our stdin."""
            while True:
                try:
                    found = await reader.readuntil(b"\n")
                except asyncio.IncompleteReadError as exc:  # the editor closed our stdin (or the file ended)
                    if exc.partial.strip():
                        return exc.partial
                    # Every request read is answered before the end (`cat requests | uibus acp`).
                    await editor.peer.finish("the editor closed uibus acp's input")
                    return None
                except asyncio.LimitOverrunError:
                    await editor.send(RpcError(INVALID_REQUEST,
                                               f"a message longer than {MAX_LINE} bytes was dropped").answer())
                    if not await _skip_line(reader):
                        await editor.peer.finish("the editor closed uibus acp's input")
                        return None
                    continue
                if found.strip():
                    return found

        await editor.serve(line)  # the one receive loop (uibus.infra.peer), then the editor's end
    return 0


def _command(ns: argparse.Namespace) -> int:
    try:
        check_prefix(ns.session_prefix)
    except InvalidArgument as exc:
        print(f"uibus acp: --session-prefix: {exc}", file=sys.stderr)
        return 2
    logs.setup(ns.log_level)
    try:
        return asyncio.run(serve(ns))
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:
        return 0  # the editor went away


def add_parser(sub: argparse._SubParsersAction,  # type: ignore[type-arg]
               client_options: Callable[[argparse.ArgumentParser], None]) -> None:
    p = sub.add_parser("acp", help="serve a uibus agent to an editor over ACP (stdio)", description=__doc__,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--agent", default=os.environ.get("UIBUS_AGENT", ""),
                   help="the agent a prompt runs (env UIBUS_AGENT; default: the server's default agent)")
    p.add_argument("--session-prefix", default=os.environ.get("UIBUS_SESSION_PREFIX", DEFAULT_PREFIX),
                   help="how the sessions session/new makes are named, e.g. team-a- for a token that may use "
                        "team-a-* (env UIBUS_SESSION_PREFIX; default acp-)")
    p.add_argument("--log-level", default=os.environ.get("UIBUS_LOG_LEVEL", "warning"),
                   help="stderr log level (env UIBUS_LOG_LEVEL)")
    # The client options of the other commands but --session: each ACP session is a uibus session.
    p.add_argument("--target", default=os.environ.get("UIBUS_TARGET", "localhost:26040"),
                   help="server address (env UIBUS_TARGET)")
    p.add_argument("--token", default=os.environ.get("UIBUS_TOKEN", ""), help="bearer token (env UIBUS_TOKEN)")
    p.add_argument("--tls", action="store_true", default=os.environ.get("UIBUS_TLS", "") not in ("", "0", "false"),
                   help="connect with TLS (env UIBUS_TLS=1)")
    p.set_defaults(func=_command)
