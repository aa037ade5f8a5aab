"""Agent programs on stdio: the process part every hosted-agent protocol shares (pi's RPC mode in
uibus.agents.rpc, the Agent Client Protocol in uibus.agents.acp). The session part — requests
matched to replies, the turn loop, the agent's dialogs — is uibus.agents.turns (and
uibus.agents.jsonrpc for JSON-RPC 2.0 framing).

* `ProcessOptions`: the options of such an agent, checked at start-up — `command` (an argv list,
  from the agents file only, never from a request; the program must exist then), `cwd`, `env`
  (added to an allow-list of uibus's environment, uibus.agents.launcher.agent_env),
  `idle_seconds`, `max_processes`, the bounds on starting, stopping, a turn and a line, `resume`
  (keep the conversation's handle and resume it in the next process: uibus.domain.agent_handles),
  and the isolation options (`inherit_env`, `sandbox`…: uibus.agents.config's isolation block).
  Processes are started only through a launcher (uibus.agents.launcher; the local one: uibus.agents.local_launcher).
* `StdioBackend`: a backend whose agents live across turns, one process per agent session,
  counted against `max_processes` (`RESOURCE_EXHAUSTED` naming the option beyond it).
* `AgentProcess`: one running program in its own process group, owned with `async with`. Its
  stdout is read as JSON lines split on `\\n` only (a trailing `\\r` stripped; U+2028/U+2029 are
  characters inside JSON strings, not line ends), each object handed to `on_message`; an
  unparsable line (nested too deep for the parser included) is one rate-limited log
  line; a line over `max_line_bytes` stops the process; stderr goes to the log, rate-limited and
  cut; the end of its output (or its death) is reported once through `on_exit` with the reason.
  Stopping is SIGTERM then, after `stop_timeout_seconds`, SIGKILL, always to the whole group, so
  nothing it started survives it, and the group is killed on every close (a cancelled one too);
  if uibus itself dies, a watcher in the group (uibus.agents.local_launcher.WATCHED) stops the group, so
  no agent outlives its uibus, not even one that ignores the end of its input.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import json
import logging
import os
import shutil
import signal
import time
from collections.abc import Callable
from contextlib import AsyncExitStack
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from uibus.agents import AgentError, AgentSession, AgentSpec, SessionBackend, SessionUi, check_options, option, seconds
from uibus.agents.bubblewrap import program_problem
from uibus.agents.config import ISOLATION_OPTIONS, WORKSPACE_OPTIONS, Isolation, workspace_repo
from uibus.agents.launcher import Launch, Launcher, agent_env
from uibus.agents.limits import Limits
from uibus.agents.local_launcher import LOCAL
from uibus.agents.network import loopback_port
from uibus.agents.workspaces import borrowed_objects
from uibus.infra.dialog_limits import safe_text as text
from uibus.infra.errors import ResourceExhausted
from uibus.infra.tasks import Tasks
from uibus.infra.telemetry.spans import process_start

log = logging.getLogger("uibus.agents.stdio")

OPTIONS = frozenset({"command", "cwd", "env", "idle_seconds", "max_processes", "start_timeout_seconds",
                     "stop_timeout_seconds", "turn_timeout_seconds", "max_line_bytes", "resume"})
MAX_LINE_BYTES = 16 * 1024 * 1024  # pi's agent_end carries every message of the run
STDERR_LINE_CHARS = 2000
# Between the end of an agent's input and its SIGTERM: agents write their conversation behind
# (Claude Code flushes its transcript every 100 ms, and a SIGTERM loses what is queued: measured, a
# conversation stopped within that window could not be resumed); an agent that exits at the end of
# its input (pi) ends sooner.
SETTLE_S = 0.5
LOG_EVERY_S = 10.0  # per process and kind of complaint: one log line per this, with the count skipped


# How an agent is started, and how it never outlives its uibus: uibus.agents.local_launcher (WATCHED).


class RateLog:
    """One log line per kind of complaint per LOG_EVERY_S (the rest counted in the next one), so an
    agent that writes garbage at full speed cannot flood the log."""

    def __init__(self, logger: logging.Logger, where: dict[str, str]) -> None:
        self.logger = logger
        self.where = where
        self._last: dict[str, float] = {}
        self._skipped: dict[str, int] = {}

    def warn(self, kind: str, message: str, **fields: Any) -> None:
        now = time.monotonic()
        if now - self._last.get(kind, -LOG_EVERY_S) < LOG_EVERY_S:
            self._skipped[kind] = self._skipped.get(kind, 0) + 1
            return
        self._last[kind] = now
        skipped = self._skipped.pop(kind, 0)
        self.logger.warning(message, extra={"fields": {**self.where, **fields, "skipped_since_last": skipped}})


@dataclass(frozen=True)
class ProcessOptions:
    """How to run one configured agent program."""

    command: tuple[str, ...]
    program: str  # command[0] as found at start-up
    cwd: str | None
    env: dict[str, str]
    idle_seconds: float
    max_processes: int
    start_timeout: float
    stop_timeout: float
    turn_timeout: float
    max_line: int
    resume: bool = True  # keep the conversation's handle and resume it in the next process
    isolation: Isolation = field(default_factory=lambda: Isolation((), None))  # what it inherits; its sandbox

    @classmethod
    def of(cls, spec: AgentSpec) -> ProcessOptions:
        """The options of `spec`, checked; ValueError naming agent and option (start-up fails)."""
        name = spec.name
        command = option(spec, "command", list, required=True)
        if not command or not all(isinstance(a, str) and a for a in command):
            raise ValueError(f"agent {name!r}: option command must be a non-empty list of non-empty strings "
                             f"(the argv of the agent), not {command!r}")
        cwd = option(spec, "cwd", str, "")
        if cwd and not Path(cwd).expanduser().is_dir():
            raise ValueError(f"agent {name!r}: option cwd {cwd!r} is not a directory")
        env = option(spec, "env", dict, {})
        if not all(isinstance(k, str) and isinstance(v, str) for k, v in env.items()):
            raise ValueError(f"agent {name!r}: option env must be a table of strings")
        max_processes = option(spec, "max_processes", int, 64)
        if max_processes < 1:
            raise ValueError(f"agent {name!r}: option max_processes must be at least 1")
        max_line = option(spec, "max_line_bytes", int, MAX_LINE_BYTES)
        if max_line < 1024:
            raise ValueError(f"agent {name!r}: option max_line_bytes must be at least 1024")
        workdir = str(Path(cwd).expanduser()) if cwd else None
        program = _resolve(name, command[0], workdir, env)
        isolation = Isolation.of(spec, program, env.get("PATH", os.environ.get("PATH", os.defpath)))
        return cls(command=tuple(command), program=program, cwd=workdir, isolation=isolation,
                   env=dict(env), idle_seconds=seconds(spec, "idle_seconds", 900), max_processes=max_processes,
                   start_timeout=seconds(spec, "start_timeout_seconds", 30),
                   stop_timeout=seconds(spec, "stop_timeout_seconds", 5),
                   turn_timeout=seconds(spec, "turn_timeout_seconds", 3600), max_line=max_line,
                   resume=option(spec, "resume", bool, True))


def workdir(options: ProcessOptions, ui: SessionUi) -> str | None:
    """Where the agent of `ui`'s session works: its own workspace when it has one, else option cwd."""
    return getattr(ui, "workspace", "") or options.cwd


