"""`kvtool bench`: seeded token-id workloads against a producer/consumer pair, scored against an
ideal-reuse oracle, with every consumer answer checked against a recomputation."""
