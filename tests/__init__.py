"""uibus's tests. Importing uibus first sets gRPC's fork support off before grpc loads (see uibus/__init__)."""

import uibus  # noqa: F401
