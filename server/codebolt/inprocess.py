"""Unary calls to uibus's own gRPC services without a network hop.

The gateway asks ExtensionUiService for dialogs, notices and status the same way gRPC-Web does:
it looks the method handler up in the app's registry and runs it with an in-process servicer
context. The extension-UI service stays the only owner of dialogs (validation, first-answer-wins,
telling every UI when a dialog closes), and the gateway depends on its public API only.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence
from typing import Any

import grpc

from uibus.session import SESSION_KEY
from uibus.web.context import HttpServicerContext
from uibus.web.invoke import responses

Lookup = Callable[[str, Sequence[tuple[str, str | bytes]]], grpc.RpcMethodHandler | None]


class CallFailed(Exception):
    """The method ended with a non-OK status; `str()` is its details."""

    def __init__(self, code: grpc.StatusCode, details: str) -> None:
        super().__init__(details or code.name)
        self.code = code


class InProcess:
    def __init__(self, lookup: Lookup, peer: str = "codebolt-gateway") -> None:
        self.lookup = lookup
        self.peer = peer

    async def unary(self, method: str, request: Any, session: str) -> Any:
        """The reply of a unary method (`/pkg.Service/Method`) called as `session`.

        Cancelling the awaiting task cancels the handler at once, exactly as a client that goes
        away would (a waiting dialog closes for every UI).
        """
        metadata = ((SESSION_KEY, session),)
        handler = self.lookup(method, metadata)
        if handler is None:
            raise CallFailed(grpc.StatusCode.UNIMPLEMENTED, f"{method} is not served by this uibus")
        ctx = HttpServicerContext(metadata, self.peer)
        reply = None
        cancelled = True
        try:
            async with contextlib.aclosing(responses(handler, request, ctx)) as stream:
                async for message in stream:
                    reply = message
            cancelled = False
        finally:
            ctx.finish(cancelled=cancelled)
        code, details = ctx.status()
        if code != grpc.StatusCode.OK or reply is None:
            raise CallFailed(code if code != grpc.StatusCode.OK else grpc.StatusCode.INTERNAL, details)
        return reply
