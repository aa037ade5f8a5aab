"""Calls that do not arrive as native gRPC: the context they run with (`context`) and the one
driver that runs them for every transport (`driver`).

A transport builds a `CallContext`, looks up the pipeline-wrapped handler, and calls `drive` with a
`Sink` of its framing (or `stream` when its caller pulls the messages); `unary` is `drive` for
callers inside uibus that want the reply itself.
"""

from uibus.edge.calls.context import Aborted, CallContext, Metadata, Rejected, decode, text_metadata
from uibus.edge.calls.driver import DEADLINE_DETAILS, Outcome, Sink, drive, responses, stream, unary

__all__ = ["DEADLINE_DETAILS", "Aborted", "CallContext", "Metadata", "Outcome", "Rejected", "Sink", "decode",
           "drive", "responses", "stream", "text_metadata", "unary"]
