"""`uibus serve --workers N`: one parent process and N worker processes on the same two ports.

One asyncio process uses one core; N workers use N. Each worker is a whole, ordinary App (store,
bus, gRPC and HTTP servers) and the workers share sessions and events through Redis exactly as
replicas on different machines do, so nothing new crosses between them but a status table. The
parent serves nothing: it binds, forks, forwards signals and waits.

* **Processes**: forked, not spawned. The parent has no event loop, no gRPC object and one
  thread when it forks, so a worker starts from a clean state at once (no re-import, no pickling)
  and inherits the sockets and the status table as they are.
* **Ports**: gRPC cannot serve on a socket it is handed, so every worker binds the gRPC port with
  SO_REUSEPORT and the kernel spreads connections over them; the parent first binds it (not
  listening) to hold it, which also turns port 0 into one real port that every worker then binds.
  HTTP is bound and listening once, in the parent, and each worker serves on that socket (see
  uibus.edge.transports.http for why). A taken port is one start-up line from the parent, as without
  workers.
* **Signals**: SIGTERM and SIGINT (stop) and SIGHUP (re-read --tokens-file) go to every worker.
  They are blocked from the fork until the worker's loop has its handlers, so one that arrives
  while a worker starts is handled once it serves, never lost or fatal. The parent exits 0 when
  every worker drained and exited 0, else 1; a worker still running `--drain-seconds` + twice
  `--grace-seconds` + 10 s after the stop is killed. A parent killed outright (SIGKILL, the OOM
  killer) cannot forward anything, so on Linux each worker asks the kernel for a SIGTERM when its
  parent dies, and stops gracefully rather than serve on unsupervised.
* **Health**: uibus.infra.worker_table; each worker reports SERVING only while every worker is ready,
  and the parent marks a worker that has exited down at once.
* **A worker that dies** (crash, OOM kill, a stray signal) is logged in one line, and the parent
  stops the others gracefully and exits 1: it does not restart it. Restarting is the job of what
  runs uibus (Kubernetes, systemd, docker's restart policy), which counts crash loops and backs off;
  a parent that quietly restarted workers would hide them, and until the restart the survivors
  would report NOT_SERVING anyway. A worker that cannot start (a bad agents file, a TLS file) makes
  the parent print its one line — once, however many workers fail alike — and exit with its code.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import os
import signal
import socket
import sys
import time
from collections.abc import Callable
from dataclasses import replace

from uibus.infra.config import Config, address, why_not
from uibus.infra.worker_table import DOWN, STARTING, Worker, WorkerTable

log = logging.getLogger("uibus.app.workers")

SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)
POLL_S = 0.05  # how often the parent reaps workers and reads the table
STOP_MARGIN_S = 10.0  # beyond a worker's own drain and grace: the store's flush, the loop's end
BACKLOG = 2048  # uvicorn's default


def _bind(host: str, port: int, *, reuse_port: bool) -> socket.socket:
    """A TCP socket bound to `host:port` (its first address, as uvicorn binds one socket)."""
    family, kind, proto, _, address = socket.getaddrinfo(host or None, port, type=socket.SOCK_STREAM,
                                                         flags=socket.AI_PASSIVE)[0]
    sock = socket.socket(family, kind, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        if reuse_port:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        sock.bind(address)
    except OSError:
        sock.close()
        raise
    return sock


def _stop_with(parent: int) -> None:
    """In a worker: be sent SIGTERM (a graceful stop) when the parent dies. A parent killed outright
    (SIGKILL, the OOM killer) cannot stop its workers, which would serve on unsupervised, holding
    the ports. Linux only (prctl PR_SET_PDEATHSIG); elsewhere workers outlive a killed parent."""
    if sys.platform.startswith("linux"):
        with contextlib.suppress(OSError, AttributeError):
            ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # 1 = PR_SET_PDEATHSIG
    if os.getppid() != parent:  # it died before that took effect
        os.kill(os.getpid(), signal.SIGTERM)  # blocked until the worker serves: then a graceful stop


def _cannot(flag: str, host: str, port: int, exc: OSError) -> tuple[str, int]:
    return f"{flag}: cannot listen on {address(host, port)}: {why_not(exc)}", 1


def supervise(config: Config, run_worker: Callable[[Config, Worker], int]) -> tuple[str, int]:
    """Runs `config.workers` workers until stopped. Each forked worker calls `run_worker` with the
    config it must serve (its ports the real ones) and its Worker; it serves and returns its exit
    code. Returns ("", 0) after a clean stop, else the one line to print (empty when already
    logged) and the exit code."""
    if not hasattr(os, "fork") or not hasattr(socket, "SO_REUSEPORT"):
        return "--workers: more than 1 needs fork() and SO_REUSEPORT (Linux)", 2
    try:
        hold = _bind(config.host, config.port, reuse_port=True)  # the gRPC port, for the workers only
    except OSError as exc:
        return _cannot("--port", config.host, config.port, exc)
    with hold:
        http: socket.socket | None = None
        if config.http_port:
            try:
                http = _bind(config.host, config.http_port, reuse_port=False)
                http.listen(BACKLOG)
            except OSError as exc:
                return _cannot("--http-port", config.host, config.http_port, exc)
        # Port 0 is picked once, here: every worker binds (gRPC) or serves (HTTP) the same real port.
        config = replace(config, port=hold.getsockname()[1],
                         http_port=http.getsockname()[1] if http is not None else 0)
        return _Parent(config, run_worker, hold, http).run()


class _Parent:
    def __init__(self, config: Config, run_worker: Callable[[Config, Worker], int], hold: socket.socket,
                 http: socket.socket | None) -> None:
        self.config = config
        self.run_worker = run_worker
        self.hold = hold
        self.http = http
        self.table = WorkerTable(config.workers)
        self.pids: dict[int, int] = {}  # index -> pid of the workers not yet reaped
        self.all_pids: list[int] = []
        self.failure: tuple[str, int] | None = None  # the first problem: what the parent reports and exits with
        self.deadline: float | None = None  # set once stopping: every worker must have exited by then
        self.parent = os.getpid()

    def run(self) -> tuple[str, int]:
        pending: list[int] = []
        previous = {sig: signal.signal(sig, lambda number, _frame: pending.append(number)) for sig in SIGNALS}
        try:
            signal.pthread_sigmask(signal.SIG_BLOCK, SIGNALS)  # each worker unblocks them once it can handle them
            try:
                for index in range(self.config.workers):
                    self._fork(index)
            except OSError as exc:  # fork refused (process or memory limits): stop those that started
                self.failure = (f"--workers: cannot start worker {len(self.pids)}: {exc.strerror or exc}", 1)
                self._stop()
            finally:
                signal.pthread_sigmask(signal.SIG_UNBLOCK, SIGNALS)
            if self.http is not None:
                self.http.close()  # the workers hold it: a parent copy would keep connections queued after they exit
            self._watch(pending)
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)
        return self.failure or ("", 0)

    def _fork(self, index: int) -> None:
        pid = os.fork()
        if pid:
            self.pids[index] = pid
            self.all_pids.append(pid)
            return
        code = 1  # the worker: it never returns into the parent's code
        try:
            _stop_with(self.parent)
            self.hold.close()
            signal.signal(signal.SIGINT, signal.default_int_handler)
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
            signal.signal(signal.SIGHUP, signal.SIG_DFL)
            code = self.run_worker(self.config, Worker(index, self.table, self.http))
        except BaseException as exc:
            self.table.report(index, f"worker {index}: {type(exc).__name__}: {exc}")
        finally:
            for stream in (sys.stdout, sys.stderr):
                with contextlib.suppress(Exception):
                    stream.flush()
            os._exit(code)

    def _signal(self, number: int) -> None:
        for pid in self.pids.values():
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, number)

    def _stop(self) -> None:
        if self.deadline is None:
            cfg = self.config
            self.deadline = time.monotonic() + cfg.drain_seconds + 2 * cfg.grace_seconds + STOP_MARGIN_S
            self._signal(signal.SIGTERM)

    def _watch(self, pending: list[int]) -> None:
        announced = False
        while self.pids:
            while pending:
                number = pending.pop(0)
                if number == signal.SIGHUP:
                    self._signal(number)
                elif self.deadline is None:
                    self._stop()
                else:
                    self._signal(number)  # a second Ctrl-C or SIGTERM: passed on as well
            self._reap()
            if not announced and self.failure is None and self.deadline is None and all(
                    self.table.state(i) != STARTING for i in range(self.config.workers)):
                announced = True
                log.info("serving", extra={"fields": {
                    "grpc": address(self.config.host, self.config.port), "http": self.config.http_port,
                    "workers": self.config.workers, "pids": self.all_pids}})
            if self.deadline is not None and time.monotonic() > self.deadline and self.pids:
                log.error("workers did not stop in time; killed", extra={"fields": {"pids": list(self.pids.values())}})
                self.failure = self.failure or ("", 1)
                self._signal(signal.SIGKILL)
                self.deadline = float("inf")
            time.sleep(POLL_S)
        if announced:  # (a start-up failure is its one line alone, as without workers)
            log.info("stopped", extra={"fields": {"workers": self.config.workers, "failed": self.failure is not None}})

    def _reap(self) -> None:
        for index, pid in list(self.pids.items()):
            done, status = os.waitpid(pid, os.WNOHANG)
            if not done:
                continue
            del self.pids[index]
            code = os.waitstatus_to_exitcode(status)
            started = self.table.state(index) != STARTING
            self.table.set_state(index, DOWN)  # the others stop reporting SERVING now
            if code == 0 and self.deadline is not None:
                continue  # drained and stopped, as asked
            if self.failure is None:
                self.failure = self._describe(index, pid, code, started)
            self._stop()  # a worker that leaves unasked stops them all (see the module docstring)

    def _describe(self, index: int, pid: int, code: int, started: bool) -> tuple[str, int]:
        """The first failure: a start-up one is the line to print (the worker's own words) with the
        worker's exit code; a later one is logged here, in one line, and makes the exit code 1."""
        how = f"code {code}"
        if code < 0:
            how = f"signal {signal.Signals(-code).name}" if -code in signal.valid_signals() else f"signal {-code}"
        said = self.table.reported(index)
        if not started and self.deadline is None:
            return said or f"--workers: worker {index} exited with {how} while starting", code if code in (1, 2) else 1
        fields: dict[str, object] = {"worker": index, "pid": pid, "exit": how}
        if said:
            fields["error"] = said
        log.error("worker exited" if self.deadline is None else "worker failed while stopping",
                  extra={"fields": fields})
        return "", 1
