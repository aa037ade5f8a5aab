"""The requester side of MCP's tasks extension (`io.modelcontextprotocol/tasks`, 2026-07-28),
written as the official Python SDK (`mcp` 2.3.0) asks extensions to be written: a `ClientExtension`
whose `ResultClaim` resolves a `resultType: "task"` result by polling `tasks/get` and answering the
task's input requests with `tasks/update`. The SDK ships the extension points, not this extension,
so the tests bring it — over the SDK's own session, envelope, headers and transport.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Sequence
from typing import Any, ClassVar, Literal

import anyio
import mcp_types as types
from mcp.client.extension import ClaimContext, ClientExtension, ResultClaim
from pydantic import TypeAdapter

IDENTIFIER = "io.modelcontextprotocol/tasks"
Answer = Callable[[str, dict[str, Any]], Awaitable[dict[str, Any]]]  # (key, input request) -> its response
_RAW = TypeAdapter(dict[str, Any])


class CreateTaskResult(types.Result):
    result_type: Literal["task"] = "task"
    task_id: str
    status: str
    poll_interval_ms: int | None = None


class TaskParams(types.RequestParams):
    task_id: str


class UpdateParams(TaskParams):
    input_responses: dict[str, Any]


class GetTask(types.Request[TaskParams, Literal["tasks/get"]]):
    method: Literal["tasks/get"] = "tasks/get"
    name_param: ClassVar[str | None] = "taskId"


class UpdateTask(types.Request[UpdateParams, Literal["tasks/update"]]):
    method: Literal["tasks/update"] = "tasks/update"
    name_param: ClassVar[str | None] = "taskId"


class Tasks(ClientExtension):
    """Resolves tasks to their tool results; `answer` fills in each input request; `statuses`
    records every status polled (what a test asserts the task went through)."""

    identifier = IDENTIFIER

    def __init__(self, answer: Answer) -> None:
        self.answer = answer
        self.statuses: list[str] = []
        self.created: list[str] = []

    def claims(self) -> Sequence[ResultClaim[Any]]:
        return [ResultClaim(result_type="task", model=CreateTaskResult, resolve=self._resolve)]

    async def _resolve(self, created: CreateTaskResult, ctx: ClaimContext) -> types.CallToolResult:
        self.created.append(created.task_id)
        answered: set[str] = set()
        with anyio.fail_after(60):
            while True:
                task = await ctx.session.send_request(GetTask(params=TaskParams(task_id=created.task_id)), _RAW)
                status = task["status"]
                self.statuses.append(status)
                if status == "completed":
                    return types.CallToolResult.model_validate(task["result"])
                if status in ("failed", "cancelled"):
                    raise RuntimeError(f"task {created.task_id} {status}: {task.get('error') or task}")
                asked = {k: v for k, v in (task.get("inputRequests") or {}).items() if k not in answered}
                if status == "input_required" and asked:
                    responses = {key: await self.answer(key, request) for key, request in asked.items()}
                    answered.update(responses)
                    await ctx.session.send_request(UpdateTask(params=UpdateParams(
                        task_id=created.task_id, input_responses=responses)), _RAW)
                await anyio.sleep((task.get("pollIntervalMs") or 200) / 1000)
