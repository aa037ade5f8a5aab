"""uibus benchmarks: the same scenarios against uibus and a raw grpc.aio baseline, as ratios."""
