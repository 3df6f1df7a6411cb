"""``python -m rlhf.bench`` moved to ``python -m benchmarks`` (the benchmarks are developer tools,
not in the wheel): this module only says so, on stderr, and exits 2."""

import sys

if __name__ == "__main__":
    print(
        "error: the benchmarks moved: run `python -m benchmarks ...` (same arguments) from the "
        "root of a repository checkout",
        file=sys.stderr,
    )
    raise SystemExit(2)
