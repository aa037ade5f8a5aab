"""`uibus serve`: run the service until SIGTERM/SIGINT, then shut down gracefully and exit 0;
SIGHUP re-reads `--tokens-file`."""

from __future__ import annotations

import argparse
import asyncio
import errno
import signal
import socket
import sys

from uibus import logs
from uibus.config import Config, describe
from uibus.errors import ConfigError


async def serve(config: Config) -> None:
    from uibus.app import App

    async with App(config) as app:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        loop.add_signal_handler(signal.SIGHUP, app.reload_tokens)  # --tokens-file edited: reload it
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


def _address(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def _why_not(exc: OSError) -> str:
    """An OSError in words, without `[Errno 98]`: what the operator can check."""
    reasons = {errno.EADDRINUSE: "address in use", errno.EADDRNOTAVAIL: "address not available on this machine",
               errno.EACCES: "permission denied (ports below 1024 need privileges)"}
    return reasons.get(exc.errno or 0) or (exc.strerror or str(exc)).lower()


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
    for family, kind, proto, _, address in addresses:
        try:
            with socket.socket(family, kind, proto) as probe:
                probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                probe.bind(address)
            return None
        except OSError as exc:
            reason = _why_not(exc)
    return reason


def run(ns: argparse.Namespace) -> int:
    """`uibus serve`: 0 after a clean shutdown; 2 with one line for a setting that cannot work (a flag, an
    env var, a file it names); 1 with one line when the machine refuses (a port in use)."""
    try:
        config = Config.from_args(ns)
        for flag, port in (("--port", config.port), ("--http-port", config.http_port)):
            reason = _cannot_listen(config.host, port)
            if reason:
                return _fail(f"{flag}: cannot listen on {_address(config.host, port)}: {reason}", 1)
    except ConfigError as exc:
        return _fail(describe(exc, ns), 2)
    logs.setup(config.log_level)
    try:
        asyncio.run(serve(config))
    except ConfigError as exc:  # the store, TLS, agents or tokens file, found bad while starting
        return _fail(describe(exc, ns), 2)
    except KeyboardInterrupt:  # Ctrl-C before the signal handlers are installed
        return 130
    except RuntimeError as exc:
        if "Failed to bind" in str(exc):  # grpc.aio's words; the port was taken after the check above
            return _fail(f"--port: cannot listen on {_address(config.host, config.port)}: address in use or "
                         "not available", 1)
        return _fail(f"cannot start: {exc}", 1)
    except OSError as exc:  # the HTTP port, or a file the OS refused
        return _fail(str(exc) if exc.errno is None else f"cannot start: {_why_not(exc)}"
                     + (f": {exc.filename}" if exc.filename else ""), 1)
    except ValueError as exc:
        return _fail(f"cannot start: {exc}", 1)
    return 0

