"""`uibus serve`: run the service until SIGTERM/SIGINT, then shut down gracefully and exit 0."""

from __future__ import annotations

import argparse
import asyncio
import logging
import signal
import sys

from uibus import logs
from uibus.config import Config


async def serve(config: Config) -> None:
    from uibus.app import App

    async with App(config):
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        await stop.wait()


def add_parser(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    p = sub.add_parser("serve", help="run the uibus server")
    Config.add_arguments(p)
    p.set_defaults(func=run)


def run(ns: argparse.Namespace) -> int:
    try:
        config = Config.from_args(ns)
    except ValueError as exc:
        print(f"uibus serve: {exc}", file=sys.stderr)
        return 2
    logs.setup(config.log_level)
    try:
        asyncio.run(serve(config))
    except (RuntimeError, OSError, ValueError) as exc:  # port taken, unreadable TLS files, bad agents file
        logging.getLogger("uibus").error("cannot start", extra={"fields": {"error": str(exc)}})
        return 1
    return 0

