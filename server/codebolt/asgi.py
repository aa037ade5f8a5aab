"""The WebSocket side of `/agent-to-app`: a thin ASGI adapter around `Gateway`.

The session is named on the upgrade request (`?session=NAME` or the `x-uibus-session` header,
default "default"); with `--auth-token` the upgrade needs `authorization: Bearer <token>`.
A bad session name is answered on the socket (success:false, then close 1008) so the agent
learns why; a refused token gets a plain 403, like every other uibus endpoint.
"""

from __future__ import annotations

import contextlib
from urllib.parse import parse_qs

from uibus.codebolt import protocol
from uibus.codebolt.gateway import Gateway
from uibus.session import DEFAULT_SESSION, SESSION_KEY, BadSession, check_session
from uibus.web.asgi import Receive, Scope, Send, bearer_ok, header, respond

PATH = "/agent-to-app"
# Where the codeboltjs library itself connects (`ws://localhost:$SOCKET_PORT/codebolt?id=…`), so an
# unmodified agent works with SOCKET_PORT set to uibus's HTTP port (its session: "default").
CODEBOLTJS_PATH = "/codebolt"
_POLICY_VIOLATION = 1008
_GOING_AWAY = 1001


class SocketGone(Exception):
    """The agent's socket closed while a reply was being written."""


def session_from_scope(scope: Scope) -> str:
    """The session named by the upgrade request; BadSession when the name is invalid."""
    query = parse_qs(scope.get("query_string", b"").decode("latin-1"))
    names = query.get("session") or [header(scope, SESSION_KEY.encode())]
    return check_session(names[0]) if names[0] else DEFAULT_SESSION


class AgentToApp:
    def __init__(self, gateway: Gateway, auth_token: str = "") -> None:
        self.gateway = gateway
        self.auth_token = auth_token

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "websocket":
            await respond(send, 426, f"{PATH} is a WebSocket endpoint: connect to ws://HOST:PORT{PATH}?session=NAME\n",
                          headers=[(b"upgrade", b"websocket"), (b"connection", b"upgrade")])
            return
        if (await receive())["type"] != "websocket.connect":
            return
        if self.gateway.closing or not bearer_ok(self.auth_token, header(scope, b"authorization") or None):
            await send({"type": "websocket.close", "code": _POLICY_VIOLATION})  # before accept: HTTP 403
            return
        await send({"type": "websocket.accept"})
        try:
            session = session_from_scope(scope)
        except BadSession as exc:
            await send({"type": "websocket.send", "text": protocol.response("", False, error=str(exc),
                                                                            reply_type="error")})
            await send({"type": "websocket.close", "code": _POLICY_VIOLATION, "reason": "invalid session name"})
            return

        async def send_text(text: str) -> None:
            try:
                await send({"type": "websocket.send", "text": text})
            except Exception as exc:  # uvicorn raises its own disconnect errors / OSError
                raise SocketGone from exc

        async def close() -> None:
            await send({"type": "websocket.close", "code": _GOING_AWAY, "reason": "uibus is shutting down"})

        conn = self.gateway.connect(session, send_text, close)
        try:
            while True:
                event = await receive()
                kind = event["type"]
                if kind == "websocket.disconnect":
                    break
                if kind != "websocket.receive":
                    continue
                with contextlib.suppress(SocketGone):
                    text = event.get("text")
                    if text is None:
                        try:
                            text = (event.get("bytes") or b"").decode("utf-8")
                        except UnicodeDecodeError:
                            await conn.send(protocol.response("", False, reply_type="error",
                                                              error="a binary frame must hold UTF-8 JSON text"))
                            continue
                    await conn.receive(text)
        finally:
            await conn.close()
