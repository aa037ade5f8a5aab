"""uibus: one gRPC service for coding-agent user interfaces."""
