"""An agent of an upstream neuro-san server, reached through its HTTP API.

`POST {base_url}/api/v1/{agent}/streaming_chat` with a ChatRequest as JSON answers
`application/json-lines`: one ChatResponse JSON per line (keep-alive lines carry no `response`).
We always ask upstream for MAXIMAL so that our own filter decides what the client sees; every
message but the last is passed through as is (with its origin), and the last, AGENT_FRAMEWORK,
carries the answer and the upstream's ChatContext, which becomes the session's stored context.
Options::

    base_url  "http://127.0.0.1:8080" (required)
    agent     upstream agent name (default: this agent's name)
    connect_timeout_s (10), read_timeout_s (600: upstream agents may think for minutes)
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

from google.protobuf import json_format

from uibus.agents import AgentError, AgentSpec, Backend, Final, Piece, Turn, check_options, option, seconds
from uibus.agents.http import HttpClient, json_object, lines
from uibus.pb.neuro_san.api.grpc import chat_pb2

# Call metadata neuro-san servers read; forwarded so upstream logs line up with ours.
FORWARD_METADATA = ("user_id", "request_id")


class NeuroSanProxyAgent(Backend):
    def __init__(self, spec: AgentSpec) -> None:
        super().__init__(spec)
        check_options(spec, {"base_url", "agent", "connect_timeout_s", "read_timeout_s"})
        base = option(spec, "base_url", str, required=True).rstrip("/")
        if not base.startswith(("http://", "https://")):
            raise ValueError(f"agent {spec.name!r}: base_url must start with http:// or https://, not {base!r}")
        self.upstream = option(spec, "agent", str, spec.name)
        self.url = f"{base}/api/v1/{self.upstream}/streaming_chat"
        self.http = HttpClient(seconds(spec, "connect_timeout_s", 10), seconds(spec, "read_timeout_s", 600))

    def body(self, turn: Turn) -> dict[str, Any]:
        body: dict[str, Any] = {"user_message": {"type": "HUMAN", "text": turn.text},
                                "chat_filter": {"chat_filter_type": "MAXIMAL"}}
        if turn.chat_context.chat_histories:
            body["chat_context"] = json_format.MessageToDict(turn.chat_context, preserving_proto_field_name=True)
        if turn.sly_data:
            body["sly_data"] = turn.sly_data
        return body

    async def stream(self, turn: Turn) -> AsyncIterator[Piece]:
        headers = {k: v for k, v in turn.metadata.items() if k in FORWARD_METADATA}
        async with self.http.open_stream(self.url, self.body(turn), headers) as resp:
            async for line in lines(resp):
                if not line.strip():
                    continue
                message = self.parse(line)
                if message is None:
                    continue
                if message.type == chat_pb2.ChatMessage.AGENT_FRAMEWORK:
                    yield Final(text=message.text,
                                chat_context=message.chat_context if message.HasField("chat_context") else None,
                                sly_data=json_format.MessageToDict(message.sly_data)
                                if message.HasField("sly_data") else None)
                    return
                yield message
        raise AgentError(f"{self.url} ended its stream without a final answer")

    def parse(self, line: str) -> chat_pb2.ChatMessage | None:
        data = json_object(self.url, line, "line")
        response = data.get("response")
        if response is None:
            return None  # keep-alive
        try:
            return json_format.ParseDict(response, chat_pb2.ChatMessage(), ignore_unknown_fields=True)
        except json_format.ParseError as exc:
            raise AgentError(f"{self.url} sent a message that is not a ChatMessage: {exc}") from exc

    async def aclose(self) -> None:
        await self.http.aclose()
