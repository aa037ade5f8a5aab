"""`uibus serve`: run the service until SIGTERM/SIGINT, then shut down gracefully and exit 0;
SIGHUP re-reads `--tokens-file`. With `--workers N` (N > 1) this process becomes the parent of N
worker processes (uibus.app.workers), each of which runs `serve` here."""

from __future__ import annotations

import argparse
import asyncio
import gc
import signal
import socket
import sys
from collections.abc import Callable
from pathlib import Path

from uibus.app.workers import SIGNALS, supervise
from uibus.edge.transports.browser import BrowserPolicy
from uibus.infra import logs
from uibus.infra.config import Config, address, describe, why_not
from uibus.infra.errors import ConfigError
from uibus.infra.store_lock import StoreInUse, holder
from uibus.infra.worker_table import Worker


async def serve(config: Config, worker: Worker | None = None) -> None:
    from uibus.app import App

    async with App(config, worker=worker) as app:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        loop.add_signal_handler(signal.SIGHUP, app.reload_tokens)  # --tokens-file edited: reload it
        if worker is not None:  # blocked since the fork (uibus.app.workers): one sent meanwhile is handled now
            signal.pthread_sigmask(signal.SIG_UNBLOCK, SIGNALS)
        # One full collection now, while nothing is served: until CPython's first full collection its
        # long-lived count is 0, so the first one comes after just 10 middle-generation collections
        # and walks every object startup made (~50,000) under the first requests. After this one, a
        # full collection waits until the survivors since grow by a quarter of that.
        gc.collect()
        await stop.wait()


def add_parser(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    p = sub.add_parser("serve", help="run the uibus server")
    Config.add_arguments(p)
    p.set_defaults(func=run)


def _fail(text: str, code: int) -> int:
    """Prints one start-up error line: operators and supervisors read stderr, and a traceback or a
    usage dump would bury the one thing to fix."""
    print("uibus serve: " + " ".join(line.strip() for line in text.splitlines()), file=sys.stderr)
    return code


def _cannot_listen(host: str, port: int) -> str | None:
    """Why no listener can be bound on `host:port`, or None when one can (or the port is 0, any);
    ConfigError when `host` does not resolve.

    Checked before starting so a taken port is one line: grpc core logs its own C-level error line
    and uvicorn a JSON one when they fail to bind. grpc binds every address the host resolves to and
    fails only when none works, so one bindable address is enough here. SO_REUSEADDR as grpc and
    uvicorn set it: a port in TIME_WAIT is free for them too."""
    try:
        addresses = socket.getaddrinfo(host or None, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as exc:
        raise ConfigError("--host", f"cannot resolve {host!r}: {exc.strerror}") from None
    if not port:
        return None
    reason = "no address to bind"
    for family, kind, proto, _, where in addresses:
        try:
            with socket.socket(family, kind, proto) as probe:
                probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                probe.bind(where)
            return None
        except OSError as exc:
            reason = why_not(exc)
    return reason


def run(ns: argparse.Namespace) -> int:
    """`uibus serve`: 0 after a clean shutdown; 2 with one line for a setting that cannot work (a flag, an
    env var, a file it names); 1 with one line when the machine refuses (a port in use)."""
    try:
        config = Config.from_args(ns)
        BrowserPolicy.from_config(config)  # a bad --allowed-hosts / --cors-origins entry: one line, before any bind
        held = None if config.redis_url or config.store == ":memory:" else holder(Path(config.store).expanduser())
        if held is not None:  # before the ports: a second serve with the same ports is told the cause
            return _fail(describe(held, ns), 1)
        for flag, port in (("--port", config.port), ("--http-port", config.http_port)):
            reason = _cannot_listen(config.host, port)
            if reason:
                return _fail(f"{flag}: cannot listen on {address(config.host, port)}: {reason}", 1)
    except ConfigError as exc:
        return _fail(describe(exc, ns), 2)
    logs.setup(config.log_level)
    if config.workers > 1:
        text, code = supervise(config, lambda resolved, worker: _run_worker(resolved, ns, worker))
    else:
        text, code = _serve(config, ns)
    return _fail(text, code) if text else code


def loop_factory(loop: str) -> Callable[[], asyncio.AbstractEventLoop] | None:
    """The event loop `--loop` names: None for asyncio's own (asyncio.Runner's default), uvloop's
    constructor for uvloop — a well-kept libuv loop that grpc.aio, uvicorn and redis-py run on, and
    that costs 10-17 % less CPU per fan-out delivery here (bench/README.md). `auto` takes uvloop
    when it is installed (uibus depends on it where it exists: not on Windows)."""
    if loop == "asyncio":
        return None
    try:
        import uvloop
    except ImportError:
        if loop == "uvloop":
            raise ConfigError("--loop", "uvloop is not installed (pip install uvloop), or use --loop asyncio") from None
        return None
    return uvloop.new_event_loop


def _serve(config: Config, ns: argparse.Namespace, worker: Worker | None = None) -> tuple[str, int]:
    """Serves until stopped: ("", 0) after a clean shutdown, else the one line to print and the exit code."""
    try:
        with asyncio.Runner(loop_factory=loop_factory(config.loop)) as runner:
            runner.run(serve(config, worker))
    except StoreInUse as exc:  # another uibus took the store since run() asked: a machine state, as a port
        return describe(exc, ns), 1
    except ConfigError as exc:  # the store, TLS, agents or tokens file, found bad while starting
        return describe(exc, ns), 2
    except KeyboardInterrupt:  # Ctrl-C before the signal handlers are installed
        return "", 130
    except RuntimeError as exc:
        if "Failed to bind" in str(exc):  # grpc.aio's words; the port was taken after the check above
            return f"--port: cannot listen on {address(config.host, config.port)}: address in use or not available", 1
        return f"cannot start: {exc}", 1
    except OSError as exc:  # the HTTP port, or a file the OS refused
        return (str(exc) if exc.errno is None else f"cannot start: {why_not(exc)}"
                + (f": {exc.filename}" if exc.filename else "")), 1
    except ValueError as exc:
        return f"cannot start: {exc}", 1
    return "", 0


def _run_worker(config: Config, ns: argparse.Namespace, worker: Worker) -> int:
    """One worker process of `--workers`: its start-up failure goes to the parent, which prints it
    once for all workers (they usually fail alike), instead of N copies of the line."""
    logs.setup(config.log_level, worker=worker.index)
    text, code = _serve(config, ns, worker)
    if text:
        worker.report(" ".join(line.strip() for line in text.splitlines()))
    return code

