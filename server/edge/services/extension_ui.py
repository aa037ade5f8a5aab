"""uibus.v1.ExtensionUiService: the extension-UI sub-protocol of the RPC mode over gRPC
(protos/uibus/v1/extension_ui.proto; docs/protocols/extension-ui.md).

Each method is one call on the domain's `Dialogs`, which owns the dialogs, their validation and
"first answer wins"; this module only carries the calling session across.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from typing import Any

import grpc

from uibus.domain.dialogs import DialogRequest, Dialogs
from uibus.infra.quotas import ANONYMOUS, Quotas
from uibus.infra.session import session_of, since_of
from uibus.pb.uibus.v1 import extension_ui_pb2 as pb
from uibus.pb.uibus.v1 import extension_ui_pb2_grpc
from uibus.replicas.placement import Placement


class ExtensionUiService(extension_ui_pb2_grpc.ExtensionUiServiceServicer):
    def __init__(self, dialogs: Dialogs, placement: Placement, quotas: Quotas | None = None,
                 tenant_of: Callable[[Any], str] | None = None) -> None:
        """`placement`: where an answer goes (the replica holding its dialog); `quotas`, `tenant_of`:
        a tenant's `dialogs` quota (uibus.infra.quotas), held while its dialog waits."""
        self.dialogs = dialogs
        self.placement = placement
        self.quotas = quotas if quotas is not None else Quotas()
        self.tenant_of = tenant_of or (lambda _metadata: ANONYMOUS)

    async def _ask(self, request: DialogRequest, context: grpc.aio.ServicerContext) -> pb.DialogResult:
        with self.quotas.hold("dialogs", self.tenant_of(context.invocation_metadata())):
            return await self.dialogs.ask(session_of(context), request)

    # ---- agent side: dialogs (each waits for its outcome) ----

    async def Select(self, request: pb.SelectRequest, context: grpc.aio.ServicerContext) -> pb.DialogResult:
        return await self._ask(request, context)

    async def Confirm(self, request: pb.ConfirmRequest, context: grpc.aio.ServicerContext) -> pb.DialogResult:
        return await self._ask(request, context)

    async def Input(self, request: pb.InputRequest, context: grpc.aio.ServicerContext) -> pb.DialogResult:
        return await self._ask(request, context)

    async def Editor(self, request: pb.EditorRequest, context: grpc.aio.ServicerContext) -> pb.DialogResult:
        return await self._ask(request, context)

    # ---- agent side: fire-and-forget ----

    async def Notify(self, request: pb.NotifyRequest, context: grpc.aio.ServicerContext) -> pb.FireReply:
        return await self.dialogs.notify(session_of(context), request)

    async def SetStatus(self, request: pb.SetStatusRequest, context: grpc.aio.ServicerContext) -> pb.FireReply:
        return await self.dialogs.set_status(session_of(context), request)

    async def SetWidget(self, request: pb.SetWidgetRequest, context: grpc.aio.ServicerContext) -> pb.FireReply:
        return await self.dialogs.set_widget(session_of(context), request)

    async def SetTitle(self, request: pb.SetTitleRequest, context: grpc.aio.ServicerContext) -> pb.FireReply:
        return await self.dialogs.set_title(session_of(context), request)

    async def SetEditorText(self, request: pb.SetEditorTextRequest,
                            context: grpc.aio.ServicerContext) -> pb.FireReply:
        return await self.dialogs.set_editor_text(session_of(context), request)

    # ---- UI side ----

    async def Subscribe(self, request: pb.SubscribeRequest,
                        context: grpc.aio.ServicerContext) -> AsyncIterator[pb.ExtensionUiEvent]:
        async for event in self.dialogs.events(session_of(context), since_of(context)):
            yield event

    async def Respond(self, request: pb.RespondRequest, context: grpc.aio.ServicerContext) -> pb.RespondReply:
        await self.placement.respond(session_of(context), request)
        return pb.RespondReply()

    async def GetStats(self, request: pb.StatsRequest, context: grpc.aio.ServicerContext) -> pb.ExtensionUiStats:
        return self.dialogs.stats(session_of(context))


SERVICE = pb.DESCRIPTOR.services_by_name["ExtensionUiService"].full_name


def add_to(registry: Any, dialogs: Dialogs, placement: Placement, quotas: Quotas | None = None,
           tenant_of: Callable[[Any], str] | None = None) -> str:
    extension_ui_pb2_grpc.add_ExtensionUiServiceServicer_to_server(
        ExtensionUiService(dialogs, placement, quotas, tenant_of), registry)
    return SERVICE
