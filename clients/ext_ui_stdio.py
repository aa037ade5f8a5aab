"""`uibus ext-ui-stdio`: an RPC-mode extension-UI client on stdin/stdout, bridged to uibus.

Connects to the server as a UI of one session (ExtensionUiService.Subscribe) and speaks pi's RPC
extension-UI protocol (JSON lines; the "Extension UI Protocol" of `docs/rpc.md` in pi's npm package
`@mariozechner/pi-coding-agent`), so a UI written for the RPC mode works unchanged:

* every request becomes one `{"type":"extension_ui_request","id":…,"method":…}` line on stdout,
  with pi's field names, and optional fields left out when unset (`statusText` absent
  clears a status, `timeout` only when the dialog has one);
* every `{"type":"extension_ui_response","id":…,"value"|"confirmed"|"cancelled":…}` line on
  stdin becomes a Respond call.

Framing is strict LF: lines are split on b"\\n" only (one trailing CR is dropped), so U+2028 and
U+2029 inside a JSON string never end a line; on output they are written escaped, so readers
that do treat them as line breaks are safe too. A line that cannot be used gets an
`{"type":"extension_ui_error",…}` line back and the bridge carries on. `--close-events` also
writes `{"type":"extension_ui_closed","id":…,"reason":…}` when a dialog is answered elsewhere,
times out or is cancelled by the agent (not part of pi's protocol, hence off by default).

Exit: 0 when stdin ends (the UI went away), 1 when the server ends the stream.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import threading
from collections.abc import Callable
from typing import Any, BinaryIO

import grpc

from uibus.clients.connection import Connection
from uibus.pb.uibus.v1 import extension_ui_pb2 as pb
from uibus.pb.uibus.v1 import extension_ui_pb2_grpc

MAX_LINE_BYTES = 8 * 1024 * 1024  # a 1 Mi-character editor answer, escaped, fits
_NOTIFY_TYPES = {pb.NOTIFY_TYPE_INFO: "info", pb.NOTIFY_TYPE_WARNING: "warning", pb.NOTIFY_TYPE_ERROR: "error"}
_PLACEMENTS = {pb.WIDGET_PLACEMENT_ABOVE_EDITOR: "aboveEditor", pb.WIDGET_PLACEMENT_BELOW_EDITOR: "belowEditor"}
_REASONS = {pb.DIALOG_OUTCOME_ANSWERED: "answered", pb.DIALOG_OUTCOME_CANCELLED: "cancelled",
            pb.DIALOG_OUTCOME_TIMED_OUT: "timed_out", pb.DIALOG_OUTCOME_CALLER_CANCELLED: "caller_cancelled",
            pb.DIALOG_OUTCOME_SHUTDOWN: "shutdown"}


def request_json(req: pb.ExtensionUiRequest) -> dict[str, Any] | None:
    """pi's `extension_ui_request` object for `req` (None for a method it does not know)."""
    method = req.WhichOneof("method")
    out: dict[str, Any] = {"type": "extension_ui_request", "id": req.id}
    if method == "select":
        r: Any = req.select
        out.update(method="select", title=r.title, options=list(r.options))
    elif method == "confirm":
        r = req.confirm
        out.update(method="confirm", title=r.title, message=r.message)
    elif method == "input":
        r = req.input
        out.update(method="input", title=r.title)
        if r.HasField("placeholder"):
            out["placeholder"] = r.placeholder
    elif method == "editor":
        r = req.editor
        out.update(method="editor", title=r.title)
        if r.HasField("prefill"):
            out["prefill"] = r.prefill
    elif method == "notify":
        out.update(method="notify", message=req.notify.message)
        if req.notify.notify_type in _NOTIFY_TYPES:
            out["notifyType"] = _NOTIFY_TYPES[req.notify.notify_type]
        return out
    elif method == "set_status":
        out.update(method="setStatus", statusKey=req.set_status.key)
        if req.set_status.HasField("text"):
            out["statusText"] = req.set_status.text
        return out
    elif method == "set_widget":
        w = req.set_widget
        out.update(method="setWidget", widgetKey=w.key)
        if w.lines:
            out["widgetLines"] = list(w.lines)
        if w.placement in _PLACEMENTS:
            out["widgetPlacement"] = _PLACEMENTS[w.placement]
        return out
    elif method == "set_title":
        out.update(method="setTitle", title=req.set_title.title)
        return out
    elif method == "set_editor_text":
        out.update(method="set_editor_text", text=req.set_editor_text.text)
        return out
    else:
        return None
    if r.HasField("timeout_ms"):  # dialogs only
        out["timeout"] = r.timeout_ms
    return out


