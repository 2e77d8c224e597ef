"""The built-in pure-Python CPU hog: `python -m bench.hog N` runs N busy processes until killed.

Each process churns lists and dicts (allocation, hashing, pointer chasing), so it
loads the core and its caches the way interpreter-heavy neighbours do. Processes,
not threads: the GIL would let only one thread run.
"""
from __future__ import annotations

import multiprocessing
import os
import signal
import sys


def churn() -> None:
    signal.signal(signal.SIGTERM, lambda *_: os._exit(0))
    table: dict[int, list[int]] = {}
    i = 0
    while True:
        i += 1
        key = (i * 2654435761) % 100_003
        row = table.setdefault(key, [])
        row.append(i)
        if len(row) > 16:
            row.sort(reverse=True)
            del row[8:]
        if len(table) > 50_000:
            table.clear()


def main(argv: list[str]) -> int:
    try:
        n = int(argv[0]) if argv else 1
    except ValueError:
        print("usage: python -m bench.hog N   (N busy processes)", file=sys.stderr)
        return 2
    if n < 1:
        print("bench.hog: N must be >= 1", file=sys.stderr)
        return 2
    procs = [multiprocessing.Process(target=churn, daemon=True) for _ in range(n)]
    for p in procs:
        p.start()

    def stop(*_):
        for p in procs:
            p.terminate()
        os._exit(0)
    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    for p in procs:
        p.join()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
