"""gRPC servicers. Each depends on the bus and the store, never the other way round."""
