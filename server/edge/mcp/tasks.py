"""A hosted agent's turn as a task of MCP's tasks extension (`io.modelcontextprotocol/tasks`,
protocol 2026-07-28): a modern client that declares the extension gets a task handle at once
instead of holding its request for the length of the turn; it polls `tasks/get`, answers the
session's questions raised meanwhile (an agent's permission dialog) with `tasks/update`, and may
`tasks/cancel`.

Why the store: a task is read wherever the client's next request lands (no sticky replica in the
stateless era), so its record — status, the questions open, the result — lives in the session's
store (Redis with replicas), not in this process. The turn itself runs where it runs today (here,
or at its agent's replica: the placement), consumed by a runner owned here.

A task is the caller's: its record carries a digest of the Authorization that made it, and any
other token reads "no such task" (a task id is also unguessable). Each session keeps its newest
`KEPT` task records; the oldest finished ones go first.
"""

from __future__ import annotations

import asyncio
import secrets
from collections.abc import AsyncIterator, Callable
from contextlib import aclosing
from datetime import UTC, datetime
from typing import Any

from google.protobuf import json_format

from uibus.domain.dialogs import Dialogs
from uibus.edge.mcp import elicit
from uibus.edge.mcp.protocol import InvalidParams
from uibus.infra.bus import LIVE
from uibus.infra.errors import NotFound, ResourceExhausted, UibusError
from uibus.infra.quotas import Lease, Quotas
from uibus.infra.store import Store
from uibus.infra.tasks import Tasks
from uibus.pb.uibus.v1 import extension_ui_pb2 as ext
from uibus.replicas.placement import Placement

PREFIX = "mcp_task."
KEPT = 64  # task records a session keeps
RUNNING = 256  # tasks running here at once (each holds a turn)
TTL_MS = 3_600_000  # how long a finished task's result is promised (it stays while the session keeps it)
POLL_MS = 500  # the interval a client is asked to poll at
FINAL = ("completed", "failed", "cancelled")

Run = AsyncIterator[Any]  # the turn, as McpServer runs it for a tools/call: LIVE, notifications, a Reply


def _now() -> str:
    return datetime.now(UTC).isoformat(timespec="milliseconds").replace("+00:00", "Z")


def shown(record: dict[str, Any]) -> dict[str, Any]:
    """The task as the client sees it (uibus's own fields left out)."""
    return {k: v for k, v in record.items() if not k.startswith("_")}