def encode(obj: dict[str, Any]) -> bytes:
    """One compact JSON line; U+2028/U+2029 escaped so no reader can mistake them for a break."""
    text = json.dumps(obj, ensure_ascii=False, separators=(",", ":"))
    return (text.replace("\u2028", "\\u2028").replace("\u2029", "\\u2029") + "\n").encode()


def error_json(message: str, **extra: Any) -> dict[str, Any]:
    return {"type": "extension_ui_error", **extra, "error": message}


def parse_response(raw: bytes) -> pb.RespondRequest | str | None:
    """A Respond request from one stdin line (without its LF), an error message, or None to skip."""
    if raw.endswith(b"\r"):
        raw = raw[:-1]
    if not raw.strip():
        return None  # blank lines are allowed between messages
    try:
        obj = json.loads(raw.decode("utf-8"))
    except UnicodeDecodeError as exc:
        return f"line is not UTF-8: {exc}"
    except ValueError as exc:
        return f"line is not JSON: {exc}"
    if not isinstance(obj, dict):
        return "line must be a JSON object"
    if obj.get("type") != "extension_ui_response":
        return f'type must be "extension_ui_response", not {obj.get("type")!r}'
    dialog_id = obj.get("id")
    if not isinstance(dialog_id, str) or not dialog_id:
        return "id must be the non-empty id of the extension_ui_request being answered"
    if obj.get("cancelled") is True:
        return pb.RespondRequest(id=dialog_id, cancelled=True)
    if "confirmed" in obj:
        if not isinstance(obj["confirmed"], bool):
            return "confirmed must be true or false"
        return pb.RespondRequest(id=dialog_id, confirmed=obj["confirmed"])
    if "value" in obj:
        if not isinstance(obj["value"], str):
            return "value must be a string"
        return pb.RespondRequest(id=dialog_id, value=obj["value"])
    return "a response needs value, confirmed or cancelled: true"


TOO_LONG = b"\x00too-long"  # marker handed over in place of an overlong line


def split_lines(fd: int, deliver: Callable[[bytes | None], None], max_bytes: int = MAX_LINE_BYTES) -> None:
    """Reader thread: hands over each line without its LF (TOO_LONG for an overlong one), then
    None at end of input.

    Reads the raw descriptor with os.read, not sys.stdin.buffer: a daemon thread blocked inside
    a buffered reader holds its lock and makes interpreter shutdown abort.
    """
    pending = bytearray()
    skipping = False  # inside an overlong line, waiting for its LF
    while chunk := os.read(fd, 65536):
        start = 0
        while (end := chunk.find(b"\n", start)) >= 0:
            if skipping:
                skipping = False
            elif len(pending) + end - start > max_bytes:
                deliver(TOO_LONG)
            else:
                pending += chunk[start:end]
                deliver(bytes(pending))
            pending.clear()
            start = end + 1
        if not skipping:
            pending += chunk[start:]
            if len(pending) > max_bytes:
                deliver(TOO_LONG)
                pending.clear()
                skipping = True
    if pending and not skipping:
        deliver(bytes(pending))  # a last line without LF still counts
    deliver(None)


