"""One JSON-RPC peer: the request/reply core every way uibus speaks JSON-RPC goes through — the
hosted agents' stdio (uibus.agents.jsonrpc), the editors' ACP (uibus.edge.editors.agent, over
stdio lines, WebSocket frames and Streamable HTTP posts) and MCP (uibus.edge.mcp).

Why one: request/reply handling written once per protocol drifted apart (one map of the peer's
requests beside another, frames built by hand, a cancel answered here and swallowed there). The
model is the MCP SDK's `BaseSession`: one receive loop, one in-flight map each way.

* `Incoming`: the peer's requests being answered now, one owned task each, in one map by request
  key. The peer's cancel (`$/cancel_request` in ACP, `notifications/cancelled` in MCP) finds them
  there; a task learns whether it was the peer's cancel (`withdrawn`) or its owner's; the owner's
  teardown cancels and joins them all (`aclose`). A request already running under the same id is
  not started twice. Requests that are not JSON-RPC (pi's extension-UI requests) use the same map.
* `Peer`: `run(receive)` is the one receive loop over a framing (`receive()` gives the next
  message's text, or a decoded object, or None at the end); a framing that is handed its messages
  (an HTTP post, an agent's stdout reader) calls `receive`/`deliver` instead. Incoming requests
  are dispatched to `methods` as `Incoming` tasks and answered once (their RpcError as the error
  answer, `error_of` mapping any other failure); notifications go to `notified`; our requests
  (`request`, with ids and an optional timeout) wait in the one `Pending` map, withdrawn with
  `withdraw`. `aclose` is the end: every outstanding request of ours fails, every incoming task is
  cancelled and joined. A cancel of whoever awaits any of it propagates, never swallowed.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
from collections.abc import Awaitable, Callable, Coroutine, Hashable, Iterator, Mapping
from typing import Any

from uibus.infra.jsonrpc import (
    CANCEL_REQUEST,
    INTERNAL_ERROR,
    INVALID_PARAMS,
    INVALID_REQUEST,
    METHOD_NOT_FOUND,
    REQUEST_CANCELLED,
    Pending,
    RpcError,
    Send,
    check,
    error_frame,
    notification_frame,
    read,
    request_frame,
    result_frame,
    valid_id,
)
from uibus.infra.tasks import Tasks

log = logging.getLogger("uibus.infra.peer")

Method = Callable[[dict[str, Any]], Awaitable[Any]]
Notified = Callable[[str, dict[str, Any]], None]
Receive = Callable[[], Awaitable[str | bytes | dict[str, Any] | None]]
Wrap = Callable[[Coroutine[Any, Any, Any]], Coroutine[Any, Any, Any]]


def request_key(ident: Any) -> tuple[str, Any]:
    """A request id as a map key: 1 and "1" are different ids (and True is none)."""
    return (type(ident).__name__, ident)


class Incoming:
    """The peer's requests being answered now: one owned task each, by key (see the module docstring)."""

    def __init__(self, owner: str) -> None:
        self._tasks = Tasks(owner)
        self._open: dict[Hashable, asyncio.Task[Any]] = {}
        self._withdrawn: set[Hashable] = set()
        self.wrap: Wrap | None = None  # applied to each task's coroutine (an agent's: the turn's trace)

    def __len__(self) -> int:
        return len(self._open)

    @property
    def closed(self) -> bool:
        return self._tasks.closed

    def keys(self) -> list[Hashable]:
        return list(self._open)

    def open(self, key: Hashable, coro: Coroutine[Any, Any, Any], *, name: str) -> asyncio.Task[Any] | None:
        """Runs `coro` for request `key` as an owned task; None (and `coro` closed) when that request
        runs already or the owner is closing."""
        if key in self._open or self._tasks.closed:
            coro.close()
            return None
        task = self._tasks.spawn(self.wrap(coro) if self.wrap is not None else coro, name=name)
        self._open[key] = task
        task.add_done_callback(lambda t: self._forget(key, t))
        return task

    @contextlib.contextmanager
    def tracking(self, key: Hashable) -> Iterator[bool]:
        """Registers the running task (run by someone else: MCP's call driver) as answering `key`
        while the block runs; yields False (not registered) when another task has that key."""
        task = asyncio.current_task()
        if task is None or key in self._open:
            yield False
            return
        self._open[key] = task
        try:
            yield True
        finally:
            self._forget(key, task)

    def _forget(self, key: Hashable, task: asyncio.Task[Any]) -> None:
        if self._open.get(key) is task:
            del self._open[key]
            self._withdrawn.discard(key)

    def cancel(self, key: Any) -> bool:
        """The peer withdraws request `key`: its task is cancelled and knows why; False when none runs."""
        task = self._open.get(key) if isinstance(key, Hashable) else None
        if task is None or task.done():
            return False
        self._withdrawn.add(key)
        task.cancel()
        return True

    def withdrawn(self, key: Hashable) -> bool:
        """Whether the task of `key` was cancelled by the peer's cancel (not by its owner)."""
        return key in self._withdrawn

    def cancel_all(self) -> None:
        """Cancels every one (not waited for: `aclose` joins them)."""
        for task in list(self._open.values()):
            task.cancel()

    async def join(self) -> None:
        """Waits until none runs (each ends its own way: answered, or cancelled by its owner)."""
        while self._open:
            await asyncio.wait(list(self._open.values()))

    async def aclose(self, patience: float | None = 5.0) -> None:
        """Refuses new ones, cancels the running ones and waits for them to end."""
        await self._tasks.aclose(patience=patience)


