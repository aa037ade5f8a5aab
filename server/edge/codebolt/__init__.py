"""The CodeBolt agent-to-app protocol (docs/protocols/codebolt.md): the envelope (`protocol`), what the served
actions do on the domain core (`actions`), and the connection engine that runs each frame through
the handler pipeline (`gateway`). The WebSocket framing is `uibus.edge.transports.codebolt_ws`; the UI
side is `uibus.edge.services.codebolt`."""
