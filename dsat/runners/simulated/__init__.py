"""The simulated runner: a performance function instead of training (tests and benchmarks)."""
