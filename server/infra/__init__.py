"""The lowest layer: what every other layer stands on and which knows no domain meaning — the
configuration, the errors, the bus and the stores (SQLite, Redis), the session log's storage,
telemetry, tokens and quotas, and the JSON-RPC peer. Nothing here imports anything above it
(tests/test_architecture.py reads the folders)."""
