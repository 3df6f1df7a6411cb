"""The command-line front: the run entry point, --help, and the user's other commands (chat,
compare, evaluate)."""
