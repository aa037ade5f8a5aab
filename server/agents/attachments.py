"""Attachments of a turn (images and files a UI sent with the user message, neuro-san's
`ChatMessage.mime_data`) in each protocol's words, refused clearly where the agent takes none:

* ACP: an image is an `image` content block (when the agent's `promptCapabilities.image`), any
  other file a `resource` block with the embedded text or base64 blob (when
  `promptCapabilities.embeddedContext`);
* pi (RPC mode): images go in the prompt's `images`; pi takes no other files.

A refusal is an AgentError, so the turn's answer says what the agent lacks and nothing is sent.
"""

from __future__ import annotations

import base64
from typing import Any

from uibus.agents import AgentError, Turn

TEXTUAL = ("text/", "application/json", "application/xml", "application/javascript", "application/x-yaml")


def _b64(data: bytes) -> str:
    return base64.b64encode(data).decode("ascii")


def acp_prompt(turn: Turn, capabilities: dict[str, Any], agent: str) -> list[dict[str, Any]]:
    """The `session/prompt` content blocks of a turn: its text, then one block per attachment."""
    blocks: list[dict[str, Any]] = [{"type": "text", "text": turn.text}]
    accepts = capabilities.get("promptCapabilities") if isinstance(capabilities.get("promptCapabilities"), dict) \
        else {}
    for n, (mime, data) in enumerate(turn.attachments, 1):
        if mime.startswith("image/"):
            if not accepts.get("image"):
                raise AgentError(f"{agent} takes no images (its promptCapabilities.image is not true); "
                                 "send the message without the image")
            blocks.append({"type": "image", "mimeType": mime, "data": _b64(data)})
            continue
        if not accepts.get("embeddedContext"):
            raise AgentError(f"{agent} takes no attached files (its promptCapabilities.embeddedContext is not "
                             f"true); send the message without the {mime} file")
        resource: dict[str, Any] = {"uri": f"attachment:///{n}", "mimeType": mime}
        if mime.startswith(TEXTUAL):
            resource["text"] = data.decode("utf-8", errors="replace")
        else:
            resource["blob"] = _b64(data)
        blocks.append({"type": "resource", "resource": resource})
    return blocks


def pi_images(turn: Turn, agent: str) -> dict[str, Any]:
    """The `images` of pi's `prompt` command (none: no field)."""
    images = []
    for mime, data in turn.attachments:
        if not mime.startswith("image/"):
            raise AgentError(f"{agent} takes images only, not a {mime} file; send the message without it")
        images.append({"type": "image", "data": _b64(data), "mimeType": mime})
    return {"images": images} if images else {}


INLINE_IMAGE_B64 = 256 * 1024  # an agent's image up to this much base64 is shown inline in its reply


def image_markdown(mime: str, data: str) -> str:
    """An image an agent sent (ACP `image` content): inline as a markdown data URL, which the page
    renders (sanitized), when it is a small raster image; else a line naming it, so a reply (and the
    chat context it is kept in) never carries megabytes of base64."""
    raster = mime in ("image/png", "image/jpeg", "image/gif", "image/webp")
    if raster and data and len(data) <= INLINE_IMAGE_B64 and all(c.isalnum() or c in "+/=" for c in data):
        return f"\n![image](data:{mime};base64,{data})\n"
    return f"\n[image: {mime or 'unknown type'}, {len(data) * 3 // 4} bytes]\n"