class McpTasks:
    """The tasks of this server: records in the store, runners in an owned set."""

    def __init__(self, store: Store, dialogs: Dialogs, placement: Placement, quotas: Quotas) -> None:
        self.quotas = quotas  # a tenant's running tasks count against its `mcp_tasks`
        self.store = store
        self.dialogs = dialogs
        self.placement = placement
        self.runners = Tasks("mcp tasks")
        self._here: dict[str, asyncio.Task[None]] = {}  # task id -> its runner, for a cancel received here

    def __len__(self) -> int:
        return len(self.runners)

    async def start(self, session: str, auth: str, tenant: str, agent: str, run: Run,
                    result_of: Callable[[Any], dict[str, Any] | None]) -> dict[str, Any]:
        """Runs `run` (a tools/call of `agent`) as a task: checked and admitted first (what the call
        would refuse, it refuses now), then the task's record, then the turn in the background.
        `result_of(item)`: the call's result when `item` is its Reply, else None."""
        if len(self.runners) >= RUNNING:
            raise ResourceExhausted(f"{RUNNING} MCP tasks are running here; wait for one to finish")
        lease = self.quotas.hold("mcp_tasks", tenant)
        try:
            first = await anext(run)  # validation and admission happen before the first item
            if first is not LIVE:
                raise InvalidParams(f"{agent} answered before its turn began")
        except BaseException:
            lease.release()
            await run.aclose()
            raise
        now = _now()
        task_id = secrets.token_hex(16)
        record = {"taskId": task_id, "status": "working", "createdAt": now, "lastUpdatedAt": now, "ttlMs": TTL_MS,
                  "pollIntervalMs": POLL_MS, "_auth": auth, "_agent": agent, "_dialogs": {}}
        await self._keep(session, record)
        self._here[task_id] = self.runners.spawn(self._run(session, task_id, run, result_of, lease),
                                                 name=f"uibus-mcp-task-{task_id[:8]}")
        return record

    async def _keep(self, session: str, record: dict[str, Any]) -> None:
        await self.store.put(session, PREFIX + record["taskId"], record)
        kept = await self.store.scan(session, PREFIX)
        if len(kept) > KEPT:
            old = sorted(((r.get("createdAt", ""), k) for k, r in kept.items()
                          if isinstance(r, dict) and r.get("status") in FINAL))
            for _, key in old[:len(kept) - KEPT]:
                await self.store.put(session, key, None)

    async def _change(self, session: str, task_id: str, change: Callable[[dict[str, Any]], None]) -> None:
        def apply(current: Any) -> Any:
            if not isinstance(current, dict) or current.get("status") in FINAL:
                return current  # forgotten, or already final: a late change loses
            current = dict(current)
            change(current)
            current["lastUpdatedAt"] = _now()
            return current
        await self.store.update(session, PREFIX + task_id, apply)

    async def _run(self, session: str, task_id: str, run: Run,
                   result_of: Callable[[Any], dict[str, Any] | None], lease: Lease) -> None:
        """The turn to its end, with the session's questions asked meanwhile kept on the task."""
        questions = asyncio.create_task(self._questions(session, task_id), name="uibus-mcp-task-questions")
        try:
            result = None
            async with aclosing(run) as items:
                async for item in items:
                    result = result_of(item) or result
            no_result = {"code": -32603, "message": "the turn gave no result"}
            final: dict[str, Any] = ({"status": "completed", "result": result} if result is not None
                                     else {"status": "failed", "error": no_result})
        except asyncio.CancelledError:
            final = {"status": "cancelled", "statusMessage": "cancelled"}
            await self._finish(session, task_id, final)
            raise
        except UibusError as exc:
            final = {"status": "failed", "statusMessage": str(exc),
                     "error": {"code": -32000, "message": str(exc), "data": {"status": exc.code}}}
        finally:
            lease.release()
            questions.cancel()
            await asyncio.gather(questions, return_exceptions=True)
            self._here.pop(task_id, None)
        await self._finish(session, task_id, final)

    async def _finish(self, session: str, task_id: str, final: dict[str, Any]) -> None:
        def change(record: dict[str, Any]) -> None:
            if record.get("_cancel"):  # asked to cancel, and the turn ended by it
                final.clear()
                final.update(status="cancelled", statusMessage="cancelled by the client")
            record.pop("inputRequests", None)
            record["_dialogs"] = {}
            record.update(final)
        await asyncio.shield(self._change(session, task_id, change))

    async def _questions(self, session: str, task_id: str) -> None:
        """Keeps the task's `inputRequests` in step with the session's open dialogs (opened after the
        task began): each one a form the client may answer with tasks/update."""
        async with aclosing(self.dialogs.events(session)) as events:
            async for event in events:
                if event is LIVE or not isinstance(event, ext.ExtensionUiEvent):
                    continue
                which = event.WhichOneof("event")
                if which == "request" and not event.request.replayed:
                    dialog = elicit.dialog_of(event.request)
                    if dialog is None:
                        continue
                    asked = json_format.MessageToDict(event.request)

                    def opened(record: dict[str, Any], d: Any = dialog, i: str = event.request.id,
                               a: dict[str, Any] = asked) -> None:
                        record.setdefault("inputRequests", {})[i] = elicit.form(d)
                        record["_dialogs"] = {**record.get("_dialogs", {}), i: a}
                        record["status"] = "input_required"
                    await self._change(session, task_id, opened)
                elif which == "closed":
                    def closed(record: dict[str, Any], i: str = event.closed.id) -> None:
                        asked = record.get("inputRequests") or {}
                        if i not in asked:
                            return
                        asked = {k: v for k, v in asked.items() if k != i}
                        record["_dialogs"] = {k: v for k, v in record.get("_dialogs", {}).items() if k != i}
                        if asked:
                            record["inputRequests"] = asked
                        else:
                            record.pop("inputRequests", None)
                            record["status"] = "working"
                    await self._change(session, task_id, closed)

    # ---- the extension's methods -----------------------------------------------------------------

    async def get(self, session: str, auth: str, task_id: Any) -> dict[str, Any]:
        if not isinstance(task_id, str) or not task_id:
            raise InvalidParams("params.taskId must be the task's id (a string)")
        record = await self.store.get(session, PREFIX + task_id)
        if not isinstance(record, dict) or record.get("_auth") != auth:
            raise NotFound(f"no task {task_id[:64]!r} of this token in session {session!r} (finished tasks are kept "
                           f"while the session keeps its newest {KEPT})")
        return record

    async def update(self, session: str, auth: str, task_id: Any, responses: Any) -> None:
        """Answers the task's open questions: each response goes to its dialog as a UI's answer would
        (to the replica that holds it)."""
        record = await self.get(session, auth, task_id)
        if not isinstance(responses, dict) or not responses:
            raise InvalidParams("tasks/update needs params.inputResponses: the answers, by the keys of the task's "
                                "inputRequests")
        asked = record.get("_dialogs") or {}
        unknown = sorted(k for k in responses if k not in asked)
        if unknown:
            raise InvalidParams(f"task {task_id[:64]} asks no {', '.join(unknown)[:200]} now (open: "
                                f"{', '.join(asked) or 'none'})")
        answers = []
        for key, response in responses.items():
            request = json_format.ParseDict(asked[key], ext.ExtensionUiRequest())
            dialog = elicit.dialog_of(request)
            assert dialog is not None  # only dialogs are kept
            answer = elicit.answer(dialog, response, f"inputResponses.{key}")
            answer.id = key
            answers.append(answer)
        for answer in answers:
            await self.placement.respond(session, answer)

    async def cancel(self, session: str, auth: str, task_id: Any) -> None:
        """Cancels the task's turn: here, its runner; elsewhere, the agent's turn (where it runs),
        which ends the runner there; the record says cancelled either way."""
        record = await self.get(session, auth, task_id)
        if record.get("status") in FINAL:
            return

        def asked(current: dict[str, Any]) -> None:
            current["_cancel"] = True
        await self._change(session, task_id, asked)
        runner = self._here.get(task_id)
        if runner is not None:
            runner.cancel()
        else:
            await self.placement.stop(session, record.get("_agent", ""))

    async def aclose(self) -> None:
        await self.runners.aclose()
