"""The ways in other than the grpc.aio server itself: gRPC-Web and the neuro-san HTTP API on the
HTTP port (with the webview page, health and metrics), the CodeBolt WebSocket, and in-process
channels.

Every one of them runs the very same pipeline-wrapped handlers the gRPC server runs (looked up in
the app's registry) with a `uibus.edge.calls.CallContext`, driven by the one driver `uibus.edge.calls.drive`
(deadlines, disconnects, done callbacks), and only translates framing (a `uibus.edge.calls.Sink`):
statuses, tokens, store outages, failures and metrics are the pipeline's, so a request gets the
same answer whichever way it arrives. A new transport is a framing module (its Sink) plus its
`drive(...)` line, and a route or mount on the HTTP port.
"""
