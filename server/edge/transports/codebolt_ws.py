"""The WebSocket side of `/agent-to-app`: framing only, around the CodeBolt `Gateway`.

The upgrade is a call through the handler pipeline (`/codebolt.AgentToApp/connect`): the same
token check, session validation and shutdown refusal as every other call. The session is named
on the upgrade request (`?session=NAME`, else the `x-uibus-session` header, else "default"); the
query parameter is translated into that metadata key. A bad session name is answered on the
socket (success:false, then close 1008) so the agent learns why; any other refusal (no token,
shutting down) is an HTTP error with a JSON body `{"error", "code"}`, as on the HTTP API.
"""

from __future__ import annotations

from urllib.parse import parse_qs

import grpc

from uibus.edge.codebolt import protocol
from uibus.edge.codebolt.gateway import Gateway
from uibus.edge.transports.asgi import Receive, Scope, Send, error_body, http_status, refuse, respond
from uibus.edge.transports.grpcweb import metadata_of, peer_of
from uibus.infra.json_input import dump_json
from uibus.infra.session import SESSION_KEY

PATH = "/agent-to-app"
# Where the codeboltjs library itself connects (`ws://localhost:$SOCKET_PORT/codebolt?id=…`), so an
# unmodified agent works with SOCKET_PORT set to uibus's HTTP port (its session: "default").
CODEBOLTJS_PATH = "/codebolt"
_POLICY_VIOLATION = 1008
_GOING_AWAY = 1001


class SocketGone(Exception):
    """The agent's socket closed while a reply was being written."""


def _metadata(scope: Scope) -> tuple[tuple[str, str | bytes], ...]:
    """The upgrade's headers as call metadata, with `?session=` as the session key."""
    metadata = metadata_of(scope)
    names = parse_qs(scope.get("query_string", b"").decode("latin-1")).get("session")
    if names and names[0]:
        metadata = (*((k, v) for k, v in metadata if k != SESSION_KEY), (SESSION_KEY, names[0]))
    return metadata


async def _deny(scope: Scope, send: Send, code: grpc.StatusCode, details: str) -> None:
    """Refuses the upgrade with an HTTP status and a JSON body where the server can send one."""
    await refuse(scope, send, http_status(code), dump_json(error_body(code, details)), "application/json")


class AgentToApp:
    def __init__(self, gateway: Gateway) -> None:
        self.gateway = gateway

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "websocket":
            await respond(send, 426, f"{PATH} is a WebSocket endpoint: connect to ws://HOST:PORT{PATH}?session=NAME\n",
                          headers=[(b"upgrade", b"websocket"), (b"connection", b"upgrade")])
            return
        if (await receive())["type"] != "websocket.connect":
            return

        async def send_text(text: str) -> None:
            try:
                await send({"type": "websocket.send", "text": text})
            except Exception as exc:  # uvicorn raises its own disconnect errors / OSError
                raise SocketGone from exc

        async def close(code: int = _GOING_AWAY, reason: str = "uibus is shutting down") -> None:
            await send({"type": "websocket.close", "code": code, "reason": reason})

        conn, code, details = await self.gateway.open(_metadata(scope), peer_of(scope), send_text, close)
        if conn is None:
            if code != grpc.StatusCode.INVALID_ARGUMENT:
                await _deny(scope, send, code, details)
                return
            await send({"type": "websocket.accept"})
            await send({"type": "websocket.send", "text": protocol.response("", False, error=details,
                                                                            reply_type="error", code=code.name)})
            await send({"type": "websocket.close", "code": _POLICY_VIOLATION, "reason": "invalid session name"})
            return
        await send({"type": "websocket.accept"})
        try:
            while True:
                event = await receive()
                kind = event["type"]
                if kind == "websocket.disconnect":
                    break
                if kind != "websocket.receive":
                    continue
                text = event.get("text")
                if text is not None:
                    await conn.receive(text)
                else:
                    await conn.receive_bytes(event.get("bytes") or b"")
        finally:
            await conn.close()
