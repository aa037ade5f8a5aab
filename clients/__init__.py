"""Client programs for uibus: a typed asyncio client library and the `uibus` CLI."""