def _resolve(agent: str, program: str, cwd: str | None, env: dict[str, str]) -> str:
    """The program of `command`, found as it will be started (PATH from `env` first)."""
    if os.sep in program:
        found = program if os.access(Path(cwd or ".") / program, os.X_OK) else None
    else:
        found = shutil.which(program, path=env.get("PATH", os.environ.get("PATH", os.defpath)))
    if found is None:
        raise ValueError(f"agent {agent!r}: option command: {program!r} is not an executable "
                         f"{'file' if os.sep in program else 'on PATH'}; install the agent or fix command")
    return found


class _Probe:
    """The session a start-up probe launches for: the operator's, nameless."""

    session = ""
    tenant = "operator"


class StdioBackend(SessionBackend):
    """A backend whose agents are processes, one per agent session (`session` builds one)."""

    extra_options: frozenset[str] = frozenset()  # a protocol's own options, beside OPTIONS

    def __init__(self, spec: AgentSpec) -> None:
        super().__init__(spec)
        check_options(spec, set(OPTIONS | ISOLATION_OPTIONS | WORKSPACE_OPTIONS | self.extra_options))
        self.options = ProcessOptions.of(spec)
        self.workspace_repo = workspace_repo(spec, self.options.cwd)
        # what a conversation's repository borrows from its base (git alternates), shown read-only
        self.workspace_read_only = borrowed_objects(self.workspace_repo) if self.workspace_repo else ()
        self.processes = 0  # agent sessions holding (or starting) a process now
        self.started = 0  # processes started, ever
        self.launcher: Launcher = LOCAL
        self.hidden: tuple[str, ...] = ()
        iso = self.options.isolation
        env = agent_env(iso.inherit_env, self.options.env)
        log.info("agent environment", extra={"fields": {
            "agent": spec.name, "inherits": sorted(set(env) - set(self.options.env)),
            "sets": sorted(self.options.env), "sandbox": iso.sandbox is not None,
            **({} if iso.sandbox is None else {"network": iso.sandbox.network, "bwrap": iso.sandbox.bwrap,
                                               "read_only": list(iso.sandbox.read_only)})}})

    def hide(self, paths: tuple[str, ...]) -> None:
        """uibus's own paths, masked in this agent's sandbox wherever they would show through; then,
        sandboxed, the agent's program is looked for inside its sandbox (start-up fails naming the
        option when it is not there: an installation the sandbox does not show)."""
        self.hidden = paths
        if self.options.isolation.sandbox is None:
            return
        problem = program_problem(self.launch(_Probe()))
        if problem:
            raise ValueError(f"agent {self.spec.name!r}: option sandbox = true: its program cannot start in its "
                             f"sandbox: {problem} (show its installation with option read_only, or fix option "
                             "command)")

    def launch(self, ui: SessionUi, cwd: str | None = None) -> Launch:
        """What to start for `ui.session`, in `cwd` (the caller's: a conversation's workspace; the
        agents file's `cwd` when None). The environment is the allow-list (never uibus's keys)."""
        o = self.options
        box = o.isolation.sandbox
        if box is not None:
            # a configured worktree's repository is bound for the configured cwd only: a conversation's
            # workspace is a repository of its own (uibus.agents.workspaces), its base's objects read-only
            box = replace(box, hide=self.hidden, git_common=box.git_common if cwd in (None, o.cwd) else "",
                          read_only=(*box.read_only, *self.workspace_read_only))
            if getattr(self, "offer_mcp", False) and (port := loopback_port(getattr(ui, "mcp_url", str)())):
                box = replace(box, loopback_ports=(*box.loopback_ports, port))  # its /mcp, forwarded ("outbound")
        env = agent_env(o.isolation.inherit_env, o.env)
        if box is not None:
            env["TMPDIR"] = "/tmp"  # the sandbox's own
        return Launch(agent=self.spec.name, session=ui.session, tenant=getattr(ui, "tenant", "") or "operator",
                      argv=(o.program, *o.command[1:]), cwd=cwd or o.cwd, env=env, sandbox=box,
                      stop_timeout=o.stop_timeout, limit=o.max_line, limits=self.limits_for(ui))

    def limits_for(self, ui: SessionUi) -> Limits | None:
        """Option limits for `ui`'s agent: a default disk_mb counts the working directory only when
        it is the conversation's own (a workspace), never a shared checkout (uibus.agents.limits)."""
        lim = self.options.isolation.limits
        if lim is None or getattr(ui, "workspace", "") or "disk_mb" in lim.explicit:
            return lim
        return replace(lim, count_cwd=False)

    def open_session(self, ui: SessionUi) -> AgentSession:
        limit = self.options.max_processes
        if self.processes >= limit:
            raise ResourceExhausted(f"agent {self.spec.name!r} already runs {self.processes} processes, one per "
                                    f"session (option max_processes = {limit}); try again when one is idle, or "
                                    "raise max_processes")
        self.processes += 1
        try:
            return self.session(ui)
        except BaseException:
            self.processes -= 1
            raise

    def session(self, ui: SessionUi) -> AgentSession:
        """The protocol's agent session for `ui.session`; it must call `released` once when closed."""
        raise NotImplementedError

    def released(self) -> None:
        self.processes -= 1