class Bridge:
    def __init__(self, conn: Connection, stdin: BinaryIO, stdout: BinaryIO, close_events: bool = False) -> None:
        self.stub = extension_ui_pb2_grpc.ExtensionUiServiceStub(conn.channel)
        self.stdin = stdin
        self.stdout = stdout
        self.close_events = close_events

    def write(self, obj: dict[str, Any]) -> None:
        self.stdout.write(encode(obj))
        self.stdout.flush()

    async def pump(self) -> None:
        """Server events -> stdout lines, until the server ends the stream."""
        async for event in self.stub.Subscribe(pb.SubscribeRequest()):
            if event.HasField("request"):
                obj = request_json(event.request)
                if obj is not None:
                    self.write(obj)
            elif self.close_events and event.HasField("closed"):
                self.write({"type": "extension_ui_closed", "id": event.closed.id,
                            "reason": _REASONS.get(event.closed.reason, "closed")})

    async def answer(self) -> None:
        """stdin lines -> Respond calls, in order, until stdin ends."""
        loop = asyncio.get_running_loop()
        lines: asyncio.Queue[bytes | None] = asyncio.Queue()
        # A daemon thread rather than the default executor, so a blocked read never delays exit.

        def deliver(line: bytes | None) -> None:
            try:
                loop.call_soon_threadsafe(lines.put_nowait, line)
            except RuntimeError:  # the loop is closed: the bridge is exiting (the server went away)
                pass

        threading.Thread(target=split_lines, args=(self.stdin.fileno(), deliver), daemon=True,
                         name="stdin").start()
        while (raw := await lines.get()) is not None:
            if raw is TOO_LONG:
                self.write(error_json(f"line is longer than {MAX_LINE_BYTES} bytes"))
                continue
            parsed = parse_response(raw)
            if parsed is None:
                continue
            if isinstance(parsed, str):
                self.write(error_json(parsed, line=raw[:200].decode("utf-8", "replace")))
                continue
            try:
                await self.stub.Respond(parsed)
            except grpc.aio.AioRpcError as exc:
                self.write(error_json(exc.details() or "", id=parsed.id, code=exc.code().name))

    async def run(self) -> int:
        pump = asyncio.ensure_future(self.pump())
        answer = asyncio.ensure_future(self.answer())
        done, _ = await asyncio.wait((pump, answer), return_when=asyncio.FIRST_COMPLETED)
        if answer in done:
            pump.cancel()
            await asyncio.gather(pump, return_exceptions=True)
            answer.result()
            return 0
        answer.cancel()
        await asyncio.gather(answer, return_exceptions=True)
        exc = pump.exception()
        if isinstance(exc, grpc.aio.AioRpcError):
            print(f"uibus ext-ui-stdio: {exc.code().name}: {exc.details()}", file=sys.stderr)
        elif exc is not None:
            raise exc
        else:
            print("uibus ext-ui-stdio: the server ended the stream", file=sys.stderr)
        return 1


async def _main(ns: argparse.Namespace) -> int:
    async with Connection(ns.target, session=ns.session, token=ns.token, tls=ns.tls) as conn:
        return await Bridge(conn, sys.stdin.buffer, sys.stdout.buffer, ns.close_events).run()


def _run(ns: argparse.Namespace) -> int:
    try:
        return asyncio.run(_main(ns))
    except KeyboardInterrupt:
        return 130


def add_command(sub: argparse._SubParsersAction,  # type: ignore[type-arg]
                client_options: Callable[[argparse.ArgumentParser], None]) -> None:
    """Registers `uibus ext-ui-stdio` (see clients.cli.EXTRA_COMMANDS)."""
    p = sub.add_parser("ext-ui-stdio", help="be an extension UI on stdin/stdout (the RPC mode's JSON lines)",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--close-events", action="store_true",
                   help='also write {"type":"extension_ui_closed","id","reason"} lines (not in pi\'s protocol)')
    client_options(p)
    p.set_defaults(func=_run)
