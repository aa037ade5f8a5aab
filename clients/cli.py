"""The `uibus` command line: run the server, and poke at a running one.

    uibus serve                                  # run the service on embedded defaults
    uibus subscribe subscribeToTheme             # print events as JSON lines until Ctrl-C
    uibus subscribe partialMessage --since 41    # what changed after seq 41, then live
    uibus publish theme '{"kind":"dark"}'        # publish a UI event as the host
    uibus call scrollToSettings '{"value":"x"}'  # call any RPC with a JSON request
    uibus call uibus.v1.SessionService/CreateSession '{"title":"q1"}' --session q1
    uibus --version                              # the installed uibus version

Replies print as JSON with every field, zero values included ({"subscribers": 0}, not {}).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
from collections.abc import Callable

import grpc
from google.protobuf import json_format

from uibus import version
from uibus.clients import ext_ui_stdio
from uibus.clients.connection import Connection, to_json
from uibus.infra.session import SINCE_KEY
from uibus.pb.cline import common_pb2, ui_pb2
from uibus.pb.uibus.v1 import host_pb2

SUBSCRIPTIONS = [m for m in ui_pb2.DESCRIPTOR.services_by_name["UiService"].methods_by_name
                 if m.startswith("subscribeTo")]
RESUMABLE = ("subscribeToPartialMessage",)  # the UiService stream that takes a cursor; the others are live only
BUTTONS = {"mcp": host_pb2.BUTTON_MCP, "history": host_pb2.BUTTON_HISTORY, "chat": host_pb2.BUTTON_CHAT,
           "account": host_pb2.BUTTON_ACCOUNT, "settings": host_pb2.BUTTON_SETTINGS}


def _connection(ns: argparse.Namespace) -> Connection:
    return Connection(ns.target, session=ns.session, token=ns.token, tls=ns.tls)


def _since(ns: argparse.Namespace) -> tuple[tuple[str, str], ...]:
    """The cursor as the resumable streams take it (metadata `x-uibus-since`)."""
    return () if ns.since is None else ((SINCE_KEY, str(ns.since)),)


def _cursor(value: str) -> int:
    if not value.isdigit():
        raise argparse.ArgumentTypeError(f"{value!r} is not a sequence number (a non-negative integer)")
    return int(value)


def _since_option(p: argparse.ArgumentParser, what: str) -> None:
    p.add_argument("--since", type=_cursor, metavar="SEQ",
                   help=f"resume after this sequence number (a message's `seq`): {what} (docs/streams/resume.md)")


def _client_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--target", default=os.environ.get("UIBUS_TARGET", "localhost:26040"),
                   help="server address (env UIBUS_TARGET)")
    p.add_argument("--session", default=os.environ.get("UIBUS_SESSION", "default"),
                   help="session name (env UIBUS_SESSION)")
    p.add_argument("--token", default=os.environ.get("UIBUS_TOKEN", ""), help="bearer token (env UIBUS_TOKEN)")
    p.add_argument("--tls", action="store_true", help="connect with TLS")


async def _subscribe(ns: argparse.Namespace) -> int:
    rpc = ns.rpc if ns.rpc.startswith("subscribeTo") else "subscribeTo" + ns.rpc[:1].upper() + ns.rpc[1:]
    if rpc not in SUBSCRIPTIONS:
        print(f"uibus subscribe: unknown stream {ns.rpc!r}; one of: {', '.join(SUBSCRIPTIONS)}", file=sys.stderr)
        return 2
    if ns.since is not None and rpc not in RESUMABLE:
        print(f"uibus subscribe: {rpc} is live only; --since resumes {', '.join(RESUMABLE)} "
              "(docs/streams/resume.md)", file=sys.stderr)
        return 2
    request: dict[str, object] = {}
    if rpc == "subscribeToFocusChatInput":
        request["value"] = ns.client_id
    elif ns.provider:
        request["providerType"] = ns.provider
    async with _connection(ns) as conn:
        async for line in conn.call_json(f"cline.UiService/{rpc}", json.dumps(request), _since(ns)):
            print(line, flush=True)
    return 0


async def _publish(ns: argparse.Namespace) -> int:
    host = None
    async with _connection(ns) as conn:
        host = conn.host
        event, args = ns.event, ns.args
        calls: dict[str, Callable[[], object]] = {
            "add-to-input": lambda: host.PublishAddToInput(host_pb2.TextEvent(text=" ".join(args))),
            "theme": lambda: host.SetTheme(host_pb2.TextEvent(text=" ".join(args))),
            "relinquish-control": lambda: host.PublishRelinquishControl(common_pb2.Empty()),
            "did-become-visible": lambda: host.PublishDidBecomeVisible(common_pb2.Empty()),
            "focus-chat-input": lambda: host.PublishFocusChatInput(
                host_pb2.FocusChatInput(client_id=args[0] if args else "")),
            "announcement": lambda: host.SetAnnouncement(
                host_pb2.AnnouncementState(latest_announcement_id=args[0] if args else "")),
            "partial-message": lambda: host.PublishPartialMessage(
                json_format.Parse(" ".join(args) or "{}", ui_pb2.ClineMessage())),
        }
        if event == "button":
            if not args or args[0] not in BUTTONS:
                print(f"uibus publish button: name one of {', '.join(BUTTONS)}", file=sys.stderr)
                return 2
            click = host_pb2.ButtonClick(button=BUTTONS[args[0]])
            if len(args) > 1:
                click.provider_type = ui_pb2.WebviewProviderType.Value(args[1].upper())
            print(to_json(await host.PublishButtonClick(click)))
            return 0
        if event not in calls:
            print(f"uibus publish: unknown event {event!r}; one of: button, {', '.join(calls)}", file=sys.stderr)
            return 2
        print(to_json(await calls[event]()))  # type: ignore[misc]
    return 0


async def _call(ns: argparse.Namespace) -> int:
    async with _connection(ns) as conn:
        try:
            async for line in conn.call_json(ns.rpc, ns.json, _since(ns)):
                print(line, flush=True)
        except LookupError as exc:
            print(f"uibus call: {exc.args[0]}", file=sys.stderr)
            return 2
    return 0


def _async_command(fn: Callable[[argparse.Namespace], object]) -> Callable[[argparse.Namespace], int]:
    def run(ns: argparse.Namespace) -> int:
        try:
            return asyncio.run(fn(ns))  # type: ignore[arg-type]
        except KeyboardInterrupt:
            return 130
        except grpc.aio.AioRpcError as exc:
            print(f"uibus: {exc.code().name}: {exc.details()}", file=sys.stderr)
            return 1
        except (ValueError, json_format.ParseError) as exc:
            print(f"uibus: {exc}", file=sys.stderr)
            return 2
    return run


def build_parser() -> argparse.ArgumentParser:
    from uibus.app.main import add_parser as add_serve

    parser = argparse.ArgumentParser(prog="uibus", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--version", action="version", version=f"uibus {version()}")
    sub = parser.add_subparsers(dest="command", required=True)
    add_serve(sub)

    p = sub.add_parser("subscribe", help="print a UiService stream as JSON lines until Ctrl-C")
    p.add_argument("rpc", help="e.g. subscribeToPartialMessage or partialMessage")
    p.add_argument("--provider", choices=["SIDEBAR", "TAB"], help="provider type for button streams")
    p.add_argument("--client-id", default="cli", help="client id for subscribeToFocusChatInput")
    _since_option(p, "the latest state of every message that changed after it comes first, then live")
    _client_options(p)
    p.set_defaults(func=_async_command(_subscribe))

    p = sub.add_parser("publish", help="publish a UI event as the host")
    p.add_argument("event", help="add-to-input, button, partial-message, theme, relinquish-control, "
                                 "focus-chat-input, did-become-visible, announcement")
    # default=[]: without it argparse calls a `*` positional required ("required: event, args").
    p.add_argument("args", nargs="*", default=[], help="the event's text / JSON / button name [provider type]")
    _client_options(p)
    p.set_defaults(func=_async_command(_publish))

    p = sub.add_parser("call", help="call any RPC uibus serves with a JSON request; prints JSON responses "
                                     "(a stream's as JSON lines)")
    p.add_argument("rpc", help="method name, e.g. scrollToSettings, uibus.v1.SessionService/CreateSession or "
                               "hello_world.AgentService/StreamingChat")
    p.add_argument("json", nargs="?", default="{}", help="request as proto3 JSON")
    _since_option(p, "for the streams that resume")
    _client_options(p)
    p.set_defaults(func=_async_command(_call))

    for extra in EXTRA_COMMANDS:
        extra(sub, _client_options)
    return parser


# Further subcommands (chat, ext-ui-stdio, …) register here: fn(subparsers, add_client_options).
EXTRA_COMMANDS: list[Callable[[argparse._SubParsersAction, Callable[[argparse.ArgumentParser], None]], None]] = []  # type: ignore[type-arg]
EXTRA_COMMANDS.append(ext_ui_stdio.add_command)

from uibus.clients import chat_cli  # noqa: E402 - registers itself below

EXTRA_COMMANDS.append(chat_cli.add_parser)

from uibus.clients import acp_cli  # noqa: E402 - `uibus acp`: uibus as an editor's ACP agent

EXTRA_COMMANDS.append(acp_cli.add_parser)

from uibus.clients import audit_cli  # noqa: E402 - `uibus audit verify|export`: the audit log, from its store

EXTRA_COMMANDS.append(audit_cli.add_parser)

from uibus.clients import backup_cli  # noqa: E402 - `uibus backup DEST`: one consistent copy of the SQLite store

EXTRA_COMMANDS.append(backup_cli.add_parser)


def main(argv: list[str] | None = None) -> int:
    """Runs one subcommand. An unknown flag is reported by that subcommand's parser (its usage and
    `uibus serve: error: …`), not the top-level one, whose usage lists only the subcommand names."""
    parser = build_parser()
    ns, unknown = parser.parse_known_args(argv)
    if unknown:
        sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
        (sub.choices.get(ns.command) or parser).error(f"unrecognized arguments: {' '.join(unknown)}")
    return int(ns.func(ns) or 0)


if __name__ == "__main__":
    sys.exit(main())