class AgentProcess:
    """One agent program on stdio (see the module docstring). `async with` starts it and stops it."""

    def __init__(self, backend: StdioBackend, ui: SessionUi, on_message: Callable[[dict[str, Any]], None],
                 on_exit: Callable[[str], None], logger: logging.Logger) -> None:
        self.backend = backend
        self.options = backend.options
        self.on_message = on_message
        self.on_exit = on_exit
        self.log = RateLog(logger, {"agent": backend.spec.name, "session": ui.session})
        self.cwd = workdir(self.options, ui)  # its workspace (uibus.agents.workspaces), else option cwd
        self.proc: asyncio.subprocess.Process | None = None
        self.gone = ""  # why it is gone; "" while it runs
        self.ui = ui
        self._launched = AsyncExitStack()  # the launcher's hold on the process (its group, its lifeline)
        self._readers = Tasks(f"agent {backend.spec.name} process")

    @property
    def alive(self) -> bool:
        return not self.gone and self.proc is not None and self.proc.returncode is None

    async def __aenter__(self) -> AgentProcess:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    async def start(self) -> None:
        o = self.options
        if not os.access(o.program, os.X_OK):  # said here: through the watcher, exec's error is only an exit
            why = os.strerror(errno.EACCES if Path(o.program).exists() else errno.ENOENT)  # noqa: ASYNC240
            raise AgentError(f"cannot start the agent (option command = {list(o.command)!r}): {why}")
        async with process_start(self.backend.spec.name, o.program) as span:
            try:
                self.proc = await self._launched.enter_async_context(
                    self.backend.launcher.start(self.backend.launch(self.ui, self.cwd)))
            except OSError as exc:
                raise AgentError(f"cannot start the agent (option command = {list(o.command)!r}): "
                                 f"{exc.strerror or exc}") from exc
            if span is not None:
                span.set_attribute("process.pid", self.proc.pid)
        self.backend.started += 1
        log.info("agent process started", extra={"fields": {**self.log.where, "pid": self.proc.pid}})
        self._readers.spawn(self._read(), name="agent stdout")
        self._readers.spawn(self._stderr(), name="agent stderr")
        self._readers.spawn(self._reap(), name="agent exit")

    async def _reap(self) -> None:
        """Once the agent has exited, what is left of its group goes: the watcher, and whatever the
        agent started. They may hold its output open (uvloop leaves the child's ends of the stdio
        socketpairs open in it, and a fork inherits them), and its end would never be read."""
        proc = self.proc
        assert proc is not None
        await proc.wait()
        self.kill()

    def send(self, message: dict[str, Any]) -> None:
        """Writes one JSON line (buffered by the transport; `drain` waits for the pipe)."""
        proc = self.proc
        if proc is None or proc.stdin is None or not self.alive or proc.stdin.is_closing():
            exited = f"the agent process exited (code {proc.returncode})" if proc is not None \
                and proc.returncode is not None else "the agent process is not running"
            raise AgentError(self.gone or exited)  # its stderr is in the log ("agent stderr")
        proc.stdin.write(json.dumps(message, ensure_ascii=False).encode() + b"\n")

    async def drain(self) -> None:
        proc = self.proc
        assert proc is not None and proc.stdin is not None
        try:
            await proc.stdin.drain()
        except ConnectionError as exc:  # it exited while we wrote: said as the rest says it
            raise AgentError(self.gone or f"the agent process closed its input: {exc}") from exc

    async def _read(self) -> None:
        proc = self.proc
        assert proc is not None and proc.stdout is not None
        why = ""
        try:
            while True:
                try:
                    line = await proc.stdout.readuntil(b"\n")
                except asyncio.IncompleteReadError:
                    break  # the end of its output (a last line without \n is not a record)
                except asyncio.LimitOverrunError:
                    why = (f"the agent wrote a line over {self.options.max_line} bytes (option max_line_bytes); "
                           "it was stopped")
                    log.warning("agent line too long", extra={"fields": self.log.where})
                    self.kill()
                    break
                message = self._parse(line)
                if message is not None:
                    self.on_message(message)
        except Exception as exc:  # a bug here must not leave a turn waiting
            why = f"reading the agent failed: {exc}"
            log.exception("reading the agent failed", extra={"fields": self.log.where})
            self.kill()
        finally:
            code = None
            with contextlib.suppress(Exception):
                async with asyncio.timeout(self.options.stop_timeout):
                    code = await proc.wait()
            why = why or self.backend.launcher.why_stopped(proc)  # at a limit: "stopped: memory limit …"
            self._lost(why or (f"the agent process exited (code {code})" if code is not None
                               else "the agent closed its output"))

    def _parse(self, raw: bytes) -> dict[str, Any] | None:
        line = raw[:-1]
        if line.endswith(b"\r"):
            line = line[:-1]
        if not line.strip():
            return None
        try:
            message = json.loads(line)
        except (ValueError, RecursionError) as exc:  # RecursionError: nested too deep for the parser
            self.log.warn("unparsable", "agent line is not JSON; ignored", error=str(exc),
                          line=text(line[:200].decode(errors="replace")))
            return None
        if not isinstance(message, dict):
            self.log.warn("unparsable", "agent line is not a JSON object; ignored")
            return None
        return message

    async def _stderr(self) -> None:
        proc = self.proc
        assert proc is not None and proc.stderr is not None
        while True:
            try:
                line = await proc.stderr.readline()
            except (asyncio.LimitOverrunError, ValueError):  # a line over the bound: drop what is buffered
                with contextlib.suppress(Exception):
                    await proc.stderr.read(self.options.max_line)
                continue
            if not line:
                return
            self.log.warn("stderr", "agent stderr", line=text(line.decode(errors="replace").rstrip())
                          [:STDERR_LINE_CHARS])

    def _lost(self, why: str) -> None:
        if not self.gone:
            self.gone = why
            self.on_exit(why)

    def stop(self, why: str) -> None:
        """Kills the group now and counts the process gone at once, for `why`: its exit is seen
        only later (on a loaded machine, seconds later), and until then nothing may hand it a turn."""
        self._lost(why)
        self.kill()

    def kill(self) -> None:
        """SIGKILL to the whole process group, at once."""
        proc = self.proc
        if proc is not None:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(proc.pid, signal.SIGKILL)

    async def aclose(self) -> None:
        """Stops it (input closed, SIGTERM, SIGKILL after stop_timeout) and waits for its readers;
        the group is killed last whatever happened, a cancel of the caller included (which then
        propagates); safe to call more than once."""
        proc = self.proc
        try:
            if proc is not None and proc.returncode is None:
                self._lost("the agent session was closed")
                with contextlib.suppress(Exception):
                    if proc.stdin is not None:
                        proc.stdin.close()
                with contextlib.suppress(TimeoutError):  # its last writes first (see SETTLE_S)
                    async with asyncio.timeout(min(SETTLE_S, self.options.stop_timeout)):
                        await proc.wait()
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.killpg(proc.pid, signal.SIGTERM)
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(self.options.stop_timeout):
                        await proc.wait()
        finally:
            self.kill()  # whatever it started in its group goes with it
            self._lost("the agent session was closed")
            try:
                if proc is not None:
                    await self._reaped(proc)
                    log.info("agent process stopped", extra={"fields": {**self.log.where, "pid": proc.pid,
                                                                         "code": proc.returncode}})
            finally:
                try:
                    await self._launched.aclose()
                finally:
                    await self._readers.aclose()

    async def _reaped(self, proc: asyncio.subprocess.Process) -> None:
        """Waits, bounded by stop_timeout_seconds, for the killed process to be gone, through any
        cancel of the close (re-raised after): a cancelled close must still leave no process, and a
        second cancel can reach this wait (Tasks cancels a task twice; asyncio.timeout, on 3.11,
        can hand a cancel on when it expires as the cancel comes)."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.options.stop_timeout
        waiter = asyncio.ensure_future(proc.wait())
        cancelled = False
        while not waiter.done() and loop.time() < deadline:
            try:
                await asyncio.wait((waiter,), timeout=deadline - loop.time())
            except asyncio.CancelledError:
                cancelled = True
        if not waiter.done():
            waiter.cancel()
        if cancelled:
            raise asyncio.CancelledError
