"""``python -m rlhf.bench``: the entry point of :mod:`rlhf.tools.bench`."""

from rlhf.tools.bench import main

if __name__ == "__main__":
    main()
