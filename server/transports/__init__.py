"""The HTTP side of uibus: gRPC-Web, the neuro-san HTTP API, the webview page, health and metrics.

Everything here runs in the grpc.aio server's process and event loop and calls the very same
method handlers the gRPC server runs (through `App.registry.lookup`), so both transports share
servicers, validation, sessions and the bus.
"""
