"""The local runner: trials as processes on this machine, one slot pool, warm workers, guards against leftovers."""
