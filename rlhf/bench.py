"""``python -m rlhf.bench``: the entry point of :mod:`rlhf.tools.bench` (``reference``: of
:mod:`rlhf.tools.reference_bench`, which runs on the bench's helpers)."""

import sys

from rlhf.tools.bench import main

if __name__ == "__main__":
    if sys.argv[1:2] == ["reference"]:
        from rlhf.tools.reference_bench import main as reference

        reference(sys.argv[2:])
    else:
        main()
