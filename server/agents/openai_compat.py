"""Any OpenAI-compatible streaming chat endpoint (OpenAI, Ollama, vLLM, llama.cpp server, …).

`POST {base_url}/chat/completions` with `stream: true`; the reply arrives as server-sent events,
`data: {json}` lines whose `choices[0].delta.content` is the next piece, ending with
`data: [DONE]`. The conversation is rebuilt from the ChatContext on every turn, so the model
sees what the session said before even after a restart. Options::

    base_url     "http://127.0.0.1:11434/v1" (required; the part before /chat/completions)
    model        "llama3.2" (required)
    api_key_env  name of the environment variable holding the key (optional: Ollama needs none)
    system_prompt, temperature, max_tokens   (optional)
    connect_timeout_s (10), read_timeout_s (300: longest silence between two pieces)
"""

from __future__ import annotations

import os
from collections.abc import AsyncIterator
from typing import Any

from uibus.agents import AgentError, AgentSpec, Backend, Piece, Turn, check_options, option, seconds
from uibus.agents.http import HttpClient, json_object, lines


class OpenAICompatAgent(Backend):
    def __init__(self, spec: AgentSpec) -> None:
        super().__init__(spec)
        check_options(spec, {"base_url", "model", "api_key_env", "system_prompt", "temperature", "max_tokens",
                             "connect_timeout_s", "read_timeout_s"})
        base = option(spec, "base_url", str, required=True).rstrip("/")
        if not base.startswith(("http://", "https://")):
            raise ValueError(f"agent {spec.name!r}: base_url must start with http:// or https://, not {base!r}")
        self.url = base + "/chat/completions"
        self.model = option(spec, "model", str, required=True)
        self.api_key_env = option(spec, "api_key_env", str, "")
        self.system_prompt = option(spec, "system_prompt", str, "")
        self.extra: dict[str, Any] = {}
        for key, kind in (("temperature", (int, float)), ("max_tokens", int)):
            value = option(spec, key, kind)
            if value is not None:
                self.extra[key] = value
        self.http = HttpClient(seconds(spec, "connect_timeout_s", 10), seconds(spec, "read_timeout_s", 300))

    def messages(self, turn: Turn) -> list[dict[str, str]]:
        out = [{"role": "system", "content": self.system_prompt}] if self.system_prompt else []
        out += [{"role": role, "content": text} for role, text in turn.history]
        out.append({"role": "user", "content": turn.text})
        return out

    def headers(self) -> dict[str, str]:
        headers = {"Accept": "text/event-stream"}
        if self.api_key_env:
            key = os.environ.get(self.api_key_env, "")
            if not key:
                raise AgentError(f"the API key variable {self.api_key_env} is not set on the server")
            headers["Authorization"] = f"Bearer {key}"
        return headers

    async def stream(self, turn: Turn) -> AsyncIterator[Piece]:
        body = {"model": self.model, "messages": self.messages(turn), "stream": True, **self.extra}
        async with self.http.open_stream(self.url, body, self.headers()) as resp:
            async for line in lines(resp):
                if not line.startswith("data:"):
                    continue  # blank separators, `event:`/`id:` fields and `:` comments
                data = line[5:].strip()
                if data == "[DONE]":
                    return
                piece = self.parse(data)
                if piece:
                    yield piece

    def parse(self, data: str) -> str:
        event = json_object(self.url, data, "event")
        if "error" in event:
            err = event["error"]
            raise AgentError(f"{self.url}: {err.get('message', err) if isinstance(err, dict) else err}")
        choices = event.get("choices") or []
        if not choices or not isinstance(choices[0], dict):
            return ""  # e.g. a final usage-only event
        content = (choices[0].get("delta") or {}).get("content")
        return content if isinstance(content, str) else ""

    async def aclose(self) -> None:
        await self.http.aclose()
