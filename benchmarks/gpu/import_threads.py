"""Which imports start threads or the CUDA driver (the GPU check's first item, benchmarks/README.md).

A warm worker forks trials only while nothing an import started would be lost in the child, so
this imports the modules named, in turn, in one fresh interpreter, and prints after each the new
threads (by name, from /proc) and whether torch has a CUDA context (the driver can be loaded
without one: DeepSpeed's import starts a ``cuda...`` thread while torch says no).

    python3 benchmarks/gpu/import_threads.py determined torch model transformers deepspeed dsat
"""

from __future__ import annotations

import importlib
import os
import sys
import time
from collections import Counter


def thread_names() -> Counter[str]:
    names: Counter[str] = Counter()
    for task in os.listdir("/proc/self/task"):
        with open(f"/proc/self/task/{task}/comm") as comm:
            names[comm.read().strip()] += 1
    return names


def main(modules: list[str]) -> None:
    seen = thread_names()
    for name in modules:
        started = time.perf_counter()
        importlib.import_module(name)
        now = thread_names()
        torch = sys.modules.get("torch")
        context = bool(torch is not None and torch.cuda.is_initialized())
        new = ", ".join(f"{n} x{c}" for n, c in sorted((now - seen).items())) or "none"
        print(
            f"{name}: {time.perf_counter() - started:.1f} s, {sum(now.values())} threads, "
            f"new: {new}; torch CUDA context: {context}",
            flush=True,
        )
        seen = now


if __name__ == "__main__":
    sys.path.insert(0, os.getcwd())  # the example's own modules (model) from where it is run
    main(sys.argv[1:])
