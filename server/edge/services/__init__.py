"""The gRPC servicers: each translates its protocol's messages to calls on the domain core and
back. They raise domain errors and never abort by hand: the handler pipeline reports them."""
