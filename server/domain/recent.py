"""A session's recent ClineMessages: a view of the session's log (uibus.domain.session_log), so a
webview opened later starts with the conversation so far. It is not a second store: the log
keeps the latest state of each message (coalesced by ts), and this reads its newest ones.
"""

from __future__ import annotations

from google.protobuf.message import DecodeError

from uibus.domain.session_log import MESSAGE, SessionLog
from uibus.pb.cline import ui_pb2

MAX_RECENT = 200  # messages a webview starts with: the newest by seq


class RecentMessages:
    def __init__(self, log: SessionLog, *, max_messages: int = MAX_RECENT) -> None:
        self.log = log
        self.max_messages = max_messages

    async def forget(self, session: str) -> None:
        """Drops the session's unwritten log states before it is deleted (see SessionLog.forget)."""
        await self.log.forget(session)

    async def read(self, session: str) -> dict[int, ui_pb2.ClineMessage]:
        """The latest state of the session's newest `max_messages` messages, by ts."""
        replay = await self.log.read(session, kind=MESSAGE, last=self.max_messages)
        messages: dict[int, ui_pb2.ClineMessage] = {}
        for entry in replay.entries:
            try:
                message = ui_pb2.ClineMessage.FromString(entry.data)
            except DecodeError:
                continue
            messages[message.ts] = message
        return messages

    async def flush(self) -> None:
        """Commits everything stamped so far (tests; shutdown)."""
        await self.log.flush()
