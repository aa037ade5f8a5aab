"""A prompt's content blocks as a uibus turn takes them: the text the hosted agent reads and the
attachments (neuro-san's mime_data) it takes, whichever ACP version the editor speaks (v1 and the
v2 draft name the blocks alike)."""

from __future__ import annotations

import base64
import binascii
from typing import Any

from uibus.infra.jsonrpc import INVALID_PARAMS, RpcError
from uibus.pb.neuro_san.api.grpc import mime_data_pb2


def _media(block: dict[str, Any], data: Any, mime: Any, what: str) -> tuple[str, bytes]:
    if not isinstance(data, str) or not isinstance(mime, str) or "/" not in mime:
        raise RpcError(INVALID_PARAMS, f"{what} needs its data (base64) and its mimeType")
    try:
        return mime, base64.b64decode(data, validate=True)
    except (binascii.Error, ValueError):
        raise RpcError(INVALID_PARAMS, f"{what}'s data is not base64") from None


def prompt_of(blocks: Any, accepts: dict[str, bool]) -> tuple[str, list[mime_data_pb2.MimeData]]:
    """A prompt's content blocks as the turn's text and attachments (neuro-san's mime_data, which
    reach the hosted agent as its protocol has them): text as it is, an embedded resource's text
    inlined, links as their URI; images and embedded blobs as attachments, refused (-32602) where
    the hosted agent takes none (`accepts`, what `initialize` advertised)."""
    if not isinstance(blocks, list) or not blocks:
        raise RpcError(INVALID_PARAMS, "prompt must be a non-empty array of content blocks")
    parts: list[str] = []
    attached: list[mime_data_pb2.MimeData] = []
    for block in blocks:
        kind = block.get("type") if isinstance(block, dict) else None
        if kind == "text" and isinstance(block.get("text"), str):
            parts.append(block["text"])
        elif kind == "image" and isinstance(block, dict):
            if not accepts.get("image"):
                raise RpcError(INVALID_PARAMS, "the hosted agent takes no images (promptCapabilities.image is "
                                               "false): send the prompt without the image")
            mime, data = _media(block, block.get("data"), block.get("mimeType"), "an image block")
            attached.append(mime_data_pb2.MimeData(mime_type=mime, mime_bytes=data))
        elif kind == "resource" and isinstance(block.get("resource"), dict):
            resource = block["resource"]
            if isinstance(resource.get("text"), str):
                parts.append(f"\n<resource uri=\"{resource.get('uri', '')}\">\n{resource['text']}\n</resource>\n")
            elif isinstance(resource.get("blob"), str):
                if not accepts.get("embeddedContext"):
                    raise RpcError(INVALID_PARAMS, "the hosted agent takes no attached files (promptCapabilities"
                                                   ".embeddedContext is false): embed text, or send no blob")
                mime, data = _media(resource, resource["blob"], resource.get("mimeType"), "an embedded blob")
                attached.append(mime_data_pb2.MimeData(mime_type=mime, mime_bytes=data))
            else:
                raise RpcError(INVALID_PARAMS, "an embedded resource must carry its text or a blob")
        elif kind == "resource_link" and isinstance(block.get("uri"), str):
            parts.append(block["uri"])
        else:
            raise RpcError(INVALID_PARAMS, f"content block of type {str(kind)[:40]!r} is not supported here "
                                           "(text, image, resource, resource_link)")
    return "".join(parts), attached
