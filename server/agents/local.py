"""The embedded default agent: deterministic, no network, no key.

It exists so that a fresh install can chat end to end (CLI, webview, real neuro-san clients) and
so that tests and benchmarks have a reply they can predict: it greets, repeats what you said,
recalls your previous message from the ChatContext, mentions the sly_data keys it was given,
and streams the reply in `chunks` pieces `delay_ms` apart. Both can be set per agent in the
config and per request in sly_data (within bounds), so a benchmark can ask for 1,000 chunks.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

from google.protobuf import struct_pb2

from uibus.agents import AgentError, AgentSpec, Backend, Piece, Turn, check_options, option
from uibus.pb.neuro_san.api.grpc import chat_pb2

MAX_CHUNKS = 100_000
MAX_DELAY_MS = 10_000.0


class LocalAgent(Backend):
    def __init__(self, spec: AgentSpec) -> None:
        super().__init__(spec)
        check_options(spec, {"chunks", "delay_ms", "greeting"})
        self.chunks = self._chunks(option(spec, "chunks", int, 8), f"agent {spec.name!r}: option chunks")
        self.delay_ms = self._delay(option(spec, "delay_ms", (int, float), 20), f"agent {spec.name!r}: option "
                                                                                 "delay_ms")
        self.greeting = option(spec, "greeting", str, f"Hello from {spec.name}!")
        # Live counters: how many replies are streaming now, and how many were cut off by a
        # cancel/close (tests and operators use them to see that work really stops).
        self.active = 0
        self.cancelled = 0

    @staticmethod
    def _chunks(value: Any, where: str) -> int:
        if isinstance(value, bool) or not isinstance(value, int | float) or not 1 <= value <= MAX_CHUNKS \
                or int(value) != value:
            raise ValueError(f"{where} must be a whole number from 1 to {MAX_CHUNKS}, not {value!r}")
        return int(value)

    @staticmethod
    def _delay(value: Any, where: str) -> float:
        if isinstance(value, bool) or not isinstance(value, int | float) or not 0 <= value <= MAX_DELAY_MS:
            raise ValueError(f"{where} must be a number of milliseconds from 0 to {MAX_DELAY_MS:g}, not {value!r}")
        return float(value)

    def sly_data_schema(self) -> dict[str, Any]:
        return {"type": "object", "properties": {
            "chunks": {"type": "integer", "minimum": 1, "maximum": MAX_CHUNKS,
                       "description": f"pieces to stream the reply in (default {self.chunks})"},
            "delay_ms": {"type": "number", "minimum": 0, "maximum": MAX_DELAY_MS,
                         "description": f"pause between pieces (default {self.delay_ms:g})"},
        }}

    def reply(self, turn: Turn) -> str:
        """The whole reply; a pure function of the turn, so tests can predict it."""
        earlier = [text for role, text in turn.history if role == "user"]
        parts = [f'{self.greeting} You said: "{turn.text}".']
        if earlier:
            parts.append(f'Earlier you said: "{earlier[-1]}" (this is turn {len(earlier) + 1}).')
        else:
            parts.append("This is the start of our conversation.")
        if turn.sly_data:
            parts.append(f"sly_data keys: {', '.join(sorted(turn.sly_data))}.")
        return " ".join(parts)

    @staticmethod
    def split(text: str, n: int) -> list[str]:
        """`n` non-empty pieces that join to the reply (padded with a count when it is too short)."""
        if len(text) < n:
            extra, i, size = [], 1, len(text)
            while size < n:
                extra.append(str(i))
                size += len(extra[-1]) + 1
                i += 1
            text = text + " " + " ".join(extra)
        size = len(text)
        return [text[i * size // n:(i + 1) * size // n] for i in range(n)]

    async def stream(self, turn: Turn) -> AsyncIterator[Piece]:
        try:
            chunks = self._chunks(turn.sly_data.get("chunks", self.chunks), "sly_data.chunks")
            delay = self._delay(turn.sly_data.get("delay_ms", self.delay_ms), "sly_data.delay_ms") / 1000
        except ValueError as exc:
            raise AgentError(str(exc)) from exc
        pieces = self.split(self.reply(turn), chunks)
        self.active += 1
        try:
            progress = struct_pb2.Struct()
            progress.update({"turn": sum(1 for role, _ in turn.history if role == "user") + 1, "chunks": chunks})
            yield chat_pb2.ChatMessage(type=chat_pb2.ChatMessage.AGENT_PROGRESS, text="composing reply",
                                       structure=progress)
            for i, piece in enumerate(pieces):
                if i and delay:
                    await asyncio.sleep(delay)
                yield piece
        except (asyncio.CancelledError, GeneratorExit):
            self.cancelled += 1
            raise
        finally:
            self.active -= 1
