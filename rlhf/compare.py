"""``python -m rlhf.compare``: the entry point of :mod:`rlhf.tools.compare`."""

from rlhf.tools.compare import main

if __name__ == "__main__":
    raise SystemExit(main())
