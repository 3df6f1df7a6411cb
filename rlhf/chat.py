"""``python -m rlhf.chat``: the entry point of :mod:`rlhf.tools.chat`."""

from rlhf.tools.chat import main

if __name__ == "__main__":
    raise SystemExit(main())