def _not_found(method: str) -> RpcError:
    return RpcError(METHOD_NOT_FOUND, f"{method[:80]} is not a method uibus offers")


def _withdrawn(method: str) -> RpcError | None:
    return RpcError(REQUEST_CANCELLED, f"{method[:80]} was cancelled ({CANCEL_REQUEST})")


class Peer:
    """One JSON-RPC connection's request/reply state (see the module docstring).

    `send` writes one message (the framing's: it serializes with `uibus.infra.jsonrpc.dump`);
    `methods` answer the peer's requests; `notified(method, params)` takes its notifications;
    `cancel_method` is the protocol's cancel notification; `withdrawn_answer(method)` what a request
    the peer withdrew is answered (ACP: -32800; None: nothing, as MCP says); `cancelled_result(method,
    params)` what a request cancelled by our side is answered before the cancel propagates (None:
    nothing); `not_found(method)` the unknown method's error; `error_of(exc)` an RpcError for a
    method's other failure (None: -32603, logged); `max_running` bounds the peer's requests at once
    (0: no bound); `version_optional` takes messages without `"jsonrpc"`; `pending` and `incoming`
    the maps, when their owner made them (an agent session's turn loop shares them)."""

    def __init__(self, send: Send, *, name: str, methods: Mapping[str, Method] | None = None,
                 notified: Notified | None = None, cancel_method: str = CANCEL_REQUEST,
                 withdrawn_answer: Callable[[str], RpcError | None] = _withdrawn,
                 cancelled_result: Callable[[str, dict[str, Any]], Any] | None = None,
                 not_found: Callable[[str], RpcError] = _not_found,
                 error_of: Callable[[Exception], RpcError | None] | None = None,
                 max_running: int = 0, null_id: bool = True, version_optional: bool = False,
                 pending: Pending | None = None, incoming: Incoming | None = None) -> None:
        self._send = send
        self.name = name
        self.methods: Mapping[str, Method] = methods or {}
        self.notified = notified
        self.cancel_method = cancel_method
        self.withdrawn_answer = withdrawn_answer
        self.cancelled_result = cancelled_result
        self.not_found = not_found
        self.error_of = error_of
        self.max_running = max_running
        self.null_id = null_id
        self.version_optional = version_optional
        self.pending = pending if pending is not None else Pending()
        self.incoming = incoming if incoming is not None else Incoming(f"{name} requests")
        self._ids = itertools.count(1)
        self.ended = ""  # why the peer is gone; "" while it is there

    # ---- our requests and notifications ----------------------------------------------------------

    def open_request(self, method: str, params: Any) -> tuple[dict[str, Any], asyncio.Future[Any]]:
        """A new request's frame and the future of its answer, for a framing that writes without
        waiting (an agent's stdin, buffered): the caller writes the frame. The future leaves the
        map when it is done; cancel it to give the wait up. After the end: the end's error."""
        if self.ended:
            raise self.pending.gone(self.ended)
        ident = next(self._ids)
        return request_frame(ident, method, params), self.pending.open(ident)

    async def request(self, method: str, params: Any, *, timeout: float | None = None,
                      sent: Callable[[int], None] | None = None) -> Any:
        """The peer's result; its error answer raised (RpcError, or as `pending` words it);
        TimeoutError after `timeout` seconds (the request is forgotten). `sent(id)` is told the
        request's id once it is written (so the caller can `withdraw` it)."""
        frame, future = self.open_request(method, params)
        try:
            async with asyncio.timeout(timeout):
                await self._send(frame)
                if sent is not None:
                    sent(frame["id"])
                return await future
        finally:
            future.cancel()  # no-op once answered; a wait given up leaves nothing behind

    async def withdraw(self, ident: int, why: str = "withdrawn: another UI answered first") -> None:
        """Withdraws a request the peer has not answered yet: its waiter gets -32800, the peer the
        protocol's cancel."""
        if self.pending.reject(ident, RpcError(REQUEST_CANCELLED, why)):
            await self._send(notification_frame(self.cancel_method, {"requestId": ident}))

    async def notify(self, method: str, params: Any) -> None:
        await self._send(notification_frame(method, params))

    # ---- what the peer sends ---------------------------------------------------------------------

    async def run(self, receive: Receive) -> None:
        """The receive loop: every message `receive` gives, until it gives None (the framing ended);
        then the end (`aclose`). A cancel of the loop propagates once the end is done."""
        try:
            while (data := await receive()) is not None:
                await self.receive(data)
        finally:
            await self.aclose("the connection ended")

    async def receive(self, data: str | bytes | dict[str, Any]) -> None:
        """One message from the framing (text, or already decoded), through the one reader: one
        that is no JSON-RPC message is answered with its error (-32700 / -32600 / -32602)."""
        try:
            if isinstance(data, dict):
                message = check(data, null_id=self.null_id, version_optional=self.version_optional)
            else:
                message = read(data, null_id=self.null_id)
        except RpcError as exc:
            await self._send(exc.answer())
            return
        await self.handle(message)

    async def handle(self, message: dict[str, Any]) -> None:
        """One checked message; a request refused for `max_running` is answered here."""
        refused = self.deliver(message)
        if refused is not None:
            await self._send(refused)

    def deliver(self, message: dict[str, Any]) -> dict[str, Any] | None:
        """One checked message, dispatched without waiting: a response settles our request, a
        notification goes to `notified` (or cancels a request), a request starts its task. Returns
        the answer to send when a request is refused at once (`max_running`), else None."""
        method = message.get("method")
        if method is None:  # a response (late ones, to requests given up, are ignored)
            self.pending.answered(message)
            return None
        params = message.get("params")
        if "id" not in message:
            self._notification(method, params if isinstance(params, dict) else {})
            return None
        ident = message["id"]
        if self.max_running and len(self.incoming) >= self.max_running:
            return error_frame(ident, RpcError(INVALID_REQUEST, f"{self.max_running} requests of this connection "
                                                                "are running: wait for their answers"))
        if self.incoming.open(request_key(ident), self._answer(ident, method, params),
                              name=f"{self.name} {method[:40]}") is None and not self.incoming.closed:
            log.warning("a request whose id is already running; ignored",
                        extra={"fields": {"peer": self.name, "method": method[:80]}})
        return None

    def _notification(self, method: str, params: dict[str, Any]) -> None:
        if method == self.cancel_method:  # the peer withdraws a request of its own
            requested = params.get("requestId")
            if valid_id(requested, null=self.null_id):
                self.incoming.cancel(request_key(requested))
            return
        if self.notified is not None:
            self.notified(method, params)

    async def _answer(self, ident: Any, method: str, params: Any) -> None:
        """Runs one of the peer's requests and answers it, once."""
        key = request_key(ident)
        params = {} if params is None else params
        try:
            handler = self.methods.get(method)
            if handler is None:
                raise self.not_found(method)
            if not isinstance(params, dict):
                raise RpcError(INVALID_PARAMS, "params must be an object")
            answer = result_frame(ident, await handler(params))
        except RpcError as exc:
            answer = error_frame(ident, exc)
        except asyncio.CancelledError:
            if not self.incoming.withdrawn(key):  # our side's cancel (a turn, the end): it goes on
                if self.cancelled_result is not None and isinstance(params, dict):
                    result = self.cancelled_result(method, params)
                    if result is not None:
                        await self._send(result_frame(ident, result))
                raise
            task = asyncio.current_task()
            if task is not None:
                task.uncancel()
            error = self.withdrawn_answer(method)
            if error is None:
                return
            answer = error_frame(ident, error)
        except Exception as exc:
            mapped = self.error_of(exc) if self.error_of is not None else None
            if mapped is None:
                log.exception("a JSON-RPC method failed", extra={"fields": {"peer": self.name, "method": method[:80]}})
                mapped = RpcError(INTERNAL_ERROR, f"{method[:80]} failed: {type(exc).__name__}")
            answer = error_frame(ident, mapped)
        await self._send(answer)

    # ---- the end ---------------------------------------------------------------------------------

    async def finish(self, why: str) -> None:
        """The peer's input ended but our way to it has not (a pipe's reader at EOF; `uibus acp`
        with its stdin read to the end): every request the peer sent is still answered — waited
        for, not cancelled —, while ours fail with `why` at once, since no answer can come any more.
        `aclose` is still the end, after this."""
        self.ended = self.ended or why
        self.pending.fail_all(why)
        await self.incoming.join()

    async def aclose(self, why: str = "the connection closed") -> None:
        """The end: every request of ours still waiting fails with `why`, every request of the
        peer's is cancelled and joined. Safe to call more than once."""
        self.ended = self.ended or why
        self.pending.fail_all(why)
        await self.incoming.aclose()
